"""The controller's HTTP API as a client sees it: answers, error envelopes, keys, nodes, metrics; and
the app state of a management app built in process with only the parts a test needs (`bare_state`)."""

from __future__ import annotations

import contextlib
import re
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, TypeVar

import httpx
import trio

from nexa.control.http.state import AppState
from nexa.telemetry import Metrics
from tests.conftest import Controller

Json = dict[str, Any]
#: How long `wait_for` polls, and the tests that use it wait, by default.
TIMEOUT_S = 15


T = TypeVar("T")


async def in_thread(fn: Callable[[], T]) -> T:
    """`fn` (a blocking client call, such as an official SDK's) in a worker thread."""
    return await trio.to_thread.run_sync(fn)


async def ok(call: Awaitable[httpx.Response], status: int = 200) -> Json:
    resp = await call
    assert resp.status_code == status, resp.text
    body: Json = resp.json()
    return body


def assert_envelope(resp: httpx.Response, status: int, code: str) -> dict[str, object]:
    assert resp.status_code == status, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"code", "message", "retryable", "request_id"}
    assert err["code"] == code
    assert err["request_id"] == resp.headers["X-Request-Id"]
    assert isinstance(err["message"], str) and err["message"]
    return err


async def make_key(c: Controller, role: str, tenant: str | None = None) -> str:
    async with c.client() as http:
        if tenant:
            await http.post("/api/v1/tenants", json={"id": tenant})
        resp = await http.post("/api/v1/keys", json={"role": role, "tenant": tenant, "name": f"{role} key"})
    assert resp.status_code == 201, resp.text
    return str(resp.json()["key"])


async def metric(c: Controller, name: str, **labels: str) -> float:
    async with c.client() as http:
        text = (await http.get("/metrics")).text
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    match = re.search(rf"^{name}{{{re.escape(want)}}} (\S+)$", text, re.M) if labels else None
    if not labels:
        match = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


async def node_view(c: Controller, node_id: str) -> dict[str, Any]:
    async with c.client() as http:
        resp = await http.get(f"/api/v1/nodes/{node_id}")
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


async def wait_for(predicate: Any, *, timeout_s: float = TIMEOUT_S) -> None:
    with trio.fail_after(timeout_s):
        while not await predicate():  # noqa: ASYNC110 - polling the HTTP API, as an operator would
            await trio.sleep(0.05)


#: The console forms' CSRF field.
CSRF_RE = re.compile(r'name="csrf_token" value="([^"]+)"')


@contextlib.contextmanager
def console_session(url: str, key: str) -> Iterator[httpx.Client]:
    """A sync client signed in to the console at `url` with `key` (its cookie kept)."""
    with httpx.Client(base_url=url, timeout=30) as http:
        form = http.get("/console/login")
        match = CSRF_RE.search(form.text)
        assert match, form.text
        signed = http.post("/console/login", data={"csrf_token": match.group(1), "api_key": key})
        assert signed.status_code in (302, 303), signed.text
        yield http


def wait_until(check: Callable[[], Any], what: str, timeout_s: float = 30.0) -> Any:
    """Call `check` (sync) every 0.2 s until it returns something true; that, or AssertionError naming `what`."""
    deadline = time.monotonic() + timeout_s
    last: Any = None
    while time.monotonic() < deadline:
        last = check()
        if last:
            return last
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}; last saw {last!r}")


def bare_state(**parts: Any) -> AppState:
    """An `AppState` with every part None but those given (`accounts=…, store=…, ready=True`): for a
    management app built in process whose routes under test read only those parts."""
    fields: dict[str, Any] = dict(
        accounts=None,
        fleet=None,
        models=None,
        deployments=None,
        store=None,
        metrics=Metrics(),
        started_at=0,
        controller_keys=None,
        signing_key=None,
        quotas=None,
        meter=None,
        admission=None,
    )
    return AppState(**(fields | parts))
