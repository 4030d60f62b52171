"""`Gateway.call` as an async context manager, on its own: one outcome per call, settled once, and
the exit stack releasing the admission slot, replica and quota ticket on every path.

Admission, quotas, routing, metering and the store are the real ones; the relay is a fake whose
streams a test scripts (fault injection: a node not connected, a runtime failing before output,
a stream that never ends), and the model and deployment registries are stand-ins that serve one
alias on two replicas.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import AsyncIterator
from pathlib import Path

import attrs
import pytest
import trio
import trio.testing

from nexa.config import GatewayConfig
from nexa.contracts import wire
from nexa.contracts.deployments import ServingReplica, ServingSet
from nexa.contracts.domain import KeyId, TenantId
from nexa.contracts.gateway import Api, Capability, Priority, UsageRecord
from nexa.contracts.models import ModelRef
from nexa.contracts.usage import QuotaLimits
from nexa.control import store as st
from nexa.control.datapath.admission import Admission
from nexa.control.datapath.calls import Progress, Work
from nexa.control.datapath.gateway import Gateway
from nexa.control.datapath.metering import Meter
from nexa.control.datapath.quotas import Quotas
from nexa.control.datapath.routing import Router
from nexa.errors import (
    ChannelError,
    ModelNotServed,
    NoReadyReplica,
    QuotaExceeded,
    RuntimeFailed,
    RuntimeRejected,
)
from nexa.telemetry import Metrics
from tests.support.gatewayrig import REF, FakeModels, FakeStream

BACKOFF_S = 0.05
ACME = TenantId("acme")
ANSWER = json.dumps(
    {
        "id": "c1",
        "object": "chat.completion",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 1, "total_tokens": 6},
    }
).encode()


@attrs.define
class Script:
    chunks: list[bytes] = attrs.Factory(list)
    end: wire.EndHead | None = attrs.Factory(lambda: wire.EndHead(status=wire.EndStatus.OK))
    #: Raise this when the stream is opened (ChannelError: the node is not connected).
    refuse: BaseException | None = None
    #: Never end after the chunks (the runtime is still at work).
    hang: bool = False
    #: The node's script for the next open, once this one was used.
    then: Script | None = None


class FakeRelay:
    """Streams scripted per node; counts opens and the streams still open."""

    def __init__(self) -> None:
        self.scripts: dict[str, Script] = {}
        self.opened: list[str] = []
        self.open_now = 0

    @contextlib.asynccontextmanager
    async def open(self, node_id: str, request_id: str, head: wire.InferHead, body: bytes) -> AsyncIterator[FakeStream]:
        script = self.scripts.get(node_id, Script())
        if script.then is not None:
            self.scripts[node_id] = script.then
        await trio.lowlevel.checkpoint()
        if script.refuse is not None:
            raise script.refuse
        self.opened.append(node_id)
        self.open_now += 1
        try:
            yield FakeStream(script.chunks, script.end, hang=script.hang)
        finally:
            self.open_now -= 1


class FakeDeployments:
    def serving(self, ref: ModelRef, *, alias: str | None = None) -> ServingSet:
        replicas = [
            ServingReplica(replica_id=f"r{i}", node_id=f"n{i}", deployment="chat-prod", model=REF) for i in (1, 2)
        ]
        return ServingSet(model=REF, replicas=replicas, deployments=["chat-prod"])


@attrs.define
class Rig:
    gateway: Gateway
    relay: FakeRelay
    admission: Admission
    quotas: Quotas
    router: Router
    meter: Meter
    records: list[UsageRecord]

    def slots_in_use(self) -> int:
        return sum(m.in_use for m in self.admission.statistics().models.values())

    def concurrent(self) -> int:
        return self.quotas.view(ACME, time.time()).use.concurrent_requests

    def released(self) -> bool:
        """Nothing of any call is still held: slot, quota ticket, replica, relay stream."""
        outstanding = sum(self.router.outstanding(r) for r in ("r1", "r2"))
        return (self.slots_in_use(), self.concurrent(), outstanding, self.relay.open_now) == (0, 0, 0, 0)


@pytest.fixture
async def rig(nursery: trio.Nursery, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Rig]:
    async with st.open_store(tmp_path / "state") as store:
        metrics = Metrics()
        cfg = GatewayConfig(retries=2, retry_backoff_s=BACKOFF_S)
        meter = Meter(cfg, store, metrics)
        records: list[UsageRecord] = []
        real_record = meter.record

        def record(rec: UsageRecord) -> None:
            records.append(rec)
            real_record(rec)

        monkeypatch.setattr(meter, "record", record)
        quotas = Quotas(store, metrics, lambda tenant: True, [])
        admission = Admission(cfg, metrics)
        router = Router(cfg)
        relay = FakeRelay()
        gateway = Gateway(
            cfg,
            models=FakeModels(),  # type: ignore[arg-type]
            deployments=FakeDeployments(),  # type: ignore[arg-type]
            relay=relay,  # type: ignore[arg-type]
            quotas=quotas,
            admission=admission,
            router=router,
            meter=meter,
        )
        await nursery.start(gateway.run)
        yield Rig(gateway, relay, admission, quotas, router, meter, records)


def work(*, model: str = "chat", stream: bool = False, rid: str = "rid-1") -> Work:
    return Work(
        request_id=rid,
        api=Api.OPENAI,
        tenant=ACME,
        key_id=KeyId("k1"),
        capability=Capability.CHAT,
        model=model,
        body={"messages": [{"role": "user", "content": "hello there"}]},
        stream=stream,
        include_usage=stream,
        deadline_at=time.time() + 30,
    )


def usage_end(prompt: int = 5, completion: int = 1) -> wire.EndHead:
    return wire.EndHead(status=wire.EndStatus.OK, prompt_tokens=prompt, completion_tokens=completion)


async def test_a_call_is_made_once_into_one_outcome_and_one_usage_record(rig: Rig) -> None:
    rig.relay.scripts["n1"] = rig.relay.scripts["n2"] = Script(chunks=[ANSWER], end=usage_end())
    call = rig.gateway.call(work())
    async with call as answer:
        assert rig.slots_in_use() == 1 and rig.concurrent() == 1  # held while the answer is read
        assert await answer.read_all() == ANSWER
        made_inside = call.outcome
    assert made_inside is None  # made when the call is left, not before
    outcome = call.outcome
    assert outcome is not None and outcome.opened and outcome.status == "ok"
    assert (outcome.alias, outcome.model, outcome.deployment, outcome.attempts) == ("chat", REF, "chat-prod", 1)
    assert (outcome.prompt_tokens, outcome.completion_tokens) == (5, 1)
    assert outcome.ttft_ms is not None and outcome.duration_ms >= outcome.ttft_ms
    # The usage record is derived from that outcome, once; the quota settled with its tokens.
    assert rig.records == [UsageRecord.from_outcome(outcome)]
    assert rig.quotas.view(ACME, time.time()).use.tokens_last_minute == outcome.total_tokens
    assert rig.released()
    with pytest.raises(RuntimeError, match="entered once"):
        async with call:
            pass
    assert len(rig.records) == 1


async def test_an_outcome_is_made_only_once() -> None:
    progress = Progress(work=work(), started=trio.current_time())
    first = progress.end()
    with pytest.raises(RuntimeError, match="made once"):
        progress.end()
    assert progress.outcome is first


@pytest.mark.parametrize(
    ("name", "expected"),
    [("unknown", ModelNotServed), ("chat", QuotaExceeded)],
    ids=["model not served", "quota exceeded"],
)
async def test_a_refused_call_is_settled_once_and_holds_nothing(rig: Rig, name: str, expected: type[Exception]) -> None:
    if expected is QuotaExceeded:
        rig.quotas._state(ACME).limits = QuotaLimits(concurrent_requests=1)
        rig.quotas.admit(ACME, time.time())  # the one request the tenant may have running
    call = rig.gateway.call(work(model=name))
    with pytest.raises(expected):
        async with call:
            raise AssertionError("never entered")
    assert call.outcome is not None and not call.outcome.opened
    assert call.outcome.status == expected.code  # type: ignore[attr-defined]
    assert [r.status for r in rig.records] == [expected.code]  # type: ignore[attr-defined]
    assert rig.slots_in_use() == 0 and rig.relay.opened == []
    if expected is ModelNotServed:
        assert rig.records[0].alias == "(unresolved)" and rig.concurrent() == 0


async def test_a_node_not_connected_is_retried_on_the_other_replica(rig: Rig) -> None:
    rig.relay.scripts["n1"] = rig.relay.scripts["n2"] = Script(refuse=ChannelError("not connected"))
    rig.relay.scripts["n2"] = Script(chunks=[ANSWER], end=usage_end())
    call = rig.gateway.call(work())
    async with call as answer:
        assert await answer.read_all() == ANSWER
    assert call.outcome is not None and call.outcome.node_id == "n2"
    assert [r.status for r in rig.records] == ["ok"]
    assert rig.released()


def failed_end(code: str) -> wire.EndHead:
    return wire.EndHead(status=wire.EndStatus.ERROR, code=code, http_status=503)


async def test_once_every_replica_failed_before_output_the_next_round_waits_then_tries_again(rig: Rig) -> None:
    """Both replicas fail before output (a runtime restarting, say); the third attempt, after the
    backoff, is answered: the client sees one success."""
    for node in ("n1", "n2"):
        rig.relay.scripts[node] = Script(end=failed_end("runtime_error"), then=Script(chunks=[ANSWER], end=usage_end()))
    started = trio.current_time()
    call = rig.gateway.call(work())
    async with call as answer:
        assert await answer.read_all() == ANSWER
    assert trio.current_time() - started >= BACKOFF_S
    assert sorted(rig.relay.opened[:2]) == ["n1", "n2"] and len(rig.relay.opened) == 3
    assert call.outcome is not None and (call.outcome.status, call.outcome.attempts) == ("ok", 3)
    assert [r.status for r in rig.records] == ["ok"]
    assert rig.released()


@pytest.mark.parametrize(
    ("code", "expected", "status"),
    [
        # The node had no Ready runtime for it: nothing ran anywhere, a 503 to retry.
        ("runtime_unavailable", NoReadyReplica, "no_ready_replica"),
        ("unknown_assignment", NoReadyReplica, "no_ready_replica"),
        # The runtimes failed it: a 502.
        ("runtime_error", RuntimeFailed, "runtime_failed"),
    ],
)
async def test_a_call_failing_every_retry_before_output_says_whether_anything_ran(
    rig: Rig, code: str, expected: type[Exception], status: str
) -> None:
    rig.relay.scripts["n1"] = rig.relay.scripts["n2"] = Script(end=failed_end(code))
    call = rig.gateway.call(work())
    with pytest.raises(expected):
        async with call:
            raise AssertionError("never entered")
    assert len(rig.relay.opened) == 3  # the first attempt and `retries` more
    assert call.outcome is not None and (call.outcome.status, call.outcome.attempts) == (status, 3)
    assert [r.status for r in rig.records] == [status]
    assert rig.released()


async def test_no_retry_round_waits_past_the_requests_deadline(rig: Rig) -> None:
    rig.relay.scripts["n1"] = rig.relay.scripts["n2"] = Script(end=failed_end("runtime_error"))
    short = attrs.evolve(work(), deadline_at=time.time() + BACKOFF_S / 2)
    call = rig.gateway.call(short)
    with pytest.raises(RuntimeFailed):
        async with call:
            raise AssertionError("never entered")
    assert sorted(rig.relay.opened) == ["n1", "n2"]  # each replica once, no round after the pause
    assert call.outcome is not None and call.outcome.attempts == 2
    assert rig.released()


async def test_a_runtime_failing_before_output_fails_the_call_once_and_releases_everything(rig: Rig) -> None:
    rejected = wire.EndHead(
        status=wire.EndStatus.ERROR, code="runtime_rejected", http_status=400, message="bad request"
    )
    rig.relay.scripts["n1"] = rig.relay.scripts["n2"] = Script(end=rejected)
    call = rig.gateway.call(work())
    with pytest.raises(RuntimeRejected):
        async with call:
            raise AssertionError("never entered")
    assert rig.relay.opened in (["n1"], ["n2"])  # refused by the runtime itself: not retried
    assert call.outcome is not None and call.outcome.status == "runtime_rejected" and not call.outcome.opened
    assert [r.status for r in rig.records] == ["runtime_rejected"]
    assert rig.released()


async def test_a_caller_cancelled_mid_stream_is_settled_once_as_cancelled(rig: Rig) -> None:
    event = b'data: {"id":"c","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"a"}}]}\n\n'
    rig.relay.scripts["n1"] = rig.relay.scripts["n2"] = Script(chunks=[event, event], hang=True)
    call = rig.gateway.call(work(stream=True))
    got: list[bytes] = []
    with trio.move_on_after(1) as client:
        async with call as answer:
            async for chunk in answer:  # the third never comes: the client gives up
                got.append(chunk)
    assert client.cancelled_caught and got == [event, event]
    assert call.outcome is not None and call.outcome.status == "cancelled"
    assert call.outcome.completion_tokens == 2  # what was streamed, one token an event
    assert [(r.status, r.completion_tokens) for r in rig.records] == [("cancelled", 2)]
    assert rig.released()


async def test_a_caller_cancelled_while_queued_is_settled_once_and_leaves_the_queue(rig: Rig) -> None:
    rig.relay.scripts["n1"] = rig.relay.scripts["n2"] = Script(chunks=[ANSWER], end=usage_end())
    capacity = 2 * rig.gateway._cfg.max_inflight_per_replica  # what the gateway sets for two replicas
    rig.admission.set_capacity("chat", capacity)
    async with contextlib.AsyncExitStack() as others, trio.open_nursery() as nursery:
        for _ in range(capacity):  # another tenant holds every slot: the call queues
            await others.enter_async_context(
                rig.admission.slot("chat", TenantId("beta"), Priority.STANDARD, trio.current_time() + 60)
            )
        call = rig.gateway.call(work())

        async def client() -> None:
            async with call:
                raise AssertionError("never admitted")

        nursery.start_soon(client)
        await trio.testing.wait_all_tasks_blocked()
        assert rig.concurrent() == 1  # the quota ticket is held while it waits
        [model] = rig.admission.statistics().models.values()
        assert sum(model.waiting.values()) == 1
        nursery.cancel_scope.cancel()
    assert call.outcome is not None and call.outcome.status == "cancelled" and not call.outcome.opened
    assert [r.status for r in rig.records] == ["cancelled"]
    assert rig.released() and rig.relay.opened == []
    [model] = rig.admission.statistics().models.values()
    assert sum(model.waiting.values()) == 0


async def test_an_error_in_the_callers_block_still_settles_once(rig: Rig) -> None:
    rig.relay.scripts["n1"] = rig.relay.scripts["n2"] = Script(chunks=[ANSWER], end=None, hang=True)
    call = rig.gateway.call(work())
    with pytest.raises(ZeroDivisionError):
        async with call:
            _ = 1 / 0
    # Left before the end: the rest is cancelled at the node (the relay stream is closed).
    assert call.outcome is not None and call.outcome.status == "cancelled"
    assert len(rig.records) == 1
    assert rig.released()
