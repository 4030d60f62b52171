"""`nexa control` comes up recovering when its store was restored (the marker `nexa restore`
writes) or with `--recover`, and stays so while an enrolled node has not reported: reads answer,
changes are refused with 503 `recovering` and change nothing; `nexa recovery finish` ends it,
audited, with an epoch above the old one and the marker gone for the next start."""

from __future__ import annotations

import json
from pathlib import Path

import apsw
import httpx
import pytest

from nexa import security
from nexa.channel import links
from nexa.control import store as st
from tests.conftest import ControllerProcess
from tests.support.api import console_session


def _enroll_absent_node(cp: ControllerProcess) -> str:
    token = json.loads(cp.cli("tokens", "create", "--ttl", "15m", "--json", check=True).stdout)["token"]
    body = {
        "token": token,
        "hostname": "away-1",
        "signing_public_key": security.generate_signing_key().public.b64,
        "curve_public_key": links.generate_curve_keypair().public,
    }
    answer = httpx.post(f"{cp.url}/api/v1/enroll", json=body, timeout=30)
    assert answer.status_code == 201, answer.text
    node_id: str = answer.json()["node_id"]
    return node_id


def _mark_restored(state_dir: Path) -> None:
    db = apsw.Connection(str(state_dir / st.DB_FILE))
    try:
        with db:
            db.execute("INSERT INTO meta(key, value) VALUES (?, ?)", (st.RECOVERY_MARKER, "backup test-1"))
    finally:
        db.close()


def _metrics(cp: ControllerProcess) -> str:
    return httpx.get(f"{cp.url}/metrics", headers={"Authorization": f"Bearer {cp.admin_key}"}, timeout=30).text


def _plan(cp: ControllerProcess) -> dict[str, object]:
    out = cp.cli("recovery", "plan", "--json", check=True)
    plan: dict[str, object] = json.loads(out.stdout)
    return plan


@pytest.mark.slow
def test_a_restored_store_starts_recovering_until_finished(controller_process: ControllerProcess) -> None:
    cp = controller_process
    node_id = _enroll_absent_node(cp)
    assert _plan(cp)["recovering"] is False
    assert cp.stop() == 0
    _mark_restored(cp.state_dir)

    cp.start()
    plan = _plan(cp)
    assert plan["recovering"] is True and "restored from a backup (backup test-1)" in str(plan["reason"])
    assert plan["unheard"] == [node_id] and plan["epoch"] == 2 and plan["next_epoch"] == 3
    assert httpx.get(f"{cp.url}/readyz", timeout=30).json()["status"] == "recovering"
    # The cluster's version view, the gauge and the console's overview say so too.
    assert httpx.get(f"{cp.url}/version", timeout=30).json()["recovering"] is True
    assert cp.admin_key is not None
    assert "nexa_controller_recovering 1.0" in _metrics(cp)
    with console_session(cp.url, cp.admin_key) as console:
        overview = console.get("/console/overview")
        assert overview.status_code == 200 and "the controller is recovering" in overview.text
    # Reads answer; every change is refused with a typed 503 and changes nothing.
    before = cp.cli("keys", "list", "--json", check=True).stdout
    refused = cp.cli("keys", "create", "--role", "operator")
    assert refused.returncode != 0 and "recovering" in refused.stderr and "nexa recovery finish" in refused.stderr
    answer = httpx.post(
        f"{cp.url}/api/v1/tenants", json={"id": "acme"}, headers={"Authorization": f"Bearer {cp.admin_key}"}
    )
    assert answer.status_code == 503 and answer.json()["error"]["code"] == "recovering"
    assert cp.cli("keys", "list", "--json", check=True).stdout == before
    assert "acme" not in cp.cli("tenants", "list", "--json", check=True).stdout

    done = cp.cli("recovery", "finish", check=True).stdout
    assert "recovery finished: epoch 3" in done and node_id in done
    assert _plan(cp)["recovering"] is False
    assert httpx.get(f"{cp.url}/version", timeout=30).json()["recovering"] is False
    assert "nexa_controller_recovering 0.0" in _metrics(cp)
    again = cp.cli("recovery", "finish")
    assert again.returncode != 0 and "not recovering" in again.stderr
    events = json.loads(cp.cli("audit", "list", "--action", "recovery.finish", "--json", check=True).stdout)
    assert [e["actor_key_id"] is not None for e in events["events"]] == [True]
    assert cp.cli("tenants", "create", "acme").returncode == 0  # writes are taken again
    assert cp.stop() == 0

    # The marker is gone: the next start is an ordinary one, its epoch above the recovery's.
    cp.start()
    assert _plan(cp)["recovering"] is False
    assert cp.stop() == 0
    cp.start("--recover")
    plan = _plan(cp)
    assert plan["recovering"] is True and "--recover" in str(plan["reason"]) and plan["epoch"] == 5
