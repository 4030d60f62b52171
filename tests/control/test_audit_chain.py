"""Issue 12, points 8 and 13: cheap denied-request audit events, verification on the read-only
connection, and signed checkpoints that expose a chain rebuilt after them.

Real controllers (hypercorn, quart-trio, apsw) on 127.0.0.1; the chain is rewritten the way someone
with the sqlite3 shell and the hashing code would do it.
"""

from __future__ import annotations

import json
import re
import sqlite3
import threading
from pathlib import Path

import attrs
import httpx
import pytest
import trio

from nexa import security
from nexa.config import StoreConfig
from nexa.contracts import codec
from nexa.contracts.api import AuditCheckpoint, SignedAuditCheckpoint
from nexa.contracts.domain import Actor, AuditDraft, AuditEvent, AuditResult, KeyId, Role
from nexa.control import store as st
from nexa.control.access import accounts as reg
from nexa.errors import StoreError
from nexa.telemetry import Metrics
from tests.conftest import Controller, ControllerProcess
from tests.support.api import assert_envelope, make_key
from tests.support.postgres import pg_url_fixture, postgres_fixture, store_cfg_fixture  # noqa: F401

# ---- point 8: denied events are rate-limited per (key, route), their target cut ---------------------


def _suppressed(metrics_text: str, action: str) -> float:
    pattern = rf'^nexa_audit_denied_suppressed_total\{{action="{re.escape(action)}"\}} (\S+)$'
    match = re.search(pattern, metrics_text, re.MULTILINE)
    return float(match.group(1)) if match else 0.0


async def _denied_events(c: Controller, action: str) -> list[dict[str, object]]:
    async with c.client() as http:
        resp = await http.get("/api/v1/audit", params={"action": action, "limit": 1000})
    return [e for e in resp.json()["events"] if e["result"] == "denied"]


@pytest.mark.slow
async def test_a_key_hammering_a_route_it_may_not_call_writes_a_handful_of_audit_events(
    controller: Controller,
) -> None:
    operator = await make_key(controller, "operator")
    started = trio.current_time()
    statuses: list[int] = []

    async def hammer(http: httpx.AsyncClient, n: int) -> None:
        for _ in range(n):
            statuses.append((await http.post("/api/v1/keys", json={"role": "admin"})).status_code)

    async with controller.client(operator) as http, trio.open_nursery() as nursery:
        for _ in range(10):
            nursery.start_soon(hammer, http, 100)
    elapsed = trio.current_time() - started
    assert statuses == [403] * 1000

    events = await _denied_events(controller, "POST /api/v1/keys")
    async with controller.client() as http:
        metrics = (await http.get("/metrics")).text
        keys = (await http.get("/api/v1/keys")).json()["keys"]
    # One event per 5 s window at most (the first at once), every other denial counted instead.
    assert 1 <= len(events) <= 1 + int(elapsed // reg.DENIED_AUDIT_WINDOW_S) + 1
    assert _suppressed(metrics, "POST /api/v1/keys") == 1000 - len(events)
    assert [k["role"] for k in keys] == ["admin", "operator"]  # and nothing was created


async def test_the_window_is_per_route_and_a_long_target_is_cut(controller: Controller) -> None:
    operator = await make_key(controller, "operator")
    long_id = "n" * 5000
    async with controller.client(operator) as http:
        assert_envelope(await http.post(f"/api/v1/nodes/{long_id}/revoke"), 403, "forbidden")
        assert_envelope(await http.post("/api/v1/tenants", json={"id": "x"}), 403, "forbidden")
    revoke = await _denied_events(controller, "POST /api/v1/nodes/<node_id>/revoke")
    tenants = await _denied_events(controller, "POST /api/v1/tenants")
    assert len(revoke) == 1 and len(tenants) == 1  # another route has its own window
    target = revoke[0]["target"]
    assert isinstance(target, str)
    assert len(target) == reg.AUDIT_TARGET_MAX
    assert target.startswith("/api/v1/nodes/nnnn")


async def test_the_next_denied_event_carries_the_count_suppressed_before_it(
    tmp_path: Path, autojump_clock: trio.testing.MockClock, store_cfg: StoreConfig
) -> None:
    async with st.open_store(tmp_path, store_cfg, inline=True) as store:
        metrics = Metrics()
        accounts = await reg.Accounts.load(store, metrics)
        actor = Actor(key_id=KeyId("k1"), role=Role.OPERATOR)
        other = Actor(key_id=KeyId("k2"), role=Role.OPERATOR)
        written = [await accounts.record_denied(actor, "POST /x", "/x", "role operator may not") for _ in range(4)]
        assert [e is not None for e in written] == [True, False, False, False]
        assert await accounts.record_denied(other, "POST /x", "/x", "role operator may not") is not None
        await trio.sleep(reg.DENIED_AUDIT_WINDOW_S)
        later = await accounts.record_denied(actor, "POST /x", "/x", "role operator may not")
        assert later is not None
        assert later.result is AuditResult.DENIED
        assert "3 more denied" in later.detail
        events = await store.run(st.list_audit, st.AuditQuery(action="POST /x"))
        assert len(events) == 3
        assert metrics.audit_denied_suppressed.labels("POST /x")._value.get() == 3
        assert (await store.run(st.verify_audit)).ok


# ---- point 13: verification on a read-only second connection ------------------------------------------


def _draft(action: str) -> AuditDraft:
    return AuditDraft(
        actor_key_id=KeyId("abc"), actor_role=Role.ADMIN, action=action, target="t", prior_sha256=None, next_sha256=None
    )


async def test_a_long_read_does_not_hold_the_store_lane_and_cannot_write(
    tmp_path: Path, store_cfg: StoreConfig
) -> None:
    entered, release = trio.Event(), threading.Event()

    def long_read(db: object) -> None:
        trio.from_thread.run_sync(entered.set)  # runs on the reader's worker thread
        release.wait(30)

    async with st.open_store(tmp_path, store_cfg) as store:
        await store.run(st.record_audit, _draft("before"))
        async with trio.open_nursery() as nursery:
            nursery.start_soon(store.read, long_read)
            await entered.wait()
            # The reader lane is busy for as long as the test says; the writer is not blocked by it.
            with trio.fail_after(20):
                event = await store.run(st.record_audit, _draft("during"))
            release.set()
        assert event.seq == 2
        assert (await store.read(st.verify_audit)).checked == 2  # the reader sees the committed writes
        with pytest.raises(StoreError):
            await store.read(st.record_audit, _draft("through the reader"))
        assert (await store.run(st.verify_audit)).checked == 2


# ---- point 13: signed checkpoints -----------------------------------------------------------------------

_COLUMNS = [f.name for f in attrs.fields(AuditEvent)]


def rewrite_chain(db_path: Path, seq: int, detail: str) -> None:
    """Edit event `seq` and recompute every hash from there on, and the head: a consistent rewrite
    that the chain alone cannot reveal."""
    db = sqlite3.connect(db_path, isolation_level=None, timeout=10)
    try:
        db.execute("BEGIN IMMEDIATE")
        rows = db.execute(f"SELECT {', '.join(_COLUMNS)} FROM audit WHERE seq >= ? ORDER BY seq", (seq,)).fetchall()
        prev = db.execute("SELECT sha256 FROM audit WHERE seq = ?", (seq - 1,)).fetchone()
        prev_sha = prev[0] if prev else st.GENESIS_SHA256
        for row in rows:
            event = codec.store.structure(dict(zip(_COLUMNS, row, strict=True)), AuditEvent)
            if event.seq == seq:
                event = attrs.evolve(event, detail=detail)
            event = attrs.evolve(event, prev_sha256=prev_sha, sha256="")
            event = attrs.evolve(event, sha256=st.event_sha256(event))
            db.execute(
                "UPDATE audit SET detail = ?, prev_sha256 = ?, sha256 = ? WHERE seq = ?",
                (event.detail, event.prev_sha256, event.sha256, event.seq),
            )
            prev_sha = event.sha256
        db.execute("UPDATE meta SET value = ? WHERE key = 'audit_head_sha256'", (prev_sha,))
        db.execute("COMMIT")
    finally:
        db.close()


async def _verify(http: httpx.AsyncClient, head: object | None) -> httpx.Response:
    return await http.post("/api/v1/audit/verify", json=None if head is None else {"against": head})


async def test_a_signed_head_exposes_a_chain_rewritten_consistently_after_it(controller: Controller) -> None:
    audit = await make_key(controller, "audit")
    async with controller.client() as admin:
        for name in ("a", "b", "c"):
            assert (await admin.post("/api/v1/tenants", json={"id": name})).status_code == 201
    async with controller.client(audit) as http:
        head = (await http.get("/api/v1/audit/head")).json()
        public_key = (await http.get("/api/v1/receipts/public-key")).json()["public_key"]
        signed = codec.structure(codec.api, head, SignedAuditCheckpoint)
        security.verify_audit_checkpoint(security.PublicKey.from_b64(public_key), signed)
        assert signed.checkpoint.seq >= 4  # bootstrap key, audit key, three tenants
        seq = signed.checkpoint.seq
        async with controller.client() as admin:
            await admin.post("/api/v1/tenants", json={"id": "d"})  # the chain goes on after the checkpoint
        verdict = (await _verify(http, head)).json()
        assert verdict == {"ok": True, "checked": seq + 1, "first_bad_seq": None, "first_bad_id": None, "reason": None}

        # Rewrite event 2 and every hash after it: the plain check cannot tell, the checkpoint can.
        rewrite_chain(controller.state_dir / st.DB_FILE, 2, "nothing to see")
        assert (await _verify(http, None)).json()["ok"] is True
        broken = (await _verify(http, head)).json()
        assert broken["ok"] is False
        assert broken["first_bad_seq"] == seq
        assert "rewritten" in broken["reason"]


async def test_checkpoint_refusals(controller: Controller) -> None:
    async with controller.client() as http:
        head = (await http.get("/api/v1/audit/head")).json()
        checkpoint = head["checkpoint"]
        # An edited checkpoint (a later seq claimed) no longer verifies.
        edited = {**head, "checkpoint": {**checkpoint, "seq": checkpoint["seq"] + 1}}
        assert_envelope(await _verify(http, edited), 422, "audit_checkpoint_rejected")
        # A checkpoint signed by another key, which names that key, is refused as well.
        impostor = security.SigningKey.generate()
        forged = security.sign_audit_checkpoint(impostor, codec.structure(codec.api, checkpoint, AuditCheckpoint))
        assert_envelope(await _verify(http, codec.api.unstructure(forged)), 422, "audit_checkpoint_rejected")
        assert_envelope(await _verify(http, {**head, "signature": "not base64!"}), 422, "audit_checkpoint_rejected")
        assert_envelope(await _verify(http, {"against": {"checkpoint": checkpoint}}), 400, "invalid_request")
        # A number no checkpoint can hold is refused, not a 500 (or a 400, once the codec refuses NaN).
        raw = json.dumps({"against": {**head, "checkpoint": {**checkpoint, "at": "NAN"}}}).replace('"NAN"', "NaN")
        nan = await http.post("/api/v1/audit/verify", content=raw, headers={"Content-Type": "application/json"})
        assert nan.status_code in {400, 422}, nan.text
        # Events deleted after the checkpoint (and the head set back to match) are named too.
        for name in ("e", "f"):
            await http.post("/api/v1/tenants", json={"id": name})
        later = (await http.get("/api/v1/audit/head")).json()
        db = sqlite3.connect(controller.state_dir / st.DB_FILE, isolation_level=None, timeout=10)
        last = later["checkpoint"]["seq"]
        db.execute("DELETE FROM audit WHERE seq = ?", (last,))
        db.execute("UPDATE meta SET value = ? WHERE key = 'audit_head_seq'", (last - 1,))
        prev = db.execute("SELECT sha256 FROM audit WHERE seq = ?", (last - 1,)).fetchone()[0]
        db.execute("UPDATE meta SET value = ? WHERE key = 'audit_head_sha256'", (prev,))
        db.close()
        assert (await _verify(http, None)).json()["ok"] is True
        truncated = (await _verify(http, later)).json()
        assert truncated["ok"] is False and "events deleted" in truncated["reason"]


async def test_only_audit_and_admin_keys_read_the_head(controller: Controller) -> None:
    operator = await make_key(controller, "operator")
    async with controller.client(operator) as http:
        assert_envelope(await http.get("/api/v1/audit/head"), 403, "forbidden")


@pytest.mark.slow
def test_cli_audit_head_and_verify_against(controller_process: ControllerProcess, tmp_path: Path) -> None:
    admin = controller_process.admin_key
    assert admin is not None
    out = controller_process.cli("audit", "head", token=admin, check=True)
    head_file = tmp_path / "head.json"
    head_file.write_text(out.stdout)
    assert json.loads(out.stdout)["checkpoint"]["seq"] >= 1
    ok = controller_process.cli("audit", "verify", "--against", str(head_file), token=admin)
    assert ok.returncode == 0, ok.stderr
    assert "holds the signed checkpoint" in ok.stdout

    # Offline key pinning: a wrong --public-key is refused before anything is sent.
    other = security.SigningKey.generate().public.b64
    wrong = controller_process.cli("audit", "verify", "--against", str(head_file), "--public-key", other, token=admin)
    assert wrong.returncode == 1 and "INVALID" in wrong.stderr

    edited = json.loads(out.stdout)
    edited["checkpoint"]["sha256"] = "f" * 64
    bad_file = tmp_path / "edited.json"
    bad_file.write_text(json.dumps(edited))
    bad = controller_process.cli("audit", "verify", "--against", str(bad_file), token=admin)
    assert bad.returncode == 1 and "INVALID" in bad.stderr

    rewrite_chain(controller_process.state_dir / st.DB_FILE, 1, "rewritten")
    assert controller_process.cli("audit", "verify", token=admin).returncode == 0  # consistent: plain check passes
    broken = controller_process.cli("audit", "verify", "--against", str(head_file), token=admin)
    assert broken.returncode == 1
    assert "BROKEN" in broken.stderr
