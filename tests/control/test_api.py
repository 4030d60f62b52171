"""The controller's HTTP API through a real hypercorn listener on 127.0.0.1."""

from __future__ import annotations

import itertools

import httpx
import pytest
import trio

from nexa.config import HttpConfig
from nexa.control.console import CONSOLE_ROUTES
from nexa.control.http.api import create_app
from nexa.control.http.resources import ROLES as ROUTE_ROLES
from nexa.control.service import serve_control
from tests.conftest import Controller, local_config
from tests.support.api import assert_envelope, bare_state, make_key


async def audit_count(c: Controller) -> int:
    async with c.client() as http:
        resp = await http.get("/api/v1/audit", params={"limit": 1000})
    return len(resp.json()["events"])


async def test_health_ready_and_version_need_no_key(controller: Controller) -> None:
    async with httpx.AsyncClient(base_url=controller.url) as http:
        assert (await http.get("/healthz")).json() == {"status": "ok"}
        ready = (await http.get("/readyz")).json()
        version = (await http.get("/version")).json()
    assert ready == {"status": "ready", "role": "leader", "epoch": 1, "lease_age_s": None}
    assert version["epoch"] == 1
    assert version["version"]


async def test_every_route_declares_its_roles() -> None:
    # The table is the single source: every registered rule is in it, and nothing else is.
    state = bare_state(metrics=None)
    app = create_app(HttpConfig(), state)
    registered = {
        (m, r.rule) for r in app.url_map.iter_rules() for m in r.methods or () if m not in {"HEAD", "OPTIONS"}
    }
    # The console's pages answer to its session cookie (their actions check ROUTE_ROLES themselves).
    assert registered == set(ROUTE_ROLES) | CONSOLE_ROUTES
    assert not set(ROUTE_ROLES) & CONSOLE_ROUTES


async def test_no_key_is_401_in_the_envelope(controller: Controller) -> None:
    async with httpx.AsyncClient(base_url=controller.url) as http:
        resp = await http.get("/api/v1/keys")
        assert_envelope(resp, 401, "unauthenticated")
        assert resp.headers["WWW-Authenticate"].startswith("Bearer")
        bad = await http.get("/api/v1/keys", headers={"Authorization": "Bearer nxk_000000000000_" + "A" * 43})
        assert_envelope(bad, 401, "unauthenticated")
        basic = await http.get("/api/v1/keys", headers={"Authorization": "Basic YWRtaW46YWRtaW4="})
        assert_envelope(basic, 401, "unauthenticated")


async def test_wrong_role_is_403_and_denied_mutations_are_audited(controller: Controller) -> None:
    operator = await make_key(controller, "operator")
    before = await audit_count(controller)
    async with controller.client(operator) as http:
        assert_envelope(await http.get("/api/v1/keys"), 403, "forbidden")
        assert_envelope(await http.post("/api/v1/keys", json={"role": "admin"}), 403, "forbidden")
        assert_envelope(await http.get("/metrics"), 403, "forbidden")
    async with controller.client() as http:
        events = (await http.get("/api/v1/audit", params={"after": before})).json()["events"]
        keys = (await http.get("/api/v1/keys")).json()["keys"]
    assert [e["result"] for e in events] == ["denied"]
    assert events[0]["action"] == "POST /api/v1/keys"
    assert [k["role"] for k in keys] == ["admin", "operator"]  # nothing was created


async def test_a_10_mb_body_is_413_and_changes_nothing(controller: Controller) -> None:
    before = await audit_count(controller)
    async with controller.client() as http:
        resp = await http.post(
            "/api/v1/keys", content=b"{" + b" " * 10_000_000 + b"}", headers={"Content-Type": "application/json"}
        )
        assert_envelope(resp, 413, "payload_too_large")

        async def chunks():  # no Content-Length: the limit is enforced while reading
            for _ in range(20):
                yield b" " * 600_000

        chunked = await http.post("/api/v1/tenants", content=chunks())
        assert_envelope(chunked, 413, "payload_too_large")
    assert await audit_count(controller) == before


@pytest.mark.parametrize(
    ("body", "fields"),
    [
        (b"not json", ["(body)"]),
        (b"[1, 2]", ["object"]),
        (b'{"role": "root"}', ["role"]),
        (b'{"role": "admin", "colour": "red"}', ["colour"]),
        (b'{"role": 7, "name": false}', ["role", "name"]),
        (b'{"role": "inference"}', ["tenant"]),
        (b'{"role": "admin", "tenant": "acme"}', ["tenant"]),
    ],
)
async def test_bad_bodies_are_400_naming_fields_and_change_nothing(
    controller: Controller, body: bytes, fields: list[str]
) -> None:
    before = await audit_count(controller)
    async with controller.client() as http:
        resp = await http.post("/api/v1/keys", content=body, headers={"Content-Type": "application/json"})
        err = assert_envelope(resp, 400, "invalid_request")
        keys = (await http.get("/api/v1/keys")).json()["keys"]
    if fields != ["(body)"]:
        for field in fields:
            assert field in str(err["message"])
    assert len(keys) == 1
    assert await audit_count(controller) == before


async def test_unknown_route_and_method_answer_in_the_envelope(controller: Controller) -> None:
    async with controller.client() as http:
        assert_envelope(await http.get("/api/v1/nope"), 404, "not_found")
        assert_envelope(await http.put("/api/v1/keys"), 405, "method_not_allowed")


async def test_request_id_is_taken_from_the_client_or_made(controller: Controller) -> None:
    async with controller.client() as http:
        mine = await http.get("/healthz", headers={"X-Request-Id": "trace-123.abc"})
        assert mine.headers["X-Request-Id"] == "trace-123.abc"
        hostile = await http.get("/healthz", headers={"X-Request-Id": "x" * 300})
        assert hostile.headers["X-Request-Id"].startswith("req_")
        assert mine.headers["Cache-Control"] == "no-store"


async def test_key_lifecycle_create_use_list_revoke(controller: Controller) -> None:
    async with controller.client() as http:
        created = await http.post("/api/v1/keys", json={"role": "audit", "name": "auditor"})
        assert created.status_code == 201
        secret, info = created.json()["key"], created.json()["info"]
        assert secret.startswith("nxk_") and len(secret) >= 4 + 12 + 1 + 43
        assert info["role"] == "audit" and info["name"] == "auditor"
        listed = (await http.get("/api/v1/keys")).json()["keys"]
        assert secret not in str(listed)  # never shown again, nor its hash
        assert "secret_sha256" not in str(listed)
    async with controller.client(secret) as auditor:
        assert (await auditor.get("/api/v1/audit")).status_code == 200
        assert (await auditor.post("/api/v1/audit/verify")).json()["ok"] is True
    async with controller.client() as http:
        revoked = await http.delete(f"/api/v1/keys/{info['id']}")
        assert revoked.json()["revoked_at"] is not None
        assert_envelope(await http.delete(f"/api/v1/keys/{info['id']}"), 404, "not_found")
    async with controller.client(secret) as auditor:
        assert_envelope(await auditor.get("/api/v1/audit"), 401, "unauthenticated")


async def test_the_last_admin_key_cannot_be_revoked(controller: Controller) -> None:
    async with controller.client() as http:
        admin_id = (await http.get("/api/v1/keys")).json()["keys"][0]["id"]
        assert_envelope(await http.delete(f"/api/v1/keys/{admin_id}"), 409, "conflict")


async def test_inference_keys_belong_to_an_existing_tenant(controller: Controller) -> None:
    async with controller.client() as http:
        missing = await http.post("/api/v1/keys", json={"role": "inference", "tenant": "ghost"})
        assert_envelope(missing, 404, "not_found")
        assert (await http.post("/api/v1/tenants", json={"id": "acme", "display_name": "Acme"})).status_code == 201
        ok = await http.post("/api/v1/keys", json={"role": "inference", "tenant": "acme"})
        assert ok.json()["info"]["tenant"] == "acme"


async def test_tenants_create_list_duplicate_and_bad_ids(controller: Controller) -> None:
    async with controller.client() as http:
        assert (await http.post("/api/v1/tenants", json={"id": "team-a"})).status_code == 201
        assert_envelope(await http.post("/api/v1/tenants", json={"id": "team-a"}), 409, "conflict")
        for bad in ("Team A", "-x", "a" * 65, ""):
            assert_envelope(await http.post("/api/v1/tenants", json={"id": bad}), 400, "invalid_request")
        tenants = (await http.get("/api/v1/tenants")).json()["tenants"]
    assert [t["id"] for t in tenants] == ["team-a"]
    assert tenants[0]["display_name"] == "team-a"


async def test_audit_records_each_mutation_with_actor_and_digests(controller: Controller) -> None:
    async with controller.client() as http:
        admin_id = (await http.get("/api/v1/keys")).json()["keys"][0]["id"]
        await http.post("/api/v1/tenants", json={"id": "acme"})
        key_id = (await http.post("/api/v1/keys", json={"role": "operator"})).json()["info"]["id"]
        await http.delete(f"/api/v1/keys/{key_id}")
        events = (await http.get("/api/v1/audit")).json()["events"]
    assert [e["action"] for e in events] == ["key.create", "tenant.create", "key.create", "key.revoke"]
    bootstrap, tenant, create, revoke = events
    assert bootstrap["actor_key_id"] is None  # the controller itself made the first admin key
    assert tenant["actor_key_id"] == admin_id and tenant["actor_role"] == "admin"
    assert tenant["target"] == "tenant/acme" and tenant["prior_sha256"] is None and tenant["next_sha256"]
    assert revoke["prior_sha256"] == create["next_sha256"] != revoke["next_sha256"]
    for before, after in itertools.pairwise(events):
        assert after["prev_sha256"] == before["sha256"]
        assert after["seq"] == before["seq"] + 1


async def test_audit_filters_and_cursor_pagination(controller: Controller) -> None:
    async with controller.client() as http:
        for i in range(7):
            await http.post("/api/v1/tenants", json={"id": f"t{i}"})
        seen, after = [], 0
        while True:
            page = (
                await http.get("/api/v1/audit", params={"action": "tenant.create", "limit": 3, "after": after})
            ).json()
            seen += [e["target"] for e in page["events"]]
            if page["next_cursor"] is None:
                break
            after = page["next_cursor"]
        assert seen == [f"tenant/t{i}" for i in range(7)]
        one = (await http.get("/api/v1/audit", params={"target": "tenant/t3"})).json()["events"]
        assert [e["target"] for e in one] == ["tenant/t3"]
        assert_envelope(await http.get("/api/v1/audit", params={"limit": "0"}), 400, "invalid_request")
        assert_envelope(await http.get("/api/v1/audit", params={"since": "yesterday"}), 400, "invalid_request")


async def test_metrics_for_monitoring_keys(controller: Controller) -> None:
    monitoring = await make_key(controller, "monitoring")
    async with controller.client(monitoring) as http:
        await http.get("/healthz")
        resp = await http.get("/metrics")
    assert resp.status_code == 200
    assert resp.headers["Content-Type"].startswith("text/plain")
    text = resp.text
    assert "nexa_controller_epoch 1.0" in text
    assert 'nexa_http_requests_total{method="GET",route="/healthz",status="200"}' in text
    assert 'nexa_api_keys{role="monitoring"} 1.0' in text


async def test_graceful_stop_lets_an_in_flight_request_finish(tmp_path: object, nursery: trio.Nursery) -> None:
    stopping = trio.Event()
    cfg = local_config(tmp_path)
    done = trio.Event()

    async def serve(task_status: trio.TaskStatus[object]) -> None:
        await serve_control(cfg, stopping=stopping, task_status=task_status)
        done.set()

    started = await nursery.start(serve)
    first_chunk_sent = trio.Event()

    async def slow_body():
        yield b'{"id": '
        first_chunk_sent.set()
        await trio.sleep(1.0)
        yield b'"late-tenant"}'

    async def stop_midway() -> None:
        await first_chunk_sent.wait()
        await trio.sleep(0.2)
        stopping.set()

    nursery.start_soon(stop_midway)
    headers = {"Authorization": f"Bearer {started.admin_key}"}
    async with httpx.AsyncClient(base_url=started.urls[0], headers=headers) as http:
        with trio.fail_after(10):
            resp = await http.post("/api/v1/tenants", content=slow_body())
    assert resp.status_code == 201  # finished although stop began while it was in flight
    with trio.fail_after(15):
        await done.wait()


async def test_restart_keeps_state_and_takes_a_higher_epoch(tmp_path: object, nursery: trio.Nursery) -> None:
    cfg = local_config(tmp_path)
    epochs, admin = [], None
    for _ in range(3):
        stopping = trio.Event()
        finished = trio.Event()

        async def run(
            task_status: trio.TaskStatus[object], stopping: trio.Event = stopping, finished: trio.Event = finished
        ) -> None:
            await serve_control(cfg, stopping=stopping, task_status=task_status)
            finished.set()

        started = await nursery.start(run)
        admin = admin or started.admin_key
        async with httpx.AsyncClient(base_url=started.urls[0], headers={"Authorization": f"Bearer {admin}"}) as http:
            epochs.append((await http.get("/version")).json()["epoch"])
            keys = (await http.get("/api/v1/keys")).json()["keys"]
            assert len(keys) == 1  # the admin key survived; no second bootstrap key
        stopping.set()
        await finished.wait()
    assert epochs == [1, 2, 3]


async def test_readyz_is_503_until_ready() -> None:
    state = bare_state()
    client = create_app(HttpConfig(), state).test_client()
    resp = await client.get("/readyz")
    assert resp.status_code == 503
    assert (await resp.get_json())["error"]["code"] == "unavailable"
    state.ready = True
    assert (await client.get("/readyz")).status_code == 200
