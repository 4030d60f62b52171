"""The inference pipeline both northbound APIs share: resolve → quota → admission → route → relay → meter.

`async with gateway.call(work) as answer:` resolves the requested alias to the model version it
points at and the replicas serving it (`Deployments.serving`: Ready replicas on Ready or Cordoned
nodes, canary share included), refuses at once when none is Ready (`NoReadyReplica`), takes the
tenant's quota ticket, waits for an admission slot of the model (priority classes, fair between
tenants, the deadline covering queue time), then picks a replica (`Router`: lowest load score,
prefix affinity, canary weight) and opens a relay stream to it over the node's channel. A failure
before the first output byte (runtime unavailable or failing, node busy or lost) is retried, at
most `gateway.retries` times: on a Ready replica not tried yet while there is one, else on the
replicas Ready by then after `gateway.retry_backoff_s` (doubling each round), never past the
request's deadline. When every attempt found its replica not serving after all (the node not
connected, the runtime not Ready there), nothing ran and the call fails with 503
`no_ready_replica`; when a runtime failed it, with 502 `runtime_failed`. After the first byte the
call ends with a typed error instead. The `Answer` it yields is iterated for output bytes (`calls.Answer`). Each step
holds what it took on one exit stack the call owns: leaving the block (also when the client went
away, whose cancellation reaches the runtime through the relay's `cancel`) closes the relay stream,
releases replica and slot, settles the quota with the tokens used and records one usage record,
all from the call's one `CallOutcome` (`call.outcome` once the block is left).

Embedding requests with plain text input are batched: those for the same model arriving within
`embedding_batch_window_s` (up to `embedding_max_batch` inputs) become one runtime call, run by
the gateway's own nursery, and each caller gets its slice back re-indexed. The runtime reports
one `usage` for the batch; each caller is charged a share proportional to the characters of its
inputs (the last one gets the rounding remainder).

A model name starting `nexa-eval-` names an evaluation replica (served only to its evaluation's
key, and never under an alias or pinned version) or, `nexa-eval-canary.D`, deployment D's canary
replicas alone (`control.deployments.evalreplica`).

Nothing here reads or logs a payload beyond what routing needs (the prompt prefix, hashed for
affinity, and embedding inputs while they are being batched); no payload is ever stored.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
import types
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Final, NoReturn

import attrs
import trio

from nexa.config import GatewayConfig
from nexa.contracts import wire
from nexa.contracts.deployments import EVAL_PREFIX, ServingReplica, ServingSet
from nexa.contracts.domain import KeyId, TenantId
from nexa.contracts.gateway import (
    MEDIA_UNITS,
    Api,
    CallOutcome,
    Capability,
    UsageRecord,
    adapter_key,
    token_reservation,
)
from nexa.contracts.models import ModelRef
from nexa.control.datapath.admission import Admission
from nexa.control.datapath.affinity import affinity_key
from nexa.control.datapath.calls import (
    BATCH,
    STREAM,
    UNARY,
    Answer,
    Progress,
    Work,
    end_error,
    prompt_estimate,
    release,
    take_node_overhead,
)
from nexa.control.datapath.lora import adapter_of, with_lora
from nexa.control.datapath.metering import Meter
from nexa.control.datapath.quotas import Quotas, QuotaTicket
from nexa.control.datapath.relay import Relay, RelayStream
from nexa.control.datapath.routing import Router, for_data_class
from nexa.control.datapath.uploads import write_form
from nexa.control.deployments import Deployments
from nexa.control.deployments.idle import Idle
from nexa.control.registry.models import ModelRegistry
from nexa.errors import (
    ApiNotServed,
    ChannelError,
    DeadlineExceeded,
    ModelNotServed,
    NexaError,
    NoReadyReplica,
    NoReplicaForDataClass,
    RuntimeFailed,
    StoredResponseLost,
)

log = logging.getLogger(__name__)

#: End codes after which another replica may get the request (when no output byte was sent yet).
RETRYABLE_END_CODES: Final = frozenset(
    {"runtime_unavailable", "runtime_error", "node_busy", "node_lost", "unknown_assignment"}
)
#: Of those, the codes that mean the replica was not serving after all: nothing ran.
NOT_SERVING_END_CODES: Final = frozenset({"runtime_unavailable", "unknown_assignment"})


@attrs.frozen(kw_only=True)
class ServedModel:
    """`GET /v1/models`: an alias (or pinned version) with at least one deployment."""

    id: str
    created: float


class Call:
    """One call through the gateway, as `async with gateway.call(work) as answer:` (see `Gateway.call`).

    Entering runs the pipeline up to a replica's first output; leaving releases everything it
    took and meters the call, once. `outcome` is the call's `CallOutcome` once it was left, also
    when entering raised (refused, or failed before any output). A call is entered once.
    """

    def __init__(self, gateway: Gateway, work: Work, admitted: Callable[[], Awaitable[None]] | None) -> None:
        self.work = work
        self._gateway = gateway
        self._admitted = admitted
        self._stack = contextlib.AsyncExitStack()
        #: What is known of the call so far (its response's `x-nexa-overhead-ms` comes from it).
        self.progress = Progress(work=work, started=trio.current_time())
        self._answer: Answer | None = None
        self._entered = False
        #: What happened to the call, once it was left.
        self.outcome: CallOutcome | None = None

    async def __aenter__(self) -> Answer:
        if self._entered:
            raise RuntimeError("a call is entered once")
        self._entered = True
        try:
            self._answer = await self._gateway._enter(self._stack, self.progress, self._admitted)
        except BaseException as exc:
            self.progress.failed(exc)
            await self._end()
            raise
        self.progress.opened = True
        return self._answer

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: types.TracebackType | None
    ) -> None:
        await self._end()

    async def _end(self) -> None:
        """Make the outcome, then release what the pipeline holds; its last step records the usage."""
        if self._answer is not None:
            await self._answer.conclude()
        self.outcome = self.progress.end()
        await release(self._stack, self.work.request_id)


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
        idle: Idle | None = None,
    ) -> None:
        self._cfg = cfg
        self._models = models
        self._deployments = deployments
        self._relay = relay
        self._quotas = quotas
        self._admission = admission
        self._router = router
        self._meter = meter
        #: Sleep when idle: who wakes a sleeping deployment (`Deployments.idle`); None: none sleeps.
        self._idle = idle
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

    def passes_through(self, model: str, capability: Capability) -> bool:
        """Whether every Ready replica of `model` serves `capability` (a native API) itself: its
        requests then pass through as they are; otherwise they are translated to chat completions."""
        if model.startswith(EVAL_PREFIX):
            return False  # an evaluation replica's calls are translated: its key is checked on the way in
        try:
            alias, ref = self._resolve_served(model)
        except ModelNotServed:
            return False
        replicas = self._deployments.serving(ref, alias=alias or None).replicas
        return bool(replicas) and all(capability in r.serves for r in replicas)

    def keeps_responses(self, model: str) -> bool:
        """Whether any Ready replica of `model` keeps Responses API responses (`ServingReplica.keeps_responses`)."""
        if model.startswith(EVAL_PREFIX):
            return False
        try:
            alias, ref = self._resolve_served(model)
        except ModelNotServed:
            return False
        return any(r.keeps_responses for r in self._deployments.serving(ref, alias=alias or None).replicas)

    def trio_deadline(self, work: Work) -> float:
        return trio.current_time() + (work.deadline_at - time.time())

    def call(self, work: Work, *, admitted: Callable[[], Awaitable[None]] | None = None) -> Call:
        """`async with gateway.call(work) as answer:` admits and starts `work`; entering returns
        once a replica produced its first output (or ended), with the `Answer` to read.

        Entering raises before any output: ModelNotServed, NoReadyReplica (NoReplicaForDataClass),
        QuotaExceeded, QueueFull, DeadlineExceeded, RuntimeFailed (every attempt failed before
        its first byte), RuntimeRejected (the runtime refused the request itself); nothing is left
        to release then, and the usage is still recorded. `admitted`, when given, is awaited once
        the request holds its admission slot, before it is routed (what must be durable about an
        admitted request is written there, and only there: a request refused before admission
        costs no store write). `Call.outcome` tells what happened, once the block is left.
        """
        return Call(self, work, admitted)

    async def probe(
        self, replica: ServingReplica, capability: Capability, body: dict[str, Any], *, deadline_at: float
    ) -> tuple[bytes, wire.EndHead | None]:
        """One unary request to `replica` alone, the way a routed call reaches it (the router's
        in-flight count, a relay stream over the node's channel, the node's relay, the runtime), but
        outside any tenant: no quota, admission or metering (`nexa runtimes qualify`'s answer step).
        The whole answer and the node's end; raises as entering `call` does once routed
        (RuntimeFailed, RuntimeRejected, NoReadyReplica, DeadlineExceeded)."""
        work = Work(
            request_id="qualify-" + uuid.uuid4().hex[:16],
            api=Api.OPENAI,
            tenant=TenantId("controller"),
            key_id=KeyId("controller"),
            capability=capability,
            model=replica.model.key,
            body=body,
            stream=False,
            deadline_at=deadline_at,
        )
        serving = ServingSet(model=replica.model, replicas=[replica], deployments=[replica.deployment])
        progress = Progress(work=work, started=trio.current_time())
        stack, stream, first = await self._open(progress, serving, _encode(work, serving))
        parts = [] if first is None else [first]
        try:
            while (more := await stream.receive()) is not None:
                parts.append(more)
        finally:
            await release(stack, work.request_id)
        return b"".join(parts), stream.end

    # ---- the pipeline ------------------------------------------------------------------------------

    def _resolve(self, name: str, key_id: KeyId) -> tuple[str, ModelRef]:
        if name.startswith(EVAL_PREFIX):  # an evaluation replica, only for its evaluation's key
            return name, self._deployments.eval_model(name, key_id)
        return self._resolve_served(name)

    def _resolve_served(self, name: str) -> tuple[str, ModelRef]:
        """The alias (or "" for `model:version`) and version a client's model name is served as."""
        model_name, sep, version = name.partition(":")
        try:
            if sep:
                record = self._models.model(model_name, version)
                return "", ModelRef(model=record.name, version=record.version)
            record = self._models.resolve(name)
        except NexaError:  # NotFound, or an alias pointing at a version no longer Approved
            raise ModelNotServed(f"no model or alias {name!r} is served here") from None
        return name, ModelRef(model=record.name, version=record.version)

    async def _enter(
        self,
        stack: contextlib.AsyncExitStack,
        progress: Progress,
        admitted: Callable[[], Awaitable[None]] | None,
    ) -> Answer:
        """The pipeline, each step holding what it took on `stack` (the call's): closed in reverse,
        the relay stream and replica go first, then the admission slot, the quota ticket (settled
        with the tokens of the outcome), and last the usage record of the outcome."""
        work = progress.work
        stack.callback(self._record, progress)
        progress.alias, ref = self._resolve(work.model, work.key_id)
        progress.model = ref
        progress.adapter = adapter_of(self._models, progress.alias)
        serving = self._deployments.serving(ref, alias=None if progress.adapter else progress.alias or None)
        if not serving.deployments:
            raise ModelNotServed(f"{work.model!r} has no deployment")
        idle = self._idle
        if idle is not None:
            idle.touch(serving.deployments)
        if idle is not None and not serving.replicas and (asleep := idle.sleeping(serving.deployments)):
            # Asleep: wake it and wait, within the deadline (nexa's time: in the overhead figure).
            await idle.wait_awake(asleep, self.trio_deadline(work))
            serving = self._deployments.serving(ref, alias=None if progress.adapter else progress.alias or None)
        if progress.adapter is not None:
            serving, progress.lora_routes = with_lora(
                self._deployments.desired, serving, progress.alias, work.model, progress.adapter
            )
        model_key = progress.alias or ref.key
        self._admission.set_capacity(model_key, len(serving.replicas) * self._cfg.max_inflight_per_replica)
        serving = _pinned(work, serving)
        if not serving.replicas:
            raise NoReadyReplica(f"no replica of {work.model!r} is Ready now")
        serving = self._for_data_class(work, serving)
        if time.time() >= work.deadline_at:
            raise DeadlineExceeded("the request's deadline has already passed")
        reserve = token_reservation(work.capability, work.body, default_completion=self._cfg.reserve_completion_tokens)
        unit = MEDIA_UNITS.get(work.capability)
        adapter = progress.adapter.model if progress.adapter is not None else None  # its quota: by name
        ticket = self._quotas.admit(
            work.tenant, time.time(), reserve_tokens=reserve, unit=unit, reserve_units=progress.units, adapter=adapter
        )
        stack.callback(self._settle_quota, ticket, progress)
        queue_from = trio.current_time()
        try:
            queued_s = await stack.enter_async_context(
                self._admission.slot(model_key, work.tenant, work.priority, self.trio_deadline(work))
            )
        except BaseException:
            progress.waited_s += trio.current_time() - queue_from  # queued, then refused: a wait too
            raise
        progress.queue_ms = queued_s * 1000.0
        if queued_s:
            # Replicas may have come or gone while it waited: route by the fleet as it is now.
            serving = self._serving_now(work, ref, progress)
        if admitted is not None:
            await admitted()
        if work.capability is Capability.EMBEDDING and (inputs := _batchable_inputs(work.body)) is not None:
            return await self._embed_batched(progress, serving, inputs)
        replica, stream, first = await self._open(progress, serving, _encode(work, serving))
        stack.push_async_exit(replica)
        return self._answer(progress, stream, first, kind=STREAM if work.stream else UNARY)

    def _serving_now(self, work: Work, ref: ModelRef, progress: Progress) -> ServingSet:
        """The replicas of `ref` Ready now that may take `work` (those that load the adapter the
        call's alias serves, if it serves one: the version they load goes to `progress`; the one
        keeping a stored response a Responses request continues); NoReadyReplica when none is."""
        alias = progress.alias
        serving = self._deployments.serving(ref, alias=None if progress.adapter else alias or None)
        if progress.adapter is not None:
            wanted = adapter_of(self._models, alias) or progress.adapter
            serving, progress.lora_routes = with_lora(self._deployments.desired, serving, alias, work.model, wanted)
        serving = _pinned(work, serving)
        if not serving.replicas:
            raise NoReadyReplica(f"no replica of {work.model!r} is Ready now")
        return self._for_data_class(work, serving)

    def _for_data_class(self, work: Work, serving: ServingSet) -> ServingSet:
        """The replicas allowed the request's data class whose runtime serves its capability
        (`_for_capability`); NoReplicaForDataClass when none is allowed it."""
        serving = _for_capability(work, serving)
        if work.data_class is None:
            return serving
        allowed = for_data_class(serving, work.data_class, self._deployments.node_data_classes)
        if not allowed.replicas:
            raise NoReplicaForDataClass(
                f"no Ready replica of {work.model!r} is on a node allowed data class {work.data_class}",
                data_class=work.data_class,
            )
        return allowed

    async def _open(
        self, progress: Progress, serving: ServingSet, body: Encoded
    ) -> tuple[contextlib.AsyncExitStack, RelayStream, bytes | None]:
        """Try replicas until one produces a first chunk (or ends cleanly): the stack holding its
        replica and relay stream, the stream, and its first chunk (None: it ended without output).

        Each attempt goes to a Ready replica not tried yet; once every one was, the next round
        waits `retry_backoff_s` (doubled each round) and routes by the fleet as it is then."""
        work = progress.work
        tried: set[str] = set()
        last: NexaError | None = None
        not_serving = True  # every failure so far: the replica was not serving after all
        rounds = 0
        # What the prompt tells routing and the node, read once per call (not per attempt).
        prefix = affinity_key(work, self._cfg, lora=progress.alias if progress.adapter is not None else "")
        estimate = prompt_estimate(work)
        for attempt in range(1 + self._cfg.retries):
            serving, replica = await self._next_replica(progress, serving, prefix, tried, rounds)
            if replica is None:
                break
            if not tried:
                rounds += 1
            tried.add(replica.replica_id)
            progress.attempts = attempt + 1
            stream_id = _new_stream_id(work, replica, attempt)
            head = self._head(progress, replica, body, estimate)
            stack = contextlib.AsyncExitStack()
            attempt_started = trio.current_time()
            self._router.acquire(replica.replica_id)
            stack.callback(self._router.release, replica.replica_id)
            try:
                stream = await stack.enter_async_context(self._relay.open(replica.node_id, stream_id, head, body.data))
                first = await self._first(stream)
            except ChannelError:
                # No route to the node right now: nothing was sent; try another replica.
                await release(stack, work.request_id)
                last = RuntimeFailed("the node serving the replica is not connected")
                continue
            except BaseException:
                await release(stack, work.request_id)
                raise
            end = stream.end
            if first is None and end is not None and end.status is not wire.EndStatus.OK:
                await release(stack, work.request_id)
                # Its wait for the node is not nexa's time; the node's own time is.
                progress.waited_s += stream.waited_s(whole=True)
                take_node_overhead(progress, self._meter, end.overhead_ms, replica.node_id)
                error = end_error(end)
                self._attempt_failed(progress, replica, attempt_started, ran=end.code not in NOT_SERVING_END_CODES)
                if end.code in RETRYABLE_END_CODES and not end.first_byte_sent:
                    log.info("attempt %d failed before output (%s); retrying", attempt + 1, end.code)
                    last = error
                    not_serving = not_serving and end.code in NOT_SERVING_END_CODES
                    continue
                raise error
            # Committed to this replica.
            progress.replica = replica
            progress.served_by(replica.deployment, replica.node_id, canary=replica.canary, model=replica.model)
            return stack, stream, first
        if last is None or not_serving:
            # Nothing ran anywhere: the replicas counted Ready were not serving (yet) — retryable.
            raise NoReadyReplica(f"no replica of {work.model!r} took the request (none serving now); retry shortly")
        raise last

    def _attempt_failed(self, progress: Progress, replica: ServingReplica, started: float, *, ran: bool) -> None:
        """A failure before any output counts against its replica, and against its adapter version
        unless nothing ran (`ran`: the adapter not on the node yet); a new version's sends the retries
        to the earlier one."""
        self._meter.attempt_failed(
            replica.deployment,
            canary=replica.canary,
            duration_ms=(trio.current_time() - started) * 1000.0,
            now=time.time(),
            node_id=replica.node_id,
            adapter=adapter_key(progress.adapter) if ran else "",
        )
        progress.lora_canary_failed = progress.lora_canary_failed or progress.lora_canary

    def _head(self, progress: Progress, replica: ServingReplica, body: Encoded, estimate: int) -> wire.InferHead:
        """The `infer` head of an attempt on `replica`; the adapter version it loads is what the
        attempt is metered as (`progress.adapter`)."""
        work = progress.work
        lora = progress.lora_for(replica.replica_id)
        return wire.InferHead(
            assignment_id=replica.replica_id,
            path=work.capability.path if work.route is None else work.route.path,
            method=wire.RuntimeMethod.POST if work.route is None else work.route.method,
            stream=work.stream,
            deadline_at=work.deadline_at,
            window=self._cfg.stream_window_chunks,
            strip_usage_chunk=work.stream and not work.include_usage,
            prompt_tokens_estimate=estimate,
            content_type=body.content_type,
            lora=lora,
        )

    async def _next_replica(
        self, progress: Progress, serving: ServingSet, prefix: str | None, tried: set[str], rounds: int
    ) -> tuple[ServingSet, ServingReplica | None]:
        """The replica to try next: a Ready one not in `tried`; once every one was, after a pause
        (`retry_backoff_s`, doubled per round after the first, never past the deadline; `tried`
        emptied), the best of the replicas Ready by then. None: none is left to try."""
        replica = self._router.choose(serving, prefix=prefix, exclude=tried)
        if replica is not None or not tried:
            return serving, replica
        pause = self._cfg.retry_backoff_s * 2 ** (rounds - 1)
        if time.time() + pause >= progress.work.deadline_at:
            return serving, None  # no time left for another round
        await trio.sleep(pause)
        serving = self._serving_now(progress.work, serving.model, progress)
        tried.clear()
        return serving, self._router.choose(serving, prefix=prefix, exclude=tried)

    def _answer(self, progress: Progress, stream: RelayStream, first: bytes | None, *, kind: str) -> Answer:
        """The answer of a replica's stream: its first chunk and the rest to come, or the usage of
        a stream that ended without output."""
        answer = Answer(progress, self._meter, kind=kind, stream=stream, first=first)
        progress.answered = stream
        if first is not None:
            progress.first_output()
            if kind == STREAM:
                answer.take_overhead(stream.first_overhead_ms)  # a unary answer's comes with its end
        elif stream.end is not None:
            answer.take_usage(stream.end)
            answer.take_overhead(stream.end.overhead_ms)
        return answer

    @staticmethod
    async def _first(stream: RelayStream) -> bytes | None:
        # Bounded by the relay: past the deadline it ends the stream with deadline_exceeded.
        return await stream.receive_all()

    def _settle_quota(self, ticket: QuotaTicket, progress: Progress) -> None:
        outcome = _made(progress)
        self._quotas.finish(ticket, outcome.total_tokens, outcome.finished_at, units=outcome.units)

    def _record(self, progress: Progress) -> None:
        """The usage record of the call's outcome: the last step out of every call, once."""
        self._meter.record(UsageRecord.from_outcome(_made(progress)))

    # ---- embedding batches -------------------------------------------------------------------------

    async def _embed_batched(self, progress: Progress, serving: ServingSet, inputs: list[str]) -> Answer:
        work = progress.work
        params = {k: v for k, v in work.body.items() if k != "input"}
        key = (progress.alias or serving.model.key, json.dumps(params, sort_keys=True))
        item = _Item(inputs=inputs, deadline=self.trio_deadline(work))
        batch = self._batches.get(key)
        if batch is None or batch.closed or batch.size + len(inputs) > self._cfg.embedding_max_batch:
            batch = _Batch(params=params, serving=serving, work=work, alias=progress.alias)
            self._batches[key] = batch
            self._spawn(self._run_batch, key, batch)
        batch.add(item)
        if batch.size >= self._cfg.embedding_max_batch:
            batch.full.set()
        waiting = trio.current_time()
        try:
            await item.done.wait()
        except BaseException:
            item.abandoned = True
            raise
        # The batch's window and its runtime call are waits outside nexa; the batch's own work is not.
        progress.waited_s += max(0.0, trio.current_time() - waiting - item.controller_s)
        progress.add_node_overhead(item.node_ms)  # checked when the batch took it
        if item.error is not None:
            raise item.error
        progress.served_by(item.deployment, item.node_id, canary=item.canary, model=item.model)
        progress.prompt_tokens = item.prompt_tokens
        progress.first_output()
        # The slice was made here from a batch answer that was checked.
        return Answer(progress, self._meter, kind=UNARY, trusted_body=item.body)

    def _spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        if self._nursery is None:
            raise RuntimeError("Gateway.run is not running")
        self._nursery.start_soon(fn, *args)

    async def _run_batch(self, key: tuple[str, str], batch: _Batch) -> None:
        with trio.move_on_after(self._cfg.embedding_batch_window_s):
            await batch.full.wait()
        closed_at = trio.current_time()
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
        progress = Progress(work=work, started=trio.current_time(), alias=batch.alias)
        error: NexaError | None = None
        replica: contextlib.AsyncExitStack | None = None
        try:
            replica, stream, first = await self._open(progress, batch.serving, _encode(work, batch.serving))
            answer = self._answer(progress, stream, first, kind=BATCH)
            await answer.read_all()  # checks the answer's shape: `answer.answer`, or `answer.error`
            if answer.error is not None:
                error = answer.error
            elif answer.answer is not None:
                _split_embeddings(answer.answer, live, progress)
        except NexaError as exc:
            error = exc
        except Exception as exc:
            # Last resort: this task runs in the gateway's own nursery, where anything escaping
            # would end the gateway; and its callers wait for `done`. The type only: an exception's
            # message could quote the answer.
            log.error("an embedding batch of %d inputs failed: %s", len(all_inputs), type(exc).__name__)  # noqa: TRY400
            error = RuntimeFailed("the embedding batch failed")
        finally:
            if replica is not None:
                await release(replica, work.request_id)
            # The batch's own time outside its waits for the node: each caller's share of overhead.
            controller_s = max(0.0, trio.current_time() - closed_at - progress.waited_total_s())
            for i in live:
                i.controller_s, i.node_ms = controller_s, progress.node_ms
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
    #: The batch's own time (s) outside its waits for the node, and its node's overhead (ms).
    controller_s: float = 0.0
    node_ms: float | None = None


@attrs.define(kw_only=True, eq=False)
class _Batch:
    params: dict[str, Any]
    serving: ServingSet
    work: Work
    #: The alias its callers asked for ("" for a pinned version): retry rounds route by its canary share.
    alias: str
    items: list[_Item] = attrs.Factory(list)
    size: int = 0
    closed: bool = False
    full: trio.Event = attrs.Factory(trio.Event)

    def add(self, item: _Item) -> None:
        self.items.append(item)
        self.size += len(item.inputs)


def _split_embeddings(answer: dict[str, Any], items: list[_Item], progress: Progress) -> None:
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
        item.deployment, item.node_id, item.canary = progress.deployment, progress.node_id, progress.canary
        item.model = progress.model


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


def _pinned(work: Work, serving: ServingSet) -> ServingSet:
    """The one replica `work` is pinned to (`Work.pin`: it keeps the stored response the request
    continues); StoredResponseLost when it is not Ready now. Never another replica: none has it."""
    if work.pin is None:
        return serving
    replicas = [r for r in serving.replicas if r.replica_id == work.pin]
    if not replicas:
        raise StoredResponseLost(
            "the replica that kept that stored response is gone or not Ready, and the response went with it;"
            " send the whole conversation as input items instead"
        )
    return attrs.evolve(serving, replicas=replicas)


def _for_capability(work: Work, serving: ServingSet) -> ServingSet:
    """The replicas whose runtime serves a gated capability (rerank, score, tokenizers, native APIs, media:
    `ServingReplica.serves`); ApiNotServed when none of the Ready ones does."""
    capability = work.capability
    if not capability.gated:
        return serving
    replicas = [r for r in serving.replicas if capability in r.serves]
    if not replicas:
        raise ApiNotServed(
            f"{work.model!r} runs on no runtime that serves {capability.path}: deploy it on one that does"
            + (
                " (its replicas changed while it was routed: send it again, it is translated now)"
                if capability.native
                else " (whisper.cpp's whisper-server serves transcriptions; vLLM transcriptions and translations;"
                " stable-diffusion.cpp's sd-server images)"
                if capability.media
                else " (vLLM serves rerank, score, tokenize and detokenize; llama.cpp's llama-server serves"
                " tokenize and detokenize, and rerank with settings.reranking: true and a reranker model)"
            )
        )
    return attrs.evolve(serving, replicas=replicas)


@attrs.frozen
class Encoded:
    """A runtime's request body and its media type."""

    data: bytes
    content_type: str = "application/json"


def _encode(work: Work, serving: ServingSet) -> Encoded:
    """The runtime's request body: the client's, with the served model's name, and usage always
    asked for in streams (stripped again on the node when the client did not ask); a media upload
    as a form (`uploads.write_form`)."""
    if work.route is not None:
        return Encoded(b"")  # another route of the runtime's (`Work.route`): no body
    body: dict[str, Any] = dict(work.body)
    body["model"] = serving.model.model
    if work.upload is not None:
        return Encoded(*write_form(body, work.upload))
    if work.capability.streams:
        body["stream"] = work.stream
        if work.stream and not work.capability.native:
            options = dict(body.get("stream_options") or {})
            options["include_usage"] = True
            body["stream_options"] = options
    return Encoded(json.dumps(body, separators=(",", ":")).encode())


def _made(progress: Progress) -> CallOutcome:
    """The outcome of a call being left (made before its stack is closed)."""
    if progress.outcome is None:
        raise RuntimeError("the call's outcome is made before what it holds is released")
    return progress.outcome
