"""One pagination convention (`?cursor=&limit=`, `next_cursor`) on every list route that can grow,
through a real controller on 127.0.0.1: nothing missed or repeated while items are added between
pages, and a bad cursor or limit is a typed 400 that changes nothing."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from nexa.config import StoreConfig
from nexa.contracts import codec
from nexa.contracts.domain import KeyId, TenantId
from nexa.contracts.gateway import (
    AcceptedWorkload,
    Capability,
    Priority,
    SignedReceipt,
    UsageRecord,
    WorkloadState,
)
from nexa.contracts.pages import DEFAULT_LIMIT, MAX_LIMIT
from nexa.control import store as st
from nexa.control.service import serve_control
from nexa.security import PublicKey, verify_receipt
from tests.conftest import Controller, local_config, start_controller
from tests.realparts import BuiltImages, S3Store
from tests.support.api import assert_envelope, make_key, ok
from tests.support.deployments import body, online, registry_ready
from tests.support.postgres import pg_url_fixture, postgres_fixture, store_cfg_fixture  # noqa: F401
from tests.support.rawnode import enroll
from tests.support.usage import usage_record

Json = dict[str, Any]

#: (path, the list's field, what identifies an item) of each paged management list.
LISTS = [
    ("/api/v1/keys", "keys", "id"),
    ("/api/v1/tenants", "tenants", "id"),
    ("/api/v1/nodes", "nodes", "id"),
    ("/api/v1/audit", "events", "seq"),
    ("/api/v1/deployments", "deployments", "deployment"),
    ("/api/v1/usage", "rows", "day"),
]


async def page_through(http: httpx.AsyncClient, path: str, field: str, limit: int, **params: Any) -> list[list[Json]]:
    """Every page of `path` with `limit` items at most, following `next_cursor` to its null."""
    pages: list[list[Json]] = []
    cursor = None
    while True:
        query = {**params, "limit": limit} | ({} if cursor is None else {"cursor": cursor})
        page = await ok(http.get(path, params=query))
        assert len(page[field]) <= limit
        pages.append(page[field])
        cursor = page["next_cursor"]
        if cursor is None:
            return pages
        assert isinstance(cursor, str)


async def test_keys_nodes_and_audit_page_without_missing_or_repeating(controller: Controller) -> None:
    async with controller.client() as http:
        for i in range(5):
            await ok(http.post("/api/v1/keys", json={"role": "operator", "name": f"op{i}"}), 201)
    for i in range(5):
        await enroll(controller, f"node-{i}")
    async with controller.client() as http:
        before_keys = [k["id"] for k in (await ok(http.get("/api/v1/keys")))["keys"]]
        # Keys made while paging: each is either listed once, at its place (oldest first), or not at all.
        seen: list[str] = []
        cursor = None
        while True:
            page = await ok(http.get("/api/v1/keys", params={"limit": 2} | ({"cursor": cursor} if cursor else {})))
            seen += [k["id"] for k in page["keys"]]
            await ok(http.post("/api/v1/keys", json={"role": "audit"}), 201)
            cursor = page["next_cursor"]
            if cursor is None:
                break
        after_keys = [k["id"] for k in (await ok(http.get("/api/v1/keys")))["keys"]]
        assert len(seen) == len(set(seen))
        assert seen[: len(before_keys)] == before_keys
        assert seen == after_keys[: len(seen)]
        assert len(after_keys) == len(seen) + 1  # the one made after the last page

        nodes = [n["id"] for page in await page_through(http, "/api/v1/nodes", "nodes", 2) for n in page]
        assert nodes == sorted(nodes) and len(nodes) == 5
        assert [len(p) for p in await page_through(http, "/api/v1/nodes", "nodes", 5)] == [5]  # no empty last page

        # The audit chain grows while it is read: every event once, in chain order.
        events: list[int] = []
        cursor = None
        while True:
            page = await ok(http.get("/api/v1/audit", params={"limit": 3} | ({"cursor": cursor} if cursor else {})))
            events += [e["seq"] for e in page["events"]]
            if len(events) < 12:
                await ok(http.post("/api/v1/tenants", json={"id": f"t{len(events)}"}), 201)
            cursor = page["next_cursor"]
            if cursor is None:
                break
        head = (await ok(http.get("/api/v1/audit/head")))["checkpoint"]["seq"]
        assert events == list(range(1, head + 1))


async def test_tenants_page_by_id_without_missing_or_repeating(controller: Controller) -> None:
    async with controller.client() as http:
        for i in range(5):
            await ok(http.post("/api/v1/tenants", json={"id": f"m{i}"}), 201)
        # Tenants made between pages: those before the cursor (by id) are not listed, those after once.
        seen: list[str] = []
        cursor = None
        while True:
            page = await ok(http.get("/api/v1/tenants", params={"limit": 2} | ({"cursor": cursor} if cursor else {})))
            seen += [t["id"] for t in page["tenants"]]
            cursor = page["next_cursor"]
            if cursor is None:
                break
            await ok(http.post("/api/v1/tenants", json={"id": f"a{len(seen)}"}), 201)
            await ok(http.post("/api/v1/tenants", json={"id": f"z{len(seen):02}"}), 201)
        every = [t["id"] for t in (await ok(http.get("/api/v1/tenants", params={"limit": MAX_LIMIT})))["tenants"]]
    assert len(seen) == len(set(seen)) and seen == sorted(seen)
    assert seen == [t for t in every if not t.startswith("a")]
    assert {f"m{i}" for i in range(5)} <= set(seen) and len(seen) > 5  # the z tenants made meanwhile too
    assert every == sorted(every) and len(every) == 2 * len(seen) - 5


async def test_the_deprecated_after_still_pages_the_audit(controller: Controller) -> None:
    async with controller.client() as http:
        for i in range(3):
            await ok(http.post("/api/v1/tenants", json={"id": f"t{i}"}), 201)
        old = await ok(http.get("/api/v1/audit", params={"after": 2, "limit": 1}))
        assert [e["seq"] for e in old["events"]] == [3]
        new = await ok(http.get("/api/v1/audit", params={"cursor": old["next_cursor"]}))
        assert [e["seq"] for e in new["events"]] == [4]
        assert new["next_cursor"] is None
        # A client that still sends after, with the cursor it was given, reads the same page.
        assert await ok(http.get("/api/v1/audit", params={"after": old["next_cursor"]})) == new
        garbage = await http.get("/api/v1/audit", params={"after": "seq-3"})
        assert "after" in str(assert_envelope(garbage, 400, "invalid_request")["message"])
        both = await http.get("/api/v1/audit", params={"after": 1, "cursor": old["next_cursor"]})
        assert "not both" in str(assert_envelope(both, 400, "invalid_request")["message"])


def _forged(kind: str, *key: object) -> str:
    return base64.urlsafe_b64encode(json.dumps([kind, *key]).encode()).decode().rstrip("=")


@pytest.mark.parametrize(
    "query",
    [
        {"cursor": "not a cursor!"},
        {"cursor": ""},
        {"cursor": "x" * 2000},
        {"cursor": base64.urlsafe_b64encode(b"\xff\xfe").decode()},
        {"cursor": _forged("elsewhere", "x")},  # another list's
        {"cursor": _forged("keys")},  # a key too short
        {"cursor": _forged("nodes", 7)},  # a key of the wrong type
        {"cursor": _forged("audit", True)},
        {"cursor": _forged("keys", float("nan"), "k")},
        {"limit": "0"},
        {"limit": str(MAX_LIMIT + 1)},
        {"limit": "ten"},
        {"limit": "-1"},
    ],
)
async def test_a_bad_cursor_or_limit_is_a_typed_400_that_says_what_to_send(
    controller: Controller, query: dict[str, str]
) -> None:
    async with controller.client() as http:
        before = await ok(http.get("/api/v1/audit", params={"limit": MAX_LIMIT}))
        keys = await ok(http.get("/api/v1/keys"))
        for path, _field, _id in LISTS:
            err = assert_envelope(await http.get(path, params=query), 400, "invalid_request")
            name = next(iter(query))
            assert name in str(err["message"])
            if name == "limit":
                assert f"from 1 to {MAX_LIMIT}" in str(err["message"])
            else:
                assert "send the next_cursor of the previous page" in str(err["message"])
        assert await ok(http.get("/api/v1/audit", params={"limit": MAX_LIMIT})) == before  # nothing changed
        assert await ok(http.get("/api/v1/keys")) == keys


async def test_the_default_page_is_the_documented_one(controller: Controller) -> None:
    async with controller.client() as http:
        for i in range(DEFAULT_LIMIT + 1):
            await ok(http.post("/api/v1/tenants", json={"id": f"t{i}"}), 201)
        first = await ok(http.get("/api/v1/audit"))
        assert len(first["events"]) == DEFAULT_LIMIT and first["next_cursor"] is not None
        tenants = await ok(http.get("/api/v1/tenants"))
        assert len(tenants["tenants"]) == DEFAULT_LIMIT and tenants["next_cursor"] is not None
        rest = await ok(http.get("/api/v1/audit", params={"cursor": first["next_cursor"]}))
    assert [e["seq"] for e in first["events"] + rest["events"]] == list(range(1, DEFAULT_LIMIT + 3))
    assert rest["next_cursor"] is None


def _usage(tenant: str, model: str, at: float) -> UsageRecord:
    return usage_record(request_id=f"r-{tenant}-{model}-{at}", tenant=tenant, model=model, finished_at=at)


async def test_usage_groups_page_and_the_csv_has_them_all(
    tmp_path: Path, nursery: trio.Nursery, store_cfg: StoreConfig
) -> None:
    cfg = attrs.evolve(local_config(tmp_path), store=store_cfg)
    day0 = 1_699_920_000.0  # 2023-11-14 00:00 UTC
    async with st.open_store(cfg.state_dir, cfg.store) as store:  # metered before this controller started
        records = [
            _usage(tenant, model, day0 + day * 86400 + 60)
            for day in range(3)
            for tenant in ("acme", "beta")
            for model in ("llama", "qwen")
        ]
        await store.run(st.insert_usage, records)
    c = await start_controller(nursery, cfg)
    window = {"since": day0, "until": day0 + 3 * 86400}
    async with c.client() as http:
        whole = await ok(http.get("/api/v1/usage", params={**window, "limit": MAX_LIMIT}))
        assert len(whole["rows"]) == 12 and whole["next_cursor"] is None
        pages = await page_through(http, "/api/v1/usage", "rows", 5, **window)
        assert [len(p) for p in pages] == [5, 5, 2]
        assert [r for p in pages for r in p] == whole["rows"]
        only = await page_through(http, "/api/v1/usage", "rows", 2, tenant="beta", **window)
        assert [(r["day"], r["model"]) for p in only for r in p] == [
            (f"2023-11-{14 + d}", f"{m}:1") for d in range(3) for m in ("llama", "qwen")
        ]
        csv = await http.get("/api/v1/usage", params={**window, "format": "csv"})
        assert csv.status_code == 200 and len(csv.text.splitlines()) == 1 + 12
        refused = await http.get("/api/v1/usage", params={**window, "format": "csv", "limit": 2})
        assert "CSV" in str(assert_envelope(refused, 400, "invalid_request")["message"])
    c.stopping.set()


async def test_deployments_page_by_name(
    dep_reg: Controller, dial: Any, nursery: trio.Nursery, s3_store: S3Store, test_images: BuiltImages
) -> None:
    for i in range(3):
        await online(dep_reg, dial, nursery, f"n{i}")
    async with dep_reg.client() as http:
        await registry_ready(http, s3_store, test_images)
        for name in ("chat-c", "chat-a", "chat-b"):
            await ok(http.post("/api/v1/deployments", json=body(name)), 201)
        pages = await page_through(http, "/api/v1/deployments", "deployments", 2)
    assert [[d["deployment"]["name"] for d in p] for p in pages] == [["chat-a", "chat-b"], ["chat-c"]]


async def test_serve_control_opens_its_store_with_the_opener_it_is_given(tmp_path: Path, nursery: trio.Nursery) -> None:
    cfg = local_config(tmp_path)
    opened: list[str] = []

    def opener(state_dir: str | Path, store: StoreConfig) -> Any:
        opened.append(str(state_dir))
        assert store == cfg.store
        return st.open_store(state_dir, store, inline=True)  # transactions on the event loop's thread

    stopping, stopped = trio.Event(), trio.Event()

    async def run(task_status: trio.TaskStatus[Any]) -> None:
        await serve_control(cfg, stopping=stopping, open_store=opener, task_status=task_status)
        stopped.set()

    started = await nursery.start(run)
    async with httpx.AsyncClient(base_url=started.urls[0]) as http:
        headers = {"Authorization": f"Bearer {started.admin_key}"}
        assert (await http.post("/api/v1/tenants", json={"id": "acme"}, headers=headers)).status_code == 201
    stopping.set()
    with trio.fail_after(15):
        await stopped.wait()
    assert opened == [str(cfg.state_dir)]


def _accepted(tenant: str, workload_id: str, at: float) -> st.WorkloadRow:
    accepted = AcceptedWorkload(
        tenant=TenantId(tenant),
        workload_id=workload_id,
        idempotency_key_sha256=f"sha-{tenant}-{workload_id}",
        key_id=KeyId("k-old"),
        capability=Capability.CHAT,
        alias="chat",
        model="chat",
        priority=Priority.STANDARD,
        accepted_at=at,
    )
    return st.WorkloadRow(accepted=accepted, state=WorkloadState.QUEUED)


@pytest.mark.slow
async def test_a_tenant_pages_its_own_workloads_and_never_anothers(
    tmp_path: Path, nursery: trio.Nursery, store_cfg: StoreConfig
) -> None:
    cfg = attrs.evolve(local_config(tmp_path), store=store_cfg)
    async with st.open_store(cfg.state_dir, cfg.store) as store:  # left running by a controller that crashed
        for wid, at in (("w3", 3.0), ("w1", 1.0), ("w2b", 2.0), ("w2a", 2.0), ("w4", 4.0)):
            await store.run(st.insert_workload, _accepted("acme", wid, at))
        for wid in ("b1", "b2"):
            await store.run(st.insert_workload, _accepted("beta", wid, 1.5))
    c = await start_controller(nursery, cfg)  # marks them failed, with signed receipts
    acme, beta = await make_key(c, "inference", "acme"), await make_key(c, "inference", "beta")
    async with c.client(acme) as http:
        pages = await page_through(http, "/api/v1/workloads", "workloads", 2)
        assert [[w["workload_id"] for w in p] for p in pages] == [["w1", "w2a"], ["w2b", "w3"], ["w4"]]
        every = [w for p in pages for w in p]
        assert {(w["state"], w["error"]) for w in every} == {("failed", "controller_restarted")}
        key = PublicKey.from_b64((await ok(http.get("/api/v1/receipts/public-key")))["public_key"])
        for w in every:
            verify_receipt(key, codec.structure(codec.api, w["receipt"], SignedReceipt))
            assert w == await ok(http.get(f"/api/v1/workloads/{w['workload_id']}"))
        whole = await ok(http.get("/api/v1/workloads"))
        assert whole == {"workloads": every, "next_cursor": None}
        for query in ({"cursor": "not a cursor!"}, {"cursor": _forged("keys", 1.0, "k")}, {"limit": "0"}):
            err = assert_envelope(await http.get("/api/v1/workloads", params=query), 400, "invalid_request")
            assert next(iter(query)) in str(err["message"])
        assert await ok(http.get("/api/v1/workloads")) == whole  # nothing changed
    async with c.client(beta) as http:
        assert [w["workload_id"] for w in (await ok(http.get("/api/v1/workloads")))["workloads"]] == ["b1", "b2"]
        # Another tenant's cursor pages this tenant's list: it names a place, not a workload.
        after_w1 = await ok(http.get("/api/v1/workloads", params={"cursor": _forged("workloads", 1.0, "w1")}))
        assert [w["workload_id"] for w in after_w1["workloads"]] == ["b1", "b2"]
    async with c.client() as http:  # the admin key: workloads are the inference role's
        assert_envelope(await http.get("/api/v1/workloads"), 403, "forbidden")

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "NEXA_URL": c.url, "NEXA_TOKEN": acme}
        argv = [sys.executable, "-m", "nexa", "workloads", "list", *args]
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False, env=env)

    first = await trio.to_thread.run_sync(cli, "--limit", "3", "--json")
    assert first.returncode == 0, first.stderr
    page = json.loads(first.stdout)
    assert [w["workload_id"] for w in page["workloads"]] == ["w1", "w2a", "w2b"]
    table = await trio.to_thread.run_sync(cli, "--cursor", page["next_cursor"])
    assert table.returncode == 0, table.stderr
    header, *rows = table.stdout.splitlines()
    assert header.split() == ["WORKLOAD_ID", "STATE", "MODEL", "PRIORITY", "ERROR", "ACCEPTED_AT", "FINISHED_AT"]
    assert [r.split()[:2] for r in rows] == [["w3", "failed"], ["w4", "failed"]]
    bad = await trio.to_thread.run_sync(cli, "--cursor", "not-a-cursor")
    assert bad.returncode != 0 and "invalid_request" in bad.stderr
    c.stopping.set()
