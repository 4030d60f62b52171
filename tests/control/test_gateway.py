"""The gateway's pipeline against a scripted node: runtime answers that are not what the API
promises, token counts out of range, and the relay's multiplex ids.

Gateway, relay, admission, routing, metering and the store are the real ones; the node is a fake
that answers each `infer` with frames a test chose (fault injection), and the model and
deployment registries are stand-ins that serve one alias on one replica.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from nexa.config import GatewayConfig
from nexa.contracts import codec, wire
from nexa.contracts.deployments import ServingReplica, ServingSet
from nexa.contracts.domain import KeyId, TenantId
from nexa.contracts.gateway import Api, Capability, usage_bounds
from nexa.contracts.models import ModelRef
from nexa.control import store as st
from nexa.control.datapath.admission import Admission
from nexa.control.datapath.calls import Work
from nexa.control.datapath.gateway import Gateway
from nexa.control.datapath.metering import MAX_TOKEN_COUNT, Meter
from nexa.control.datapath.relay import Relay
from nexa.control.datapath.routing import Router
from nexa.errors import RuntimeFailed
from nexa.telemetry import Metrics
from tests.support.gatewayrig import REF, FakeModels

Frame = tuple[str, bytes, bytes]
MESSAGES = [{"role": "user", "content": "hello there, how are you"}]
CHAT_ANSWER = {
    "id": "chatcmpl-1",
    "object": "chat.completion",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "fine thanks"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 6, "completion_tokens": 2, "total_tokens": 8},
}


def chunk(body: bytes) -> Frame:
    return (wire.CHUNK, b"", body)


def chunks(body: bytes, size: int = 32 * 1024) -> list[Frame]:
    """`body` in chunks as a node sends them (at most its `max_chunk_bytes` each)."""
    return [chunk(body[i : i + size]) for i in range(0, len(body), size)]


def end(**fields: Any) -> Frame:
    """An `end` head written by hand: whatever the wire contract would (not) let a real node send."""
    return (wire.END, json.dumps({"status": "ok", **fields}).encode(), b"")


def event(obj: object) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def delta(text: str) -> bytes:
    return event({"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}}]})


DONE = b"data: [DONE]\n\n"


class ScriptedNode:
    """The node end of the relay: answers every `infer` with `script(head, body)`'s frames."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self._nursery = nursery
        self.relay: Relay | None = None
        self.script: Callable[[wire.InferHead, bytes], list[Frame]] = lambda head, body: []
        #: Stream ids of the `infer` frames received, in order.
        self.stream_ids: list[str] = []
        self.cancels: list[str] = []
        #: Set to hold every answer until the test lets them go.
        self.gate: trio.Event | None = None

    async def send_data(self, node_id: str, kind: str, request_id: str, head: bytes, body: bytes) -> None:
        if kind == wire.INFER:
            self.stream_ids.append(request_id)
            infer = codec.loads(codec.wire, head, wire.InferHead)
            self._nursery.start_soon(self._play, node_id, request_id, self.script(infer, body))

    def send_data_nowait(self, node_id: str, kind: str, request_id: str, head: bytes, body: bytes) -> None:
        if kind == wire.CANCEL:
            self.cancels.append(request_id)

    async def _play(self, node_id: str, request_id: str, frames: list[Frame]) -> None:
        if self.gate is not None:
            await self.gate.wait()
        await trio.lowlevel.checkpoint()
        assert self.relay is not None
        for kind, head, body in frames:
            self.relay.deliver(node_id, wire.DataFrame(kind=kind, request_id=request_id, head=head, body=body))
            await trio.lowlevel.checkpoint()


class FakeDeployments:
    def serving(self, ref: ModelRef, *, alias: str | None = None) -> ServingSet:
        replica = ServingReplica(replica_id="r1", node_id="n1", deployment="chat-prod", model=REF)
        return ServingSet(model=REF, replicas=[replica], deployments=["chat-prod"])


class FakeQuotas:
    """Admits everything (quota behaviour has its own tests); keeps the tokens each call settled."""

    def __init__(self) -> None:
        self.settled: list[int] = []

    def admit(self, *args: object, **kwargs: object) -> object:
        return object()

    def finish(self, ticket: object, tokens: int, *args: object, **kwargs: object) -> None:
        self.settled.append(tokens)


@attrs.define
class Rig:
    gateway: Gateway
    node: ScriptedNode
    meter: Meter
    metrics: Metrics
    store: st.Store
    quotas: FakeQuotas

    async def rows(self) -> list[tuple[Any, ...]]:
        await self.meter.flush()

        def read(db: Any) -> list[tuple[Any, ...]]:
            return list(db.execute("SELECT request_id, status, prompt_tokens, completion_tokens FROM usage"))

        return await self.store.run(read)

    def sample(self, name: str, **labels: str) -> float:
        return self.metrics.registry.get_sample_value(name, labels) or 0.0


@pytest.fixture
async def rig(nursery: trio.Nursery, tmp_path: Path) -> AsyncIterator[Rig]:
    async with st.open_store(tmp_path / "state") as store:
        node = ScriptedNode(nursery)
        relay = Relay(node, window=8)
        node.relay = relay
        metrics = Metrics()
        cfg = GatewayConfig(retries=0, embedding_batch_window_s=0.05)
        meter = Meter(cfg, store, metrics)
        quotas = FakeQuotas()
        gateway = Gateway(
            cfg,
            models=FakeModels(),  # type: ignore[arg-type]
            deployments=FakeDeployments(),  # type: ignore[arg-type]
            relay=relay,
            quotas=quotas,  # type: ignore[arg-type]
            admission=Admission(cfg, metrics),
            router=Router(cfg),
            meter=meter,
        )
        await nursery.start(gateway.run)
        yield Rig(gateway=gateway, node=node, meter=meter, metrics=metrics, store=store, quotas=quotas)


def work(capability: Capability = Capability.CHAT, *, stream: bool = False, rid: str = "rid-1", **body: Any) -> Work:
    if not body:
        body = {"input": "alpha"} if capability is Capability.EMBEDDING else {"messages": MESSAGES}
    return Work(
        request_id=rid,
        api=Api.OPENAI,
        tenant=TenantId("acme"),
        key_id=KeyId("k1"),
        capability=capability,
        model="chat",
        body=body,
        stream=stream,
        include_usage=stream,
        deadline_at=time.time() + 30,
    )


async def run(rig: Rig, w: Work) -> tuple[bytes, RuntimeFailed | None, str]:
    """Call, read everything, leave: (output, the typed error it ended with, its status).

    A failure before any output (every batched embedding) is raised by entering the call itself."""
    call = rig.gateway.call(w)
    try:
        async with call as answer:
            out = await answer.read_all()
    except RuntimeFailed as exc:
        return b"", exc, exc.code
    assert answer.error is None or isinstance(answer.error, RuntimeFailed), answer.error
    assert call.outcome is not None
    return out, answer.error, call.outcome.status


# --- point 4: unary answers ---------------------------------------------------------------------------

GARBAGE_UNARY = {
    "html": b"<html><body>502 Bad Gateway</body></html>",
    "truncated": json.dumps(CHAT_ANSWER).encode()[:40],
    "empty": b"",
    "not an object": b"[1, 2, 3]",
    "choices of non-objects": json.dumps({"choices": ["a", 1]}).encode(),
    "no choices": json.dumps({"id": "x"}).encode(),
    "usage not an object": json.dumps({**CHAT_ANSWER, "usage": [1]}).encode(),
    "usage count a string": json.dumps({**CHAT_ANSWER, "usage": {"prompt_tokens": "7"}}).encode(),
    "usage count negative": json.dumps({**CHAT_ANSWER, "usage": {"completion_tokens": -1}}).encode(),
    "usage count beyond 2^31": json.dumps({**CHAT_ANSWER, "usage": {"prompt_tokens": 2**31 + 1}}).encode(),
    "usage count beyond 2^63": json.dumps({**CHAT_ANSWER, "usage": {"prompt_tokens": 2**64}}).encode(),
    "NaN": b'{"choices": [], "x": NaN}',
    "deep nesting": b"[" * 100_000 + b"]" * 100_000,
    "5000-digit integer": b'{"choices": [], "x": ' + b"9" * 5000 + b"}",
    "not UTF-8": b'{"choices": [], "x": "\xff\xfe"}',
}


@pytest.mark.parametrize("body", GARBAGE_UNARY.values(), ids=GARBAGE_UNARY.keys())
async def test_a_unary_answer_that_is_not_the_expected_json_fails_with_runtime_failed(rig: Rig, body: bytes) -> None:
    rig.node.script = lambda head, _: [*chunks(body), end(prompt_tokens=6, completion_tokens=2)]
    out, error, status = await run(rig, work())
    assert out == b"" and error is not None and error.code == "runtime_failed"
    assert status == "runtime_failed"
    assert rig.sample("nexa_gateway_invalid_answers_total", kind="unary") == 1
    [(_, stored_status, _, _)] = await rig.rows()  # metered, as failed
    assert stored_status == "runtime_failed"


async def test_a_good_unary_answer_passes_untouched_in_pieces(rig: Rig) -> None:
    raw = json.dumps(CHAT_ANSWER).encode()
    rig.node.script = lambda head, _: [chunk(raw[:10]), chunk(raw[10:]), end(prompt_tokens=6, completion_tokens=2)]
    out, error, status = await run(rig, work())
    assert out == raw and error is None and status == "ok"
    assert await rig.rows() == [("rid-1", "ok", 6, 2)]


# --- point 4: stream events ---------------------------------------------------------------------------

GARBAGE_EVENTS = {
    "html": b"<html><body>502 Bad Gateway</body></html>\n\n",
    "truncated": b'data: {"id": "c", "choices": [{"delta": {"cont\n\n',
    "data of a list": b"data: [1, 2, 3]\n\n",
    "choices of non-objects": event({"choices": [1]}),
    "no choices": event({"id": "c"}),
    "usage count beyond 2^63": event({"choices": [], "usage": {"prompt_tokens": 2**64}}),
    "usage negative": event({"choices": [], "usage": {"completion_tokens": -3}}),
    "NaN": b'data: {"choices": [], "x": NaN}\n\n',
    # What the compiled decoder (`answers.event_json`) refuses as the strict one does.
    "not UTF-8": b'data: {"choices": [], "x": "\xff\xfe"}\n\n',
    "lone surrogate": b'data: {"choices": [], "x": "\\ud800"}\n\n',
    "Infinity": b'data: {"choices": [], "x": -Infinity}\n\n',
    "deep nesting": b'data: {"choices": [], "x": ' + b"[" * 10_000 + b"]" * 10_000 + b"}\n\n",
}


@pytest.mark.parametrize("bad", GARBAGE_EVENTS.values(), ids=GARBAGE_EVENTS.keys())
async def test_a_stream_event_that_is_not_the_expected_json_ends_the_stream_with_runtime_failed(
    rig: Rig, bad: bytes
) -> None:
    # No `end`: the runtime is still at work when its stream turns bad.
    rig.node.script = lambda head, _: [chunk(delta("one")), chunk(delta(" two") + bad + delta(" three"))]
    call = rig.gateway.call(work(stream=True))
    async with call as answer:
        out = await answer.read_all()
    # What came before the bad event reached the client; nothing after it did.
    assert out == delta("one") + delta(" two")
    assert isinstance(answer.error, RuntimeFailed)
    assert call.outcome is not None and call.outcome.status == "runtime_failed"
    assert rig.sample("nexa_gateway_invalid_answers_total", kind="stream") == 1
    assert rig.node.cancels == rig.node.stream_ids  # the rest is cancelled at the node
    [(_, status, _, completion)] = await rig.rows()
    assert status == "runtime_failed" and completion == 2  # the events streamed, one token each


async def test_stream_events_split_over_chunks_are_joined_and_passed_on(rig: Rig) -> None:
    whole = delta("one") + delta(" two") + event({"choices": [], "usage": {"prompt_tokens": 6}}) + DONE
    pieces = [whole[i : i + 7] for i in range(0, len(whole), 7)]
    rig.node.script = lambda head, _: [*map(chunk, pieces), end(prompt_tokens=6, completion_tokens=2)]
    out, error, status = await run(rig, work(stream=True))
    assert out == whole and error is None and status == "ok"
    assert await rig.rows() == [("rid-1", "ok", 6, 2)]


# --- point 4: embedding batches -----------------------------------------------------------------------


def embeddings(n: int, **changes: Any) -> str:
    data = [{"object": "embedding", "index": i, "embedding": [0.1 * i, 0.2]} for i in range(n)]
    return json.dumps({"object": "list", "data": data, "usage": {"prompt_tokens": n, "total_tokens": n}, **changes})


GARBAGE_BATCHES: dict[str, Callable[[int], bytes | str]] = {
    "html": lambda n: b"<html><body>oops</body></html>",
    "truncated": lambda n: embeddings(n)[:30],
    "data of non-objects": lambda n: json.dumps({"data": list(range(n))}),
    "data not a list": lambda n: json.dumps({"data": {"0": [1.0]}}),
    "embedding missing": lambda n: json.dumps({"data": [{"index": i} for i in range(n)]}),
    "too few": lambda n: embeddings(n - 1),
    "duplicate indexes": lambda n: json.dumps({"data": [{"index": 0, "embedding": [1.0]} for _ in range(n)]}),
    "index a string": lambda n: json.dumps({"data": [{"index": str(i), "embedding": [1.0]} for i in range(n)]}),
    "usage beyond 2^63": lambda n: embeddings(n, usage={"prompt_tokens": 2**64}),
    "usage negative": lambda n: embeddings(n, usage={"prompt_tokens": -1}),
}


async def embed_all(rig: Rig, count: int) -> list[tuple[bytes, RuntimeFailed | None, str]]:
    results: list[tuple[bytes, RuntimeFailed | None, str]] = []

    async def one(i: int) -> None:
        results.append(await run(rig, work(Capability.EMBEDDING, rid=f"e{i}", input=f"text {i}")))

    async with trio.open_nursery() as n:
        for i in range(count):
            n.start_soon(one, i)
    return results


@pytest.mark.parametrize("answer", GARBAGE_BATCHES.values(), ids=GARBAGE_BATCHES.keys())
async def test_a_batch_answer_that_is_not_the_expected_json_fails_every_caller_and_the_gateway_goes_on(
    rig: Rig, answer: Callable[[int], bytes | str]
) -> None:
    def script(head: wire.InferHead, body: bytes) -> list[Frame]:
        raw = answer(len(json.loads(body)["input"]))
        return [chunk(raw.encode() if isinstance(raw, str) else raw), end(prompt_tokens=3)]

    rig.node.script = script
    results = await embed_all(rig, 5)
    assert len(rig.node.stream_ids) == 1  # one batch for the five callers
    assert len(results) == 5
    for out, error, status in results:
        assert out == b"" and error is not None and status == "runtime_failed"
    assert (
        rig.sample("nexa_gateway_invalid_answers_total", kind="batch")
        + rig.sample("nexa_gateway_invalid_answers_total", kind="unary")
        <= 1
    )  # counted once for the batch (a count mismatch is refused after the shape check)
    # Nothing escaped into the gateway's nursery: the next batch, answered well, is served.
    rig.node.script = lambda head, body: [chunk(embeddings(len(json.loads(body)["input"])).encode()), end()]
    again = await embed_all(rig, 3)
    assert sorted(status for _, _, status in again) == ["ok"] * 3
    for out, _, _ in again:
        answer_obj = json.loads(out)
        assert [d["index"] for d in answer_obj["data"]] == [0]


# --- point 3: token counts from the node ---------------------------------------------------------------


@pytest.mark.parametrize("count", [2**63, 2**64, -1, -(2**63), 2**31 + 1])
async def test_a_node_reporting_tokens_out_of_range_is_metered_with_the_controllers_estimate(
    rig: Rig, count: int
) -> None:
    """Defence in depth: the `end` goes through the relay as written; whatever the wire contract
    makes of it, no figure out of 0..2^31 reaches quotas or the store, and the call is metered."""
    raw = json.dumps(CHAT_ANSWER).encode()
    rig.node.script = lambda head, _: [chunk(raw), end(prompt_tokens=count, completion_tokens=count)]
    out, error, status = await run(rig, work())
    [(rid, stored_status, prompt, completion)] = await rig.rows()
    assert rid == "rid-1" and stored_status == status
    assert 0 <= prompt <= MAX_TOKEN_COUNT and 0 <= completion <= MAX_TOKEN_COUNT
    assert all(0 <= t <= 2 * MAX_TOKEN_COUNT for t in rig.quotas.settled)
    if error is None:  # the contract let it through: the gateway refused it itself
        assert out == raw
        assert (prompt, completion) == (6, 2)  # the prompt's estimate, the answer's own usage
        assert rig.sample("nexa_usage_records_refused_total", reason="tokens_out_of_range") == 2


async def test_usage_above_what_the_request_allows_is_clamped_and_counted(rig: Rig) -> None:
    """Issue 30 point 3: 2^31 completion tokens against `max_tokens: 1`, and a prompt count no
    tokenizer could make of the prompt, bill (and take from the quota) only what the request allows."""
    raw = json.dumps(CHAT_ANSWER).encode()
    rig.node.script = lambda head, _: [chunk(raw), end(prompt_tokens=2**31, completion_tokens=2**31)]
    out, error, _ = await run(rig, work(messages=MESSAGES, max_tokens=1))
    assert error is None and out == raw
    [(_, _, prompt, completion)] = await rig.rows()
    prompt_max, completion_max = usage_bounds(Capability.CHAT, {"messages": MESSAGES, "max_tokens": 1})
    assert (prompt, completion) == (prompt_max, 1) and completion_max == 1
    assert prompt_max < 2_000  # a few hundred bytes of prompt, not 2^31
    assert all(t <= prompt_max + 1 for t in rig.quotas.settled)
    assert rig.sample("nexa_usage_records_refused_total", reason="tokens_over_request") == 2


async def test_counts_the_wire_contract_let_through_are_still_refused_by_the_gateway(rig: Rig) -> None:
    """The gateway's own check, with the contract's validators off (as if it let anything pass)."""
    raw = json.dumps(CHAT_ANSWER).encode()

    def script(head: wire.InferHead, body: bytes) -> list[Frame]:
        return [chunk(raw)]

    rig.node.script = script
    call = rig.gateway.call(work())
    async with call as answer:
        with attrs.validators.disabled():
            bad_end = wire.EndHead(status=wire.EndStatus.OK, prompt_tokens=2**64, completion_tokens=-5)
        stream = answer._stream
        assert stream is not None
        stream._finish(bad_end)  # what the relay files once it parsed the node's end
        assert await answer.read_all() == raw
    assert answer.error is None
    assert call.outcome is not None
    assert (call.outcome.prompt_tokens, call.outcome.completion_tokens) == (6, 2)
    assert rig.sample("nexa_usage_records_refused_total", reason="tokens_out_of_range") == 2
    assert await rig.rows() == [("rid-1", "ok", 6, 2)]


# --- point 6: multiplex ids -----------------------------------------------------------------------------


async def test_the_relay_is_keyed_by_ids_the_controller_makes_not_the_clients(rig: Rig) -> None:
    raw = json.dumps(CHAT_ANSWER).encode()
    rig.node.gate = trio.Event()
    rig.node.script = lambda head, _: [chunk(raw), end(prompt_tokens=6, completion_tokens=2)]
    results: list[tuple[bytes, RuntimeFailed | None, str]] = []

    async def one() -> None:
        results.append(await run(rig, work(rid="same-id")))

    async with trio.open_nursery() as n:
        n.start_soon(one)
        n.start_soon(one)
        with trio.fail_after(5):
            while len(rig.node.stream_ids) < 2:  # noqa: ASYNC110 - both are open at the node at once
                await trio.sleep(0.001)
        rig.node.gate.set()
    assert [r[2] for r in results] == ["ok", "ok"]
    first, second = rig.node.stream_ids
    assert first != second and "same-id" not in (first, second)
    assert [r[0] for r in await rig.rows()] == ["same-id", "same-id"]  # the client's id is what is metered


def test_the_prefix_affinity_key_holds_the_tenant() -> None:
    """Issue 30 point 14: one prompt from two tenants gives two affinity keys, so one tenant's requests
    are never steered to the replica holding another's prompt in its prefix cache."""
    from nexa.control.datapath.affinity import affinity_key

    cfg = GatewayConfig(prefix_affinity=True)
    mine = work(messages=MESSAGES)
    theirs = attrs.evolve(mine, tenant=TenantId("globex"))
    assert affinity_key(mine, cfg) != affinity_key(theirs, cfg)
    assert affinity_key(mine, cfg) == affinity_key(work(messages=MESSAGES, rid="rid-2"), cfg)  # stable per tenant
    assert affinity_key(work(Capability.EMBEDDING), cfg) is None
    # A LoRA adapter's alias: keyed by it (and the tenant), whatever the prompt, so its requests go
    # where it is loaded already; off with affinity.
    other = work(messages=[{"role": "user", "content": "something else entirely"}], rid="rid-3")
    assert (
        affinity_key(mine, cfg, lora="poet")
        == affinity_key(other, cfg, lora="poet")
        != affinity_key(mine, cfg, lora="coder")
    )
    assert affinity_key(mine, cfg, lora="poet") != affinity_key(theirs, cfg, lora="poet")
    assert affinity_key(mine, GatewayConfig(prefix_affinity=False), lora="poet") is None
