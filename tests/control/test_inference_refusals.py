"""Requests the inference routes refuse, through a real controller's HTTP front end (hypercorn,
the ASGI inference app, apsw): each gets its typed error in the route's error shape, and none
changes anything or writes to the store (a refusal before admission costs no commit)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any, NoReturn

import apsw
import attrs
import httpx
import pytest
import trio

from nexa.config import GatewayConfig
from nexa.contracts.gateway import MAX_MODEL_CHARS, UNRESOLVED_MODEL
from tests.conftest import Controller, local_config, start_controller

Json = dict[str, Any]
MESSAGES = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def ctl(nursery: trio.Nursery, tmp_path: Path) -> AsyncIterator[Controller]:
    # Metering writes only when stopped: a commit during the test can only be a refusal's.
    cfg = local_config(tmp_path)
    cfg = attrs.evolve(cfg, gateway=GatewayConfig(metering_flush_s=3600.0))  # type: ignore[arg-type]
    started = await start_controller(nursery, cfg)
    yield started
    started.stopping.set()


async def inference_key(c: Controller) -> str:
    async with c.client() as http:
        assert (await http.post("/api/v1/tenants", json={"id": "acme"})).status_code == 201
        created = await http.post("/api/v1/keys", json={"role": "inference", "tenant": "acme"})
        assert created.status_code == 201
    key: str = created.json()["key"]
    return key


class Commits:
    """Counts commits by other connections to the controller's database (SQLite's data_version)."""

    def __init__(self, state_dir: Path) -> None:
        self._db = apsw.Connection(str(state_dir / "control.db"), flags=apsw.SQLITE_OPEN_READONLY)

    def version(self) -> int:
        return int(self._db.execute("PRAGMA data_version").fetchall()[0][0])

    def workloads(self) -> int:
        return int(self._db.execute("SELECT count(*) FROM workload").fetchall()[0][0])

    def close(self) -> None:
        self._db.close()


def openai_error(resp: httpx.Response, status: int, code: str) -> Json:
    assert resp.status_code == status, resp.text
    body: Json = resp.json()
    assert set(body) == {"error"}
    assert body["error"]["code"] == code
    return body["error"]


def envelope_error(resp: httpx.Response, status: int, code: str) -> Json:
    assert resp.status_code == status, resp.text
    body: Json = resp.json()
    assert body["error"]["code"] == code and body["error"]["request_id"]
    return body["error"]


def envelope(**changes: object) -> Json:
    body: Json = {
        "version": "nexa.v1",
        "idempotency_key": "idem-1",
        "workload_id": "w1",
        "capability": "chat",
        "model": "chat",
        "payload": {"messages": MESSAGES},
    }
    return body | changes


NAN_BODIES = [
    b'{"model": "chat", "messages": [], "temperature": NaN}',
    b'{"model": "chat", "messages": [], "temperature": Infinity}',
    b'{"model": "chat", "messages": [], "top_p": -Infinity}',
    b'{"model": "chat", "messages": [], "temperature": 1e400}',
    b'{"model": "chat", "messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}",
    b'{"model": "chat", "messages": [], "seed": 1' + b"0" * 5000 + b"}",
]


async def test_openai_routes_refuse_what_they_cannot_take_and_store_nothing(ctl: Controller) -> None:
    key = await inference_key(ctl)
    commits = Commits(ctl.state_dir)
    before = commits.version()
    async with ctl.client(key) as http:
        for raw in NAN_BODIES:
            resp = await http.post("/v1/chat/completions", content=raw, headers={"content-type": "application/json"})
            openai_error(resp, 400, "invalid_request")
        too_long = "m" * (MAX_MODEL_CHARS + 1)
        for path, extra in (
            ("/v1/chat/completions", {"messages": MESSAGES}),
            ("/v1/completions", {"prompt": "x"}),
            ("/v1/embeddings", {"input": "x"}),
        ):
            error = openai_error(await http.post(path, json={"model": too_long, **extra}), 400, "invalid_request")
            assert too_long not in error["message"]
        for bad in ({"max_tokens": -1}, {"max_tokens": 2**31}, {"max_tokens": True}, {"n": 0}, {"n": 1000}):
            body = {"model": "chat", "messages": MESSAGES, **bad}
            openai_error(await http.post("/v1/chat/completions", json=body), 400, "invalid_request")
        for options in ({"include_usage": "yes"}, ["include_usage"]):
            body = {"model": "chat", "messages": MESSAGES, "stream": True, "stream_options": options}
            openai_error(await http.post("/v1/chat/completions", json=body), 400, "invalid_request")
        resp = await http.post(
            "/v1/chat/completions",
            json={"model": "chat", "messages": MESSAGES},
            headers={"x-nexa-data-class": "Top Secret"},
        )
        openai_error(resp, 400, "invalid_request")
    assert commits.version() == before  # none of them wrote anything
    async with ctl.client() as http:
        assert (await http.post("/api/v1/tenants", json={"id": "other"})).status_code == 201
    assert commits.version() != before  # what a write looks like
    commits.close()
    async with ctl.client() as http:
        assert (await http.get("/api/v1/usage")).json()["rows"] == []  # never reached the gateway


async def test_an_unresolved_model_name_is_not_stored(ctl: Controller) -> None:
    key = await inference_key(ctl)
    name = "n" * MAX_MODEL_CHARS  # the longest allowed
    commits = Commits(ctl.state_dir)
    before = commits.version()
    async with ctl.client(key) as http:
        for _ in range(3):
            resp = await http.post("/v1/chat/completions", json={"model": name, "messages": MESSAGES})
            openai_error(resp, 404, "model_not_found")
        envelope_error(await http.post("/api/v1/workloads", json=envelope(model=name)), 404, "model_not_found")
    assert commits.version() == before  # usage is written behind, in batches; the workload not at all
    assert commits.workloads() == 0
    commits.close()
    async with ctl.client() as http:
        rows = (await http.get("/api/v1/usage")).json()["rows"]  # flushes the pending usage first
    assert [(r["model"], r["requests"], r["errors"]) for r in rows] == [(UNRESOLVED_MODEL, 4, 4)]
    raw = (ctl.state_dir / "control.db").read_bytes() + (ctl.state_dir / "control.db-wal").read_bytes()
    assert name.encode() not in raw


async def test_the_envelope_refuses_bad_fields_with_typed_errors_and_stores_nothing(ctl: Controller) -> None:
    key = await inference_key(ctl)
    commits = Commits(ctl.state_dir)
    before = commits.version()
    cases: list[tuple[bytes, int, str]] = [
        (b'{"deadline_at": NaN}', 400, "invalid_request"),
        (b'{"deadline_at": Infinity}', 400, "invalid_request"),
        (b'{"deadline_at": 1e400}', 400, "invalid_request"),
        (b'{"payload": {"messages": [], "temperature": NaN}}', 400, "invalid_request"),
    ]
    async with ctl.client(key) as http:
        for raw_field, status, code in cases:
            resp = await http.post(
                "/api/v1/workloads", content=_with(raw_field), headers={"content-type": "application/json"}
            )
            envelope_error(resp, status, code)
    typed = [
        (envelope(workload_id="a/b"), 400, "invalid_request", "workload_id"),
        (envelope(model="m" * (MAX_MODEL_CHARS + 1)), 400, "invalid_request", "model"),
        (envelope(data_class="Top Secret"), 400, "invalid_request", "data_class"),
        (envelope(priority="batch", latency_class="realtime"), 400, "invalid_request", "latency_class"),
        (envelope(capability="embedding", payload={"input": "x"}, stream=True), 400, "field_not_supported", "stream"),
        (envelope(payload={"messages": MESSAGES, "max_tokens": 0}), 400, "invalid_request", "payload.max_tokens"),
        (envelope(payload={"messages": MESSAGES, "stream_options": {}}), 400, "invalid_request", "stream_options"),
        (envelope(colour="blue"), 400, "invalid_request", "colour"),
        (envelope(retention="retain_until"), 422, "retention_unavailable", "retention"),
    ]
    async with ctl.client(key) as http:
        for body, status, code, field in typed:
            error = envelope_error(await http.post("/api/v1/workloads", json=body), status, code)
            assert field in error["message"], error
        # A workload id with `/` could never be looked up; the path takes one segment only.
        assert (await http.get("/api/v1/workloads/a/b")).status_code == 404
    assert commits.version() == before
    assert commits.workloads() == 0
    commits.close()


def _with(raw_field: bytes) -> bytes:
    """An otherwise valid envelope with `raw_field` (`{"name": <not JSON>}`) in place of its field."""
    name = raw_field[2:].split(b'"', 1)[0].decode()
    base = {k: v for k, v in envelope().items() if k != name}
    return json.dumps(base).encode()[:-1] + b", " + raw_field[1:]


async def test_a_bug_behind_an_inference_route_answers_in_the_error_shape_and_quotes_nothing(
    ctl: Controller, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    from nexa.control.datapath.gateway import Gateway

    def broken(*_args: object, **_kwargs: object) -> NoReturn:
        raise ValueError("canary-7f3a quoted from the request")

    monkeypatch.setattr(Gateway, "call", broken)
    key = await inference_key(ctl)
    async with ctl.client(key) as http:
        resp = await http.post("/v1/chat/completions", json={"model": "chat", "messages": MESSAGES})
        openai_error(resp, 500, "internal")
        resp = await http.post("/api/v1/workloads", json=envelope())
        envelope_error(resp, 500, "internal")
        assert (await http.get("/healthz")).status_code == 200
    assert "canary-7f3a" not in caplog.text
    assert "ValueError" in caplog.text
