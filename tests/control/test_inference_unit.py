"""The inference HTTP adapter on its own, driven over ASGI: error envelopes in both shapes, and a
workload's terminal state and receipt as `Workloads.end` makes them from the call's outcome.

Workloads and the store are the real ones; the gateway is a fake whose calls a test scripts
(fault injection: refused at entry, failing after the first byte, never ending), and the key
authority a stand-in that knows one inference key.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from nexa.config import GatewayConfig
from nexa.contracts import wire
from nexa.contracts.domain import ApiKey, KeyId, Role, TenantId
from nexa.contracts.gateway import API_VERSION, UNRESOLVED_MODEL, CallOutcome, Capability
from nexa.contracts.models import ModelRef
from nexa.control import store as st
from nexa.control.datapath.calls import Progress, Work
from nexa.control.datapath.inference import Disconnects, InferenceApp
from nexa.control.datapath.pins import Pins
from nexa.control.datapath.workloads import Workloads
from nexa.errors import NexaError, QuotaExceeded, RuntimeFailed, Unauthenticated
from nexa.security import generate_signing_key, verify_receipt
from nexa.telemetry import Metrics

ACME = TenantId("acme")
KEY = ApiKey(
    id=KeyId("k1"), name="app", role=Role.INFERENCE, tenant=ACME, secret_sha256="", created_at=0.0, created_by=None
)
AUTH = [("authorization", "Bearer good")]
CHAT_ANSWER = {"id": "c1", "object": "chat.completion", "choices": [{"index": 0, "message": {"content": "hi"}}]}


class Keys:
    def authenticate(self, presented: str) -> ApiKey:
        if presented != "good":
            raise Unauthenticated("unknown key")
        return KEY

    async def record_denied(self, *args: object) -> None:
        pass


@attrs.define
class Script:
    """What the fake gateway's next call does."""

    chunks: list[bytes] = attrs.Factory(lambda: [json.dumps(CHAT_ANSWER).encode()])
    #: Raised on entering (before any output).
    refuse: NexaError | None = None
    #: The answer's error after its chunks (after the first byte).
    error: NexaError | None = None
    #: Never end after the chunks.
    hang: bool = False
    #: Set once the answer hangs.
    hanging: trio.Event = attrs.Factory(trio.Event)


class FakeAnswer:
    def __init__(self, script: Script) -> None:
        self._chunks = list(script.chunks)
        self._script = script
        self.error: NexaError | None = None

    def __aiter__(self) -> FakeAnswer:
        return self

    async def __anext__(self) -> bytes:
        await trio.lowlevel.checkpoint()
        if self._chunks:
            return self._chunks.pop(0)
        if self._script.hang:
            self._script.hanging.set()
            await trio.sleep_forever()
        self.error = self._script.error
        raise StopAsyncIteration

    async def read_all(self) -> bytes:
        return b"".join([c async for c in self])


def outcome(work: Work, *, status: str, opened: bool) -> CallOutcome:
    return CallOutcome(
        request_id=work.request_id,
        workload_id=work.workload_id,
        api=work.api,
        tenant=work.tenant,
        key_id=work.key_id,
        capability=work.capability,
        alias="chat",
        model=ModelRef(model="tiny", version="v1"),
        deployment="chat-prod" if opened else "",
        node_id="n1" if opened else "",
        canary=False,
        status=status,
        prompt_tokens=7 if opened else 0,
        completion_tokens=3 if opened else 0,
        queue_ms=1.0,
        ttft_ms=2.0 if opened else None,
        duration_ms=5.0,
        finished_at=time.time(),
        attempts=1,
        opened=opened,
    )


class FakeCall:
    def __init__(self, work: Work, script: Script, admitted: Callable[[], Awaitable[None]] | None) -> None:
        self._work, self._script, self._admitted = work, script, admitted
        self.outcome: CallOutcome | None = None
        #: What the response's `x-nexa-overhead-ms` is computed from (nothing waited outside here).
        self.progress = Progress(work=work, started=trio.current_time())

    async def __aenter__(self) -> FakeAnswer:
        if self._script.refuse is not None:
            self.outcome = outcome(self._work, status=self._script.refuse.code, opened=False)
            raise self._script.refuse
        if self._admitted is not None:
            await self._admitted()
        self._answer = FakeAnswer(self._script)
        return self._answer

    async def __aexit__(self, *exc_info: object) -> None:
        error = self._answer.error
        self.outcome = outcome(self._work, status="ok" if error is None else error.code, opened=True)


class FakeGateway:
    def __init__(self) -> None:
        self.script = Script()
        self.works: list[Work] = []

    def call(self, work: Work, *, admitted: Callable[[], Awaitable[None]] | None = None) -> FakeCall:
        self.works.append(work)
        return FakeCall(work, self.script, admitted)

    def served_models(self) -> list[object]:
        return []


@attrs.define
class Answer:
    status: int
    headers: dict[str, str]
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


@attrs.define
class Rig:
    app: InferenceApp
    gateway: FakeGateway
    workloads: Workloads
    public_key: Any
    fallback_paths: list[str]

    #: How many times the app called `receive` (the body is one).
    receives: int = 0
    #: The stored responses' pins the app reads (the rig's store).
    pins: Pins | None = None

    async def request(
        self,
        method: str,
        path: str,
        body: object = None,
        headers: list[tuple[str, str]] = AUTH,
        query: str = "",
        leave: trio.Event | None = None,
    ) -> Answer:
        """One request; with `leave`, its client goes away (`http.disconnect`) once that is set."""
        raw = b"" if body is None else json.dumps(body).encode()
        sent: list[dict[str, Any]] = []
        delivered = False

        async def receive() -> dict[str, Any]:
            nonlocal delivered
            self.receives += 1
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": raw, "more_body": False}
            if leave is not None:
                await leave.wait()
                return {"type": "http.disconnect"}
            await trio.sleep_forever()
            raise AssertionError("unreachable")

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)

        scope = {
            "type": "http",
            "method": method,
            "path": path,
            "query_string": query.encode(),
            "headers": [(k.encode(), v.encode()) for k, v in headers],
        }
        await self.app(scope, receive, send)
        if not sent:
            return Answer(status=0, headers={}, body=b"")  # the client went away: nothing was answered
        start = sent[0]
        return Answer(
            status=start["status"],
            headers={k.decode(): v.decode() for k, v in start["headers"]},
            body=b"".join(m.get("body", b"") for m in sent[1:]),
        )


@pytest.fixture
async def rig(tmp_path: Path) -> AsyncIterator[Rig]:
    async with st.open_store(tmp_path / "state") as store:
        signer = generate_signing_key()
        workloads = await Workloads.load(store, signer)
        gateway = FakeGateway()
        fallback_paths: list[str] = []

        async def fallback(scope: Any, receive: Any, send: Any) -> None:
            fallback_paths.append(scope["path"])

        app = InferenceApp(
            fallback,
            cfg=GatewayConfig(),
            gateway=gateway,  # type: ignore[arg-type]
            workloads=workloads,
            accounts=Keys(),  # type: ignore[arg-type]
            metrics=Metrics(),
            pins=(pins := Pins(store)),
            max_body_bytes=1 << 20,
        )
        yield Rig(app, gateway, workloads, signer.public, fallback_paths, pins=pins)


def envelope(workload_id: str = "w1", **changes: object) -> dict[str, object]:
    return {
        "version": API_VERSION,
        "idempotency_key": f"idem-{workload_id}",
        "workload_id": workload_id,
        "capability": Capability.CHAT.value,
        "model": "chat",
        "payload": {"messages": [{"role": "user", "content": "hello"}]},
        **changes,
    }


async def test_other_paths_go_to_the_fallback_app(rig: Rig) -> None:
    await rig.app({"type": "http", "method": "GET", "path": "/api/v1/nodes", "headers": []}, None, None)
    assert rig.fallback_paths == ["/api/v1/nodes"]


async def test_errors_answer_in_the_openai_shape_on_v1_and_in_the_envelope_on_workloads(rig: Rig) -> None:
    chat = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
    no_key = await rig.request("POST", "/v1/chat/completions", chat, headers=[])
    assert no_key.status == 401 and no_key.headers["www-authenticate"] == 'Bearer realm="nexa"'
    assert no_key.json()["error"]["type"] == "authentication_error"
    assert no_key.json()["error"]["code"] == "unauthenticated"
    bad = await rig.request("POST", "/api/v1/workloads", envelope(version="v0"))
    assert bad.status == 400
    error = bad.json()["error"]
    assert error["code"] == "invalid_request" and error["retryable"] is False and error["request_id"]
    assert rig.gateway.works == []  # refused before the gateway


async def test_an_error_after_the_first_byte_goes_in_band_in_the_openai_shape(rig: Rig) -> None:
    event = b'data: {"choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
    rig.gateway.script = Script(chunks=[event], error=RuntimeFailed("the node serving the request stopped answering"))
    chat = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    resp = await rig.request("POST", "/v1/chat/completions", chat)
    assert resp.status == 200 and resp.headers["content-type"] == "text/event-stream"
    first, second = resp.body.split(b"\n\n")[:2]
    assert first + b"\n\n" == event
    assert json.loads(second.removeprefix(b"data: "))["error"]["code"] == "runtime_failed"


async def test_a_refused_workload_is_failed_with_a_receipt_that_names_no_model(rig: Rig) -> None:
    rig.gateway.script = Script(refuse=QuotaExceeded("used up", limit="concurrent", retry_after_s=3.0))
    resp = await rig.request("POST", "/api/v1/workloads", envelope())
    assert resp.status == 429 and resp.headers["retry-after"] == "3"
    assert resp.json()["error"]["code"] == "quota_exceeded"
    assert rig.workloads.active_count() == 0
    # Refused before admission: nothing stored, its id and key are free for a retry.
    assert (await rig.request("GET", "/api/v1/workloads/w1")).status == 404
    rig.gateway.script = Script()
    assert (await rig.request("POST", "/api/v1/workloads", envelope())).json()["state"] == "succeeded"


async def test_a_workload_succeeds_with_the_figures_of_its_calls_outcome(rig: Rig) -> None:
    resp = await rig.request("POST", "/api/v1/workloads", envelope())
    assert resp.status == 200
    view = resp.json()
    assert (view["state"], view["error"], view["output"]) == ("succeeded", None, CHAT_ANSWER)
    assert view["usage"] == {"prompt_tokens": 7, "completion_tokens": 3}
    receipt = view["receipt"]["receipt"]
    assert (receipt["model"], receipt["model_version"], receipt["node_id"]) == ("tiny", "v1", "n1")
    stored = await rig.workloads.receipt(ACME, "w1")
    verify_receipt(rig.public_key, stored)
    assert (await rig.request("GET", "/api/v1/workloads/w1")).json()["receipt"] == view["receipt"]
    # The same envelope again answers with the stored receipt, without a second call.
    again = await rig.request("POST", "/api/v1/workloads", envelope())
    assert again.json()["receipt"] == view["receipt"] and len(rig.gateway.works) == 1


async def test_a_workload_failing_after_its_first_byte_is_failed_and_keeps_its_figures(rig: Rig) -> None:
    rig.gateway.script = Script(error=RuntimeFailed("the runtime failed the request (runtime_error)"))
    resp = await rig.request("POST", "/api/v1/workloads", envelope())
    assert resp.status == 502 and resp.json()["error"]["code"] == "runtime_failed"
    stored = (await rig.workloads.receipt(ACME, "w1")).receipt
    assert (stored.state.value, stored.error, stored.model) == ("failed", "runtime_failed", "tiny")


async def test_a_workload_cancelled_while_it_runs_is_cancelled(rig: Rig) -> None:
    rig.gateway.script = Script(chunks=[], hang=True)
    answers: list[Answer] = []
    async with trio.open_nursery() as nursery:

        async def submit() -> None:
            answers.append(await rig.request("POST", "/api/v1/workloads", envelope()))

        nursery.start_soon(submit)
        with trio.fail_after(5):
            await rig.gateway.script.hanging.wait()
        cancelled = await rig.request("POST", "/api/v1/workloads/w1/cancel")
        assert cancelled.status == 202
    [resp] = answers
    assert resp.json()["error"]["code"] == "cancelled"
    stored = (await rig.workloads.receipt(ACME, "w1")).receipt
    assert (stored.state.value, stored.error) == ("cancelled", "cancelled")
    assert stored.model != UNRESOLVED_MODEL  # the call was answered before it was cancelled


async def test_a_client_that_goes_away_cancels_its_workload_and_a_short_request_is_never_watched(
    rig: Rig, nursery: trio.Nursery
) -> None:
    await nursery.start(rig.app.disconnects.run)
    chat = {"model": "chat", "messages": [{"role": "user", "content": "hi"}]}
    assert (await rig.request("POST", "/v1/chat/completions", chat)).status == 200
    assert rig.receives == 1  # the body only: no task waited for that client
    rig.gateway.script = Script(chunks=[], hang=True)
    leave = trio.Event()
    answers: list[Answer] = []
    async with trio.open_nursery() as requests:

        async def submit() -> None:
            answers.append(await rig.request("POST", "/api/v1/workloads", envelope(), leave=leave))

        requests.start_soon(submit)
        with trio.fail_after(5):
            await rig.gateway.script.hanging.wait()
        leave.set()
    assert answers == [Answer(status=0, headers={}, body=b"")]
    assert rig.receives == 3  # its body, then one wait for its client
    stored = (await rig.workloads.receipt(ACME, "w1")).receipt
    assert (stored.state.value, stored.error) == ("cancelled", "cancelled")


async def test_a_watched_request_that_ends_stops_the_wait_for_its_client(nursery: trio.Nursery) -> None:
    disconnects = Disconnects(after_s=0.01)
    await nursery.start(disconnects.run)
    waiting, stopped = trio.Event(), trio.Event()

    async def receive() -> dict[str, Any]:
        waiting.set()
        try:
            await trio.sleep_forever()
        finally:
            stopped.set()
        raise AssertionError("unreachable")

    with trio.fail_after(5), trio.CancelScope() as request:
        watched = disconnects.watch(receive, request)
        await waiting.wait()
        disconnects.forget(watched)
        await stopped.wait()
    assert not request.cancelled_caught


async def test_the_list_shows_a_running_workload_live_and_a_finished_one_by_its_receipt(rig: Rig) -> None:
    done = (await rig.request("POST", "/api/v1/workloads", envelope("w1"))).json()
    rig.gateway.script = Script(chunks=[], hang=True)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(rig.request, "POST", "/api/v1/workloads", envelope("w2"))
        with trio.fail_after(5):
            await rig.gateway.script.hanging.wait()
        first = (await rig.request("GET", "/api/v1/workloads", query="limit=1")).json()
        assert [w["workload_id"] for w in first["workloads"]] == ["w1"] and first["next_cursor"]
        assert first["workloads"][0]["receipt"] == done["receipt"]
        rest = (await rig.request("GET", "/api/v1/workloads", query=f"limit=1&cursor={first['next_cursor']}")).json()
        [running] = rest["workloads"]
        assert (running["workload_id"], running["state"], running["receipt"]) == ("w2", "running", None)
        assert rest["next_cursor"] is None
        assert (await rig.request("POST", "/api/v1/workloads/w2/cancel")).status == 202
    listed = (await rig.request("GET", "/api/v1/workloads")).json()["workloads"]
    assert [(w["workload_id"], w["state"]) for w in listed] == [("w1", "succeeded"), ("w2", "cancelled")]
    assert (await rig.request("GET", "/api/v1/workloads", query="limit=1001")).status == 400


async def test_a_stored_responses_routes_reach_its_replica_only_for_its_own_tenant_and_served_routes(rig: Rig) -> None:
    """Retrieve and cancel go to the gateway pinned to the replica keeping the response, as a
    body-less call of the runtime's own route; an id not the tenant's (or unfit for a path), delete,
    input items and a streamed retrieve are refused before the gateway, in OpenAI's error shape."""
    assert rig.pins is not None
    pin = st.Pin(model="chat", deployment="chat-prod", replica_id="r2", made_at=time.time())
    await rig.pins.remember(ACME, "resp_1", pin)
    await rig.pins.remember(TenantId("globex"), "resp_theirs", pin)
    stored = {"id": "resp_1", "object": "response", "status": "completed", "output": []}
    rig.gateway.script = Script(chunks=[json.dumps(stored).encode()])
    got = await rig.request("GET", "/v1/responses/resp_1")
    assert got.status == 200 and got.json() == stored
    rig.gateway.script = Script(chunks=[json.dumps(stored).encode()])
    assert (await rig.request("POST", "/v1/responses/resp_1/cancel")).status == 200
    routed = [(w.pin, w.model, w.body, w.route and (w.route.method, w.route.path)) for w in rig.gateway.works]
    assert routed == [
        ("r2", "chat", {}, (wire.RuntimeMethod.GET, "/v1/responses/resp_1")),
        ("r2", "chat", {}, (wire.RuntimeMethod.POST, "/v1/responses/resp_1/cancel")),
    ]
    refusals = [
        ("GET", "/v1/responses/resp_theirs", "", 404, "response_not_found"),
        ("POST", "/v1/responses/resp_never/cancel", "", 404, "response_not_found"),
        ("GET", "/v1/responses/..", "", 404, "response_not_found"),
        ("DELETE", "/v1/responses/resp_theirs", "", 404, "response_not_found"),
        ("DELETE", "/v1/responses/resp_1", "", 404, "api_not_served"),
        ("GET", "/v1/responses/resp_1/input_items", "", 404, "api_not_served"),
        ("GET", "/v1/responses/resp_1", "stream=true", 400, "field_not_supported"),
        ("GET", "/v1/responses/resp_1", "starting_after=3", 400, "field_not_supported"),
        ("PUT", "/v1/responses/resp_1", "", 405, "method_not_allowed"),
    ]
    for method, path, query, status, code in refusals:
        answer = await rig.request(method, path, query=query)
        assert (answer.status, answer.json()["error"]["code"]) == (status, code), (method, path, query)
    assert len(rig.gateway.works) == 2  # none of them reached the gateway
    assert await rig.pins.find(ACME, "resp_1") == pin  # a refused delete changed nothing
