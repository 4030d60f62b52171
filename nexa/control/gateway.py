"""The inference pipeline both northbound APIs share: resolve → quota → admission → route → relay → meter.

`Gateway.call(work)` resolves the requested alias to the model version it points at and the
replicas serving it (`Deployments.serving`: Ready replicas on Ready or Cordoned nodes, canary
share included), refuses at once when none is Ready (`NoReadyReplica`), takes the tenant's quota
ticket, waits for an admission slot of the model (priority classes, fair between tenants, the
deadline covering queue time), then picks a replica (`Router`: least outstanding, prefix
affinity, canary weight) and opens a relay stream to it over the node's channel. A failure
before the first output byte (runtime unavailable or failing, node busy or lost) is retried on
another replica, at most `gateway.retries` times; after the first byte the call ends with a
typed error instead. The returned `Call` is iterated for output bytes (runtime SSE events or the
unary body, passed through untouched) and closed with `aclose()`, which releases slot and
replica, settles the quota with the tokens used and records one usage record — also when the
client went away (its cancellation reaches the runtime through the relay's `cancel`).

Embedding requests with plain text input are batched: those for the same model arriving within
`embedding_batch_window_s` (up to `embedding_max_batch` inputs) become one runtime call, run by
the gateway's own nursery, and each caller gets its slice back re-indexed. The runtime reports
one `usage` for the batch; each caller is charged a share proportional to the characters of its
inputs (the last one gets the rounding remainder).

Nothing here reads or logs a payload beyond what routing needs (the prompt prefix, hashed for
affinity, and embedding inputs while they are being batched); no payload is ever stored.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Final, NoReturn

import attrs
import trio

from nexa.config import GatewayConfig
from nexa.contracts import wire
from nexa.contracts.deployments import ServingReplica, ServingSet
from nexa.contracts.domain import KeyId, TenantId
from nexa.contracts.gateway import UNRESOLVED_MODEL, Api, Capability, Priority, UsageRecord, token_reservation
from nexa.contracts.models import ModelRef
from nexa.control import answers
from nexa.control.admission import Admission
from nexa.control.deployments import Deployments
from nexa.control.metering import REFUSED_TOKENS, Meter, token_count_ok
from nexa.control.models import ModelRegistry
from nexa.control.quotas import Quotas, QuotaTicket
from nexa.control.relay import Relay, RelayStream
from nexa.control.routing import Router, for_data_class
from nexa.errors import (
    Cancelled,
    ChannelError,
    DeadlineExceeded,
    ModelNotServed,
    NexaError,
    NoReadyReplica,
    NoReplicaForDataClass,
    RuntimeFailed,
    RuntimeRejected,
)

log = logging.getLogger(__name__)

#: End codes after which another replica may get the request (when no output byte was sent yet).
RETRYABLE_END_CODES: Final = frozenset(
    {"runtime_unavailable", "runtime_error", "node_busy", "node_lost", "unknown_assignment"}
)
#: After a stream's `[DONE]`, how long a call whose client left waits for the `end` with the usage.
_TAIL_S: Final = 1.0
#: Longest single SSE event of a stream held while its end arrives (events are whole in a chunk
#: unless larger than the node's `max_chunk_bytes`); a longer one fails the stream.
MAX_EVENT_BYTES: Final = 4 * 1024 * 1024
#: `nexa_gateway_invalid_answers_total` kinds.
UNARY: Final = "unary"
STREAM: Final = "stream"
BATCH: Final = "batch"


@attrs.frozen(kw_only=True)
class Work:
    """One inference request, whichever API it came through. The tenant comes from the key."""

    request_id: str
    api: Api
    tenant: TenantId
    key_id: KeyId
    capability: Capability
    #: An alias, or `name:version` of a model version being served.
    model: str
    #: The OpenAI-shaped body for the runtime, without `model` and `stream`.
    body: dict[str, Any]
    stream: bool
    #: The client asked for usage in its stream (`stream_options.include_usage`).
    include_usage: bool = False
    priority: Priority = Priority.STANDARD
    #: Wall-clock Unix seconds.
    deadline_at: float
    workload_id: str | None = None
    #: Only replicas on nodes whose inventory allows this data class serve it; None: any.
    data_class: str | None = None


@attrs.define(kw_only=True)
class Outcome:
    """What happened to a call, filled in as it goes; the usage record and receipts are made from it."""

    alias: str = ""
    model: ModelRef | None = None
    deployment: str = ""
    node_id: str = ""
    canary: bool = False
    #: `ok`, or the error code the call ended with.
    status: str = "ok"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    accepted_at: float = attrs.Factory(time.time)
    queue_ms: float = 0.0
    ttft_ms: float | None = None
    duration_ms: float = 0.0
    finished_at: float = 0.0
    attempts: int = 0


@attrs.frozen(kw_only=True)
class ServedModel:
    """`GET /v1/models`: an alias (or pinned version) with at least one deployment."""

    id: str
    created: float


class Call:
    """An admitted request with a replica's first output in hand: iterate for bytes, then `aclose()`.

    After iteration `error` holds the typed error the stream ended with (after the first byte), or None.
    A unary answer comes as one piece once whole, checked to be the JSON object its capability
    answers with (`answer` then holds it parsed); a stream as whole SSE events, each checked. An
    answer that is not what it should be ends the call with RuntimeFailed (`error`), never passes.
    """

    def __init__(self, gateway: Gateway, work: Work, outcome: Outcome, started: float) -> None:
        self._gateway = gateway
        self.work = work
        self.outcome = outcome
        self._started = started
        self._stack = contextlib.AsyncExitStack()
        self._stream: RelayStream | None = None
        self._pending: list[bytes] = []
        self._replica: ServingReplica | None = None
        self._ticket: QuotaTicket | None = None
        self._closed = False
        self._events = 0
        self._done_seen = False
        #: The start of an SSE event whose end is still to come (streams).
        self._rest = b""
        #: The unary answer was handed out (or refused): iteration is over.
        self._unary_taken = False
        #: The unary body is one the gateway made itself (a slice of an embeddings batch).
        self._trusted = False
        #: The node's completion count was refused: the controller estimates it.
        self._usage_refused = False
        #: What `nexa_gateway_invalid_answers_total` counts this call's answer as.
        self.kind = STREAM if work.stream else UNARY
        #: The unary answer, parsed (once iteration is over and it was valid).
        self.answer: dict[str, Any] | None = None
        self.error: NexaError | None = None

    def __aiter__(self) -> Call:
        return self

    async def __anext__(self) -> bytes:
        if not self.work.stream:
            return await self._next_unary()
        while True:
            try:
                chunk = await self._next()
            except StopAsyncIteration:
                rest, self._rest = self._rest, b""
                last = self._checked_events([rest]) if rest else b""  # a last event without its blank line
                if last:
                    return last
                raise
            events, self._rest = answers.split_events(self._rest + chunk)
            if len(self._rest) > MAX_EVENT_BYTES:
                self._refuse(f"an event longer than {MAX_EVENT_BYTES} bytes")
                events = []
            out = self._checked_events(events)
            if out:
                return out
            if self._stream is None and not self._pending:
                raise StopAsyncIteration

    def _checked_events(self, events: list[bytes]) -> bytes:
        """The events up to the first one that is not a valid stream event (which ends the call)."""
        kept = []
        for event in events:
            problem, done = answers.event_problem(event)
            if problem is not None:
                self._refuse(problem)
                break
            if done:
                self._done_seen = True
            elif b"data:" in event:
                # Streamed events seen, for when the stream ends without the runtime's usage (node lost).
                self._events += 1
            kept.append(event)
        return b"".join(kept)

    async def _next_unary(self) -> bytes:
        if self._unary_taken:
            raise StopAsyncIteration
        self._unary_taken = True
        parts = []
        while True:
            try:
                parts.append(await self._next())
            except StopAsyncIteration:
                break
        body = b"".join(parts)
        if self.error is not None:
            raise StopAsyncIteration
        if not self._trusted:
            answer, problem = answers.unary_answer(body, self.work.capability)
            if answer is None:
                self._refuse(problem)
                raise StopAsyncIteration
            self.answer = answer
            if self._usage_refused:
                self.outcome.completion_tokens = answers.completion_estimate(answer)
        return body

    def _refuse(self, problem: str) -> None:
        """End the call with RuntimeFailed: the runtime's answer is not what the API promises.
        Leaving the relay stream (at `aclose`) cancels the rest at the node."""
        self._stream = None
        self._pending.clear()
        self._rest = b""
        self._gateway._meter.invalid_answer(self.kind)
        log.warning("request %s: the runtime's %s answer is unusable: %s", self.work.request_id, self.kind, problem)
        if self.error is None:
            self.error = RuntimeFailed(f"the runtime's answer is unusable ({problem})")
            self.outcome.status = self.error.code

    async def _next(self) -> bytes:
        if self._pending:
            return self._pending.pop()
        stream = self._stream
        if stream is None:
            raise StopAsyncIteration
        # The relay ends the stream itself (deadline_exceeded) when the node stays silent past the deadline.
        chunk = await stream.receive_all()
        if chunk is not None:
            return chunk
        self._finish_stream(stream.end, None)
        raise StopAsyncIteration

    async def read_all(self) -> bytes:
        return b"".join([chunk async for chunk in self])

    def _finish_stream(self, end: wire.EndHead | None, error: NexaError | None) -> None:
        self._stream = None
        if end is not None:
            self._take_usage(end)
            if end.status is not wire.EndStatus.OK:
                error = _end_error(end)
        if error is not None:
            self.error = error
            self.outcome.status = error.code

    def _take_usage(self, end: wire.EndHead) -> None:
        """The node's token counts, checked again where they enter the controller (whatever the wire
        contract let through). A count that is not a whole number in 0..2^31 is never used: it is
        counted (`nexa_usage_records_refused_total{reason="tokens_out_of_range"}`), logged by
        request id, and replaced by the controller's own estimate: about four characters a token of
        the prompt; for the completion, the streamed events (one a token, at `aclose`), or the
        unary answer's own `usage` (checked) or four characters a token of its text."""
        prompt, completion = end.prompt_tokens, end.completion_tokens
        refused = []
        if prompt is not None:
            if token_count_ok(prompt):
                self.outcome.prompt_tokens = prompt
            else:
                refused.append("prompt_tokens")
                self.outcome.prompt_tokens = _prompt_estimate(self.work)
        if completion is not None:
            if token_count_ok(completion):
                self.outcome.completion_tokens = completion
            else:
                refused.append("completion_tokens")
                self._usage_refused = True
                self.outcome.completion_tokens = 0
        for name in refused:
            self._gateway._meter.refused(REFUSED_TOKENS)
            log.warning(
                "request %s: node %s reported %s out of range; metered with the controller's estimate",
                self.work.request_id,
                self.outcome.node_id,
                name,
            )

    async def aclose(self) -> None:
        """Release everything and meter the call. Safe to call twice, and from a cancelled task."""
        if self._closed:
            return
        self._closed = True
        if self._stream is not None and self._done_seen:
            # The client had the whole answer and went away before the node's `end` (it often
            # closes right after `[DONE]`): wait briefly for the end, which carries the usage.
            stream, self._stream = self._stream, None
            with trio.CancelScope(shield=True), trio.move_on_after(_TAIL_S):
                while await stream.receive() is not None:
                    pass
            if stream.end is not None:
                self._finish_stream(stream.end, None)
        if self._stream is not None:
            # Left before the end: the client went away or the caller gave up. The relay cancels.
            self._stream = None
            if self.outcome.status == "ok":
                self.outcome.status = Cancelled.code
        with trio.CancelScope(shield=True):
            await self._stack.aclose()
        if self.outcome.completion_tokens == 0 and self._events:
            # No usage came back (the node was lost, or the client left): count what was streamed,
            # one token per event, as the runtime's own streams send them.
            self.outcome.completion_tokens = self._events
        self._gateway._settle(self, self._ticket)


class Gateway:
    """The one pipeline behind `/v1/*` and `/api/v1/workloads`. Runs a nursery for embedding batches."""

    def __init__(
        self,
        cfg: GatewayConfig,
        *,
        models: ModelRegistry,
        deployments: Deployments,
        relay: Relay,
        quotas: Quotas,
        admission: Admission,
        router: Router,
        meter: Meter,
    ) -> None:
        self._cfg = cfg
        self._models = models
        self._deployments = deployments
        self._relay = relay
        self._quotas = quotas
        self._admission = admission
        self._router = router
        self._meter = meter
        self._nursery: trio.Nursery | None = None
        self._batches: dict[tuple[str, str], _Batch] = {}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> NoReturn:
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            task_status.started()
            await trio.sleep_forever()
        raise AssertionError("unreachable")  # pragma: no cover

    # ---- what the HTTP layer calls -----------------------------------------------------------------

    def served_models(self) -> list[ServedModel]:
        """Aliases whose current version has a deployment (Ready or not), for `GET /v1/models`."""
        out = []
        for alias in self._models.aliases():
            if self._deployments.serving(alias.target, alias=alias.name).deployments:
                out.append(ServedModel(id=alias.name, created=alias.updated_at))
        return out

    def trio_deadline(self, work: Work) -> float:
        return trio.current_time() + (work.deadline_at - time.time())

    async def call(self, work: Work, *, admitted: Callable[[], Awaitable[None]] | None = None) -> Call:
        """Admit and start `work`; returns once a replica produced its first output (or ended).

        Raises before any output: ModelNotServed, NoReadyReplica (NoReplicaForDataClass),
        QuotaExceeded, QueueFull, DeadlineExceeded, RuntimeFailed (every attempt failed before
        its first byte), RuntimeRejected (the runtime refused the request itself). `admitted`,
        when given, is awaited once the request holds its admission slot, before it is routed
        (what must be durable about an admitted request is written there, and only there: a
        request refused before admission costs no store write). The caller must `aclose()` the
        Call it gets, and on an exception nothing is left to release (usage is still recorded).
        """
        started = trio.current_time()
        outcome = Outcome()
        call = Call(self, work, outcome, started)
        try:
            await self._start(call, admitted)
        except BaseException as exc:
            if isinstance(exc, NexaError):
                outcome.status = exc.code
            elif isinstance(exc, trio.Cancelled):
                outcome.status = Cancelled.code
            await call.aclose()
            raise
        return call

    # ---- the pipeline ------------------------------------------------------------------------------

    def _resolve(self, name: str) -> tuple[str, ModelRef]:
        model_name, sep, version = name.partition(":")
        try:
            if sep:
                record = self._models.model(model_name, version)
                return "", ModelRef(model=record.name, version=record.version)
            record = self._models.resolve(name)
        except NexaError:  # NotFound, or an alias pointing at a version no longer Approved
            raise ModelNotServed(f"no model or alias {name!r} is served here") from None
        return name, ModelRef(model=record.name, version=record.version)

    async def _start(self, call: Call, admitted: Callable[[], Awaitable[None]] | None) -> None:
        work, outcome = call.work, call.outcome
        outcome.alias, ref = self._resolve(work.model)
        outcome.model = ref
        serving = self._deployments.serving(ref, alias=outcome.alias or None)
        if not serving.deployments:
            raise ModelNotServed(f"{work.model!r} has no deployment")
        model_key = outcome.alias or ref.key
        self._admission.set_capacity(model_key, len(serving.replicas) * self._cfg.max_inflight_per_replica)
        if not serving.replicas:
            raise NoReadyReplica(f"no replica of {work.model!r} is Ready now")
        serving = self._for_data_class(work, serving)
        if time.time() >= work.deadline_at:
            raise DeadlineExceeded("the request's deadline has already passed")
        reserve = token_reservation(work.capability, work.body, default_completion=self._cfg.reserve_completion_tokens)
        call._ticket = self._quotas.admit(work.tenant, time.time(), reserve_tokens=reserve)
        queued_s = await call._stack.enter_async_context(
            self._admission.slot(model_key, work.tenant, work.priority, self.trio_deadline(work))
        )
        outcome.queue_ms = queued_s * 1000.0
        if queued_s:
            # Replicas may have come or gone while it waited: route by the fleet as it is now.
            serving = self._deployments.serving(ref, alias=outcome.alias or None)
            if not serving.replicas:
                raise NoReadyReplica(f"no replica of {work.model!r} is Ready now")
            serving = self._for_data_class(work, serving)
        if admitted is not None:
            await admitted()
        if work.capability is Capability.EMBEDDING and (inputs := _batchable_inputs(work.body)) is not None:
            await self._embed_batched(call, serving, inputs)
            return
        await self._open(call, serving, _encode(work, serving))

    def _for_data_class(self, work: Work, serving: ServingSet) -> ServingSet:
        """The replicas allowed the request's data class; NoReplicaForDataClass when none is."""
        if work.data_class is None:
            return serving
        allowed = for_data_class(serving, work.data_class, self._deployments.node_data_classes)
        if not allowed.replicas:
            raise NoReplicaForDataClass(
                f"no Ready replica of {work.model!r} is on a node allowed data class {work.data_class}",
                data_class=work.data_class,
            )
        return allowed

    async def _open(self, call: Call, serving: ServingSet, body: bytes) -> None:
        """Try replicas until one produces a first chunk (or ends cleanly); keep its stream open in the call."""
        work, outcome = call.work, call.outcome
        tried: set[str] = set()
        last: NexaError | None = None
        for attempt in range(1 + self._cfg.retries):
            replica = self._router.choose(serving, prefix=_prefix(work, self._cfg), exclude=tried)
            if replica is None:
                break
            tried.add(replica.replica_id)
            outcome.attempts = attempt + 1
            stream_id = _new_stream_id(work, replica, attempt)
            head = wire.InferHead(
                assignment_id=replica.replica_id,
                path=work.capability.path,
                stream=work.stream,
                deadline_at=work.deadline_at,
                window=self._cfg.stream_window_chunks,
                strip_usage_chunk=work.stream and not work.include_usage,
                prompt_tokens_estimate=_prompt_estimate(work),
            )
            stack = contextlib.AsyncExitStack()
            attempt_started = trio.current_time()
            self._router.acquire(replica.replica_id)
            stack.callback(self._router.release, replica.replica_id)
            try:
                stream = await stack.enter_async_context(self._relay.open(replica.node_id, stream_id, head, body))
                first = await self._first(stream)
            except ChannelError:
                # No route to the node right now: nothing was sent; try another replica.
                with trio.CancelScope(shield=True):
                    await stack.aclose()
                last = RuntimeFailed("the node serving the replica is not connected")
                continue
            except BaseException:
                with trio.CancelScope(shield=True):
                    await stack.aclose()
                raise
            end = stream.end
            if first is None and end is not None and end.status is not wire.EndStatus.OK:
                with trio.CancelScope(shield=True):
                    await stack.aclose()
                error = _end_error(end)
                self._meter.attempt_failed(
                    replica.deployment,
                    canary=replica.canary,
                    duration_ms=(trio.current_time() - attempt_started) * 1000.0,
                    now=time.time(),
                )
                if end.code in RETRYABLE_END_CODES and not end.first_byte_sent:
                    log.info("attempt %d failed before output (%s); retrying elsewhere", attempt + 1, end.code)
                    last = error
                    continue
                raise error
            # Committed to this replica.
            outcome.deployment, outcome.node_id, outcome.canary = replica.deployment, replica.node_id, replica.canary
            outcome.model = replica.model
            call._replica = replica
            call._stack.push_async_exit(stack)
            if first is not None:
                outcome.ttft_ms = (trio.current_time() - call._started) * 1000.0
                call._pending.append(first)
                call._stream = stream
            elif end is not None:
                call._take_usage(end)
            return
        raise last or NoReadyReplica(f"no Ready replica of {work.model!r} is left to try")

    @staticmethod
    async def _first(stream: RelayStream) -> bytes | None:
        # Bounded by the relay: past the deadline it ends the stream with deadline_exceeded.
        return await stream.receive_all()

    def _settle(self, call: Call, ticket: QuotaTicket | None) -> None:
        """Quota, metering and the outcome's timings, once per call (from `Call.aclose`)."""
        outcome, work = call.outcome, call.work
        now = time.time()
        outcome.finished_at = now
        outcome.duration_ms = (trio.current_time() - call._started) * 1000.0
        if ticket is not None:
            self._quotas.finish(ticket, outcome.prompt_tokens + outcome.completion_tokens, now)
        ref = outcome.model
        self._meter.record(
            UsageRecord(
                request_id=work.request_id,
                workload_id=work.workload_id,
                api=work.api,
                tenant=work.tenant,
                key_id=work.key_id,
                capability=work.capability,
                # A name that never resolved is the client's free text: not stored (a marker instead).
                alias=outcome.alias if ref else UNRESOLVED_MODEL,
                model=ref.model if ref else "",
                model_version=ref.version if ref else "",
                deployment=outcome.deployment,
                node_id=outcome.node_id,
                status=outcome.status,
                prompt_tokens=outcome.prompt_tokens,
                completion_tokens=outcome.completion_tokens,
                queue_ms=outcome.queue_ms,
                ttft_ms=outcome.ttft_ms,
                duration_ms=outcome.duration_ms,
                finished_at=now,
                canary=outcome.canary,
            )
        )

    # ---- embedding batches -------------------------------------------------------------------------

    async def _embed_batched(self, call: Call, serving: ServingSet, inputs: list[str]) -> None:
        work = call.work
        params = {k: v for k, v in work.body.items() if k != "input"}
        key = (call.outcome.alias or serving.model.key, json.dumps(params, sort_keys=True))
        item = _Item(inputs=inputs, deadline=self.trio_deadline(work))
        batch = self._batches.get(key)
        if batch is None or batch.closed or batch.size + len(inputs) > self._cfg.embedding_max_batch:
            batch = _Batch(params=params, serving=serving, work=work)
            self._batches[key] = batch
            self._spawn(self._run_batch, key, batch)
        batch.add(item)
        if batch.size >= self._cfg.embedding_max_batch:
            batch.full.set()
        try:
            await item.done.wait()
        except BaseException:
            item.abandoned = True
            raise
        if item.error is not None:
            raise item.error
        outcome = call.outcome
        outcome.deployment, outcome.node_id, outcome.canary = item.deployment, item.node_id, item.canary
        outcome.model = item.model or outcome.model
        outcome.prompt_tokens = item.prompt_tokens
        outcome.ttft_ms = (trio.current_time() - call._started) * 1000.0
        call._trusted = True  # the slice was made here from a batch answer that was checked
        call._pending.append(item.body)

    def _spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._nursery is None:
            raise RuntimeError("Gateway.run is not running")
        self._nursery.start_soon(fn, *args)

    async def _run_batch(self, key: tuple[str, str], batch: _Batch) -> None:
        with trio.move_on_after(self._cfg.embedding_batch_window_s):
            await batch.full.wait()
        batch.closed = True
        if self._batches.get(key) is batch:
            del self._batches[key]
        live = [i for i in batch.items if not i.abandoned]
        if not live:
            return
        all_inputs = [text for i in live for text in i.inputs]
        deadline_at = time.time() + max(0.0, min(i.deadline for i in live) - trio.current_time())
        work = attrs.evolve(
            batch.work, body={**batch.params, "input": all_inputs}, stream=False, deadline_at=deadline_at
        )
        inner = Call(self, work, Outcome(), trio.current_time())
        inner.kind = BATCH
        error: NexaError | None = None
        try:
            await self._open(inner, batch.serving, _encode(work, batch.serving))
            await inner.read_all()  # checks the answer's shape: `inner.answer`, or `inner.error`
            if inner.error is not None:
                error = inner.error
            elif inner.answer is not None:
                _split_embeddings(inner.answer, live, inner.outcome)
        except NexaError as exc:
            error = exc
        except Exception as exc:
            # Last resort: this task runs in the gateway's own nursery, where anything escaping
            # would end the gateway; and its callers wait for `done`. The type only: an exception's
            # message could quote the answer.
            log.error("an embedding batch of %d inputs failed: %s", len(all_inputs), type(exc).__name__)  # noqa: TRY400
            error = RuntimeFailed("the embedding batch failed")
        finally:
            with trio.CancelScope(shield=True):
                await inner._stack.aclose()
            for i in live:
                if error is not None:
                    i.error = error
                elif not i.body:  # never released with neither an answer nor an error
                    i.error = RuntimeFailed("the runtime's answer to the batch had nothing for this request")
                i.done.set()


@attrs.define(kw_only=True, eq=False)
class _Item:
    inputs: list[str]
    deadline: float
    done: trio.Event = attrs.Factory(trio.Event)
    abandoned: bool = False
    error: NexaError | None = None
    body: bytes = b""
    prompt_tokens: int = 0
    deployment: str = ""
    node_id: str = ""
    canary: bool = False
    model: ModelRef | None = None


@attrs.define(kw_only=True, eq=False)
class _Batch:
    params: dict[str, Any]
    serving: ServingSet
    work: Work
    items: list[_Item] = attrs.Factory(list)
    size: int = 0
    closed: bool = False
    full: trio.Event = attrs.Factory(trio.Event)

    def add(self, item: _Item) -> None:
        self.items.append(item)
        self.size += len(item.inputs)


def _split_embeddings(answer: dict[str, Any], items: list[_Item], outcome: Outcome) -> None:
    """Give each item its slice of the runtime's `data`, re-indexed from 0, and its share of usage.

    `answer` passed `answers.unary_answer` (an object, `data` a list of embedding objects, `usage` sane);
    RuntimeFailed when its embeddings do not map one to one onto the inputs."""
    data: list[dict[str, Any]] = answer["data"]
    total_inputs = sum(len(i.inputs) for i in items)
    if len(data) != total_inputs:
        raise RuntimeFailed(f"the runtime returned {len(data)} embeddings for {total_inputs} inputs")
    indexes: list[Any] = [d.get("index") for d in data]
    if any(i is not None for i in indexes):
        if not all(type(i) is int for i in indexes) or sorted(indexes) != list(range(total_inputs)):
            raise RuntimeFailed("the runtime's embedding indexes are not 0 to n-1, each once")
        data = sorted(data, key=lambda d: int(d["index"]))
    usage = answer.get("usage") or {}
    prompt_total = int(usage.get("prompt_tokens") or 0)
    weights = [sum(len(t) for t in i.inputs) or 1 for i in items]
    weight_sum = sum(weights)
    given = 0
    offset = 0
    for n, (item, weight) in enumerate(zip(items, weights, strict=True)):
        share = prompt_total - given if n == len(items) - 1 else math.floor(prompt_total * weight / weight_sum)
        given += share
        mine = [dict(d, index=k) for k, d in enumerate(data[offset : offset + len(item.inputs)])]
        offset += len(item.inputs)
        body = dict(answer, data=mine, usage={"prompt_tokens": share, "total_tokens": share})
        item.body = json.dumps(body, separators=(",", ":")).encode()
        item.prompt_tokens = share
        item.deployment, item.node_id, item.canary = outcome.deployment, outcome.node_id, outcome.canary
        item.model = outcome.model


def _batchable_inputs(body: dict[str, Any]) -> list[str] | None:
    value = body.get("input")
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value):
        return list(value)
    return None


def _new_stream_id(work: Work, replica: ServingReplica, attempt: int) -> str:
    """The relay's multiplex key for one attempt, made here: never the client's X-Request-Id, which
    two clients (or tenants) may both send, and which must not let either collide with or reach
    the other's stream. The client's id goes only into this log line and the log context."""
    stream_id = uuid.uuid4().hex
    log.debug(
        "attempt %d of request %s on replica %s of node %s: stream %s",
        attempt + 1,
        work.request_id,
        replica.replica_id,
        replica.node_id,
        stream_id,
    )
    return stream_id


def _encode(work: Work, serving: ServingSet) -> bytes:
    """The runtime's request body: the client's, with the served model's name, and usage always
    asked for in streams (stripped again on the node when the client did not ask)."""
    body: dict[str, Any] = dict(work.body)
    body["model"] = serving.model.model
    if work.capability is not Capability.EMBEDDING:
        body["stream"] = work.stream
        if work.stream:
            options = dict(body.get("stream_options") or {})
            options["include_usage"] = True
            body["stream_options"] = options
    return json.dumps(body, separators=(",", ":")).encode()


def _prefix(work: Work, cfg: GatewayConfig) -> str | None:
    """The leading characters of the prompt (for prefix affinity); None for embeddings."""
    if not cfg.prefix_affinity or work.capability is Capability.EMBEDDING:
        return None
    if work.capability is Capability.COMPLETION:
        prompt = work.body.get("prompt")
        text = prompt if isinstance(prompt, str) else json.dumps(prompt)[: cfg.affinity_prefix_chars]
        return text[: cfg.affinity_prefix_chars] or None
    parts: list[str] = []
    size = 0
    for message in work.body.get("messages") or []:
        content = message.get("content") if isinstance(message, dict) else None
        piece = content if isinstance(content, str) else json.dumps(content)
        parts.append(piece)
        size += len(piece)
        if size >= cfg.affinity_prefix_chars:
            break
    return "\x00".join(parts)[: cfg.affinity_prefix_chars] or None


def _prompt_estimate(work: Work) -> int:
    """About one token per four characters of the prompt: what is reported for runtimes that send no
    usage of their own (the usual rule of thumb for English text with BPE vocabularies)."""
    if work.capability is Capability.COMPLETION:
        prompt = work.body.get("prompt")
        chars = len(prompt) if isinstance(prompt, str) else len(json.dumps(prompt))
    elif work.capability is Capability.CHAT:
        chars = 0
        for message in work.body.get("messages") or []:
            content = message.get("content") if isinstance(message, dict) else None
            chars += len(content) if isinstance(content, str) else len(json.dumps(content))
    else:
        return 0
    return max(1, chars // 4)


def _end_error(end: wire.EndHead) -> NexaError:
    """The typed error a failed `end` means for the client (the runtime's own message only for 4xx)."""
    code = end.code or "runtime_error"
    if code == "runtime_rejected":
        return RuntimeRejected(end.message or f"the runtime refused the request (HTTP {end.http_status})")
    if code == "deadline_exceeded":
        return DeadlineExceeded("the request's deadline passed while the runtime worked on it")
    if code == "cancelled":
        return Cancelled("the request was cancelled")
    if code == "node_lost":
        return RuntimeFailed("the node serving the request stopped answering")
    return RuntimeFailed(f"the runtime failed the request ({code})")
