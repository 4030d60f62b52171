"""One call through the gateway as it runs: the work asked for, what is known of it so far, and its answer.

`Work` is one inference request, whichever API it came through. `Progress` gathers what happens
to the call (where it was routed, its status, tokens, timings) and makes the call's one
`CallOutcome` when it ends (`Progress.end`, once). `Answer` is what `async with gateway.call(work)
as answer:` yields: iterated for output bytes (runtime SSE events or the unary body, passed
through untouched), each piece checked to be what the API promises; an answer that is not ends the
call with RuntimeFailed (`Answer.error`), never passes.

Nothing here reads or logs a payload beyond the checks of its shape; no payload is ever stored.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import random
import time
from typing import TYPE_CHECKING, Any, Final

import attrs
import trio

from nexa.contracts import wire
from nexa.contracts.bounds import MAX_TOKENS
from nexa.contracts.deployments import ServingReplica
from nexa.contracts.domain import KeyId, TenantId
from nexa.contracts.gateway import Api, CallOutcome, Capability, Priority, usage_bounds
from nexa.contracts.models import ModelRef
from nexa.control.datapath import answers
from nexa.control.datapath.metering import REFUSED_OVER_REQUEST, REFUSED_TIMING, REFUSED_TOKENS, Meter, token_count_ok
from nexa.control.datapath.relay import RelayStream
from nexa.errors import Cancelled, DeadlineExceeded, NexaError, RuntimeFailed, RuntimeRejected

if TYPE_CHECKING:
    from nexa.control.datapath.lora import LoraRoute

log = logging.getLogger(__name__)

#: After a stream's `[DONE]`, how long a call whose client left waits for the `end` with the usage.
TAIL_S: Final = 1.0
#: How long leaving a call may take to release what it holds (relay stream, replica, admission
#: slot, quota ticket), shielded from the caller's cancellation. The release is bookkeeping with
#: no I/O that waits (the relay's `cancel` to the node is sent without waiting): it takes
#: microseconds, so 5 s only bounds a bug, never cuts a release short in practice.
RELEASE_TIMEOUT_S: Final = 5.0
#: Longest single SSE event of a stream held while its end arrives (events are whole in a chunk
#: unless larger than the node's `max_chunk_bytes`); a longer one fails the stream.
MAX_EVENT_BYTES: Final = 4 * 1024 * 1024
#: `nexa_gateway_invalid_answers_total` kinds.
UNARY: Final = "unary"
STREAM: Final = "stream"
BATCH: Final = "batch"
#: The largest overhead figure (ms) a node's answer may report for one request; a larger one (or a
#: negative one, or one that is not a finite number) is ignored and counted: no real node spends a
#: minute of its own time on one request outside the runtime.
MAX_NODE_OVERHEAD_MS: Final = 60_000.0


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
    #: A media upload (`/v1/audio/transcriptions`, `…/translations`): sent to the runtime as
    #: multipart form data, with `body`'s values as its other fields. Held in memory, never on disk.
    upload: Upload | None = None
    #: Only this replica may serve it (its runtime keeps the stored response the request continues:
    #: `control.datapath.stored`); StoredResponseLost when it is not Ready. None: any.
    pin: str | None = None
    #: Not the capability's own call but another route of its runtime, sent with no body and
    #: metered in no tokens (a stored response's `GET /v1/responses/{id}`, `POST …/cancel`). None: the call.
    route: RuntimeRoute | None = None


@attrs.frozen(kw_only=True)
class RuntimeRoute:
    """A body-less request to one of the runtime's own routes (`Work.route`)."""

    method: wire.RuntimeMethod
    path: str


@attrs.frozen(kw_only=True)
class Upload:
    """The file part of a media upload, as the client sent it."""

    field: str
    filename: str
    content_type: str
    data: bytes = attrs.field(repr=False)


@attrs.define(kw_only=True, eq=False)
class Progress:
    """What is known of a call while it runs; `end` makes its one `CallOutcome` from it."""

    work: Work
    #: trio clock at which the call began (its timings count from here).
    started: float
    alias: str = ""
    model: ModelRef | None = None
    deployment: str = ""
    node_id: str = ""
    #: The replica that answered (None until one did).
    replica: ServingReplica | None = None
    canary: bool = False
    #: `ok`, or the error code the call ended with.
    status: str = "ok"
    prompt_tokens: int = 0
    completion_tokens: int = 0
    queue_ms: float = 0.0
    ttft_ms: float | None = None
    attempts: int = 0
    opened: bool = False
    #: Seconds spent waiting outside nexa besides admission (`queue_ms`): for the answers of attempts
    #: that failed, and (embeddings) for a batch's window and runtime call.
    waited_s: float = 0.0
    #: The relay stream of the replica that answered: how long it waited for its node.
    answered: RelayStream | None = None
    #: The nodes' own overhead (ms), summed over the attempts; None while none reported a usable one.
    node_ms: float | None = None
    #: Set by `end`, once.
    outcome: CallOutcome | None = None
    #: A media call's use in its capability's unit (`MEDIA_UNITS`), set by `control.datapath.media`
    #: (up front, for the quota's reservation); its outcome has it only if a replica answered.
    units: float = 0.0
    #: The LoRA adapter the alias served on `model` (None: none).
    adapter: ModelRef | None = None
    #: By replica id, how each replica routed to serves the alias's adapter (`lora.with_lora`).
    lora_routes: dict[str, LoraRoute] = attrs.Factory(dict)
    #: The request's draw in [0, 1) against an in-place adapter rollout's weight (`LoraRoute.pick`).
    lora_draw: float = attrs.Factory(random.random)
    #: An attempt on a new adapter version failed before any output: retries take the earlier one.
    lora_canary_failed: bool = False
    #: The attempt now in flight named a new adapter version (`LoraRoute.pick`).
    lora_canary: bool = False

    def lora_for(self, replica_id: str) -> str:
        """The adapter name an attempt on that replica sends (`InferHead.lora`; "" for none); the
        version it loads becomes what the attempt is metered as (`adapter`)."""
        route = self.lora_routes.get(replica_id)
        if route is None:
            return self.alias if self.adapter is not None else ""
        self.adapter, name, self.lora_canary = route.pick(self.lora_draw, canary_failed=self.lora_canary_failed)
        return name

    def failed(self, exc: BaseException) -> None:
        """The call raised `exc` before its answer was handed out: that is its status."""
        if isinstance(exc, NexaError):
            self.status = exc.code
        elif isinstance(exc, trio.Cancelled):
            self.status = Cancelled.code

    def served_by(self, deployment: str, node_id: str, *, canary: bool, model: ModelRef | None) -> None:
        self.deployment, self.node_id, self.canary = deployment, node_id, canary
        self.model = model or self.model

    def first_output(self) -> None:
        self.ttft_ms = self.elapsed_ms()

    def elapsed_ms(self) -> float:
        return (trio.current_time() - self.started) * 1000.0

    def waited_total_s(self) -> float:
        """Seconds the call spent outside nexa's code so far: queued in admission, and waiting for
        nodes' answers (the answering stream's first frame; unary: its whole answer)."""
        waited = self.queue_ms / 1000.0 + self.waited_s
        if self.answered is not None:
            waited += self.answered.waited_s(whole=not self.work.stream)
        return waited

    def add_node_overhead(self, value: float | None) -> bool:
        """Add a node's reported overhead (ms) when usable (`node_overhead_ms`); False: refused."""
        if value is None:
            return True
        usable = node_overhead_ms(value)
        if usable is None:
            return False
        self.node_ms = usable + (self.node_ms or 0.0)
        return True

    def overhead_ms(self, arrived: float, now: float) -> float:
        """`x-nexa-overhead-ms` of the call's response head written at `now` (trio clock) for a
        request that arrived at `arrived`: see `overhead_ms`."""
        return overhead_ms(now - arrived, self.waited_total_s(), self.node_ms)

    def end(self) -> CallOutcome:
        """Make the call's outcome (RuntimeError when made already: a call ends once)."""
        if self.outcome is not None:
            raise RuntimeError("the outcome of a call is made once")
        work = self.work
        self.outcome = CallOutcome(
            request_id=work.request_id,
            workload_id=work.workload_id,
            api=work.api,
            tenant=work.tenant,
            key_id=work.key_id,
            capability=work.capability,
            alias=self.alias,
            model=self.model,
            deployment=self.deployment,
            node_id=self.node_id,
            canary=self.canary,
            status=self.status,
            prompt_tokens=self.prompt_tokens,
            completion_tokens=self.completion_tokens,
            queue_ms=self.queue_ms,
            ttft_ms=self.ttft_ms,
            duration_ms=self.elapsed_ms(),
            finished_at=time.time(),
            attempts=self.attempts,
            opened=self.opened,
            # Media units count once a replica answered: a call refused before any runtime ran it
            # (no replica, an API its runtimes do not serve, …) used nothing, as a text call's tokens.
            units=self.units if self.answered is not None else 0.0,
            adapter=self.adapter,
        )
        return self.outcome


class Answer:
    """An admitted call's answer: iterate for bytes (or `read_all`).

    After iteration `error` holds the typed error the answer ended with (after the first byte), or
    None. A unary answer comes as one piece once whole, checked to be the JSON object its
    capability answers with (`answer` then holds it parsed); a stream as whole SSE events, each
    checked. What ends it early leaves the relay stream to the call, which cancels the rest at the
    node when it is left.
    """

    def __init__(
        self,
        progress: Progress,
        meter: Meter,
        *,
        kind: str,
        stream: RelayStream | None = None,
        first: bytes | None = None,
        trusted_body: bytes | None = None,
    ) -> None:
        self.work = progress.work
        self._progress = progress
        self._meter = meter
        #: What `nexa_gateway_invalid_answers_total` counts this answer as.
        self.kind = kind
        self._stream = stream if first is not None else None
        self._pending: list[bytes] = []
        if first is not None:
            self._pending.append(first)
        #: The unary body is one the gateway made itself (a slice of an embeddings batch).
        self._trusted = trusted_body is not None
        if trusted_body is not None:
            self._pending.append(trusted_body)
        #: Output events streamed (`_checked_events`), and whether a usage event was among them.
        self._events = 0
        self._usage_seen = False
        self._done_seen = False
        #: The start of an SSE event whose end is still to come (streams).
        self._rest = b""
        #: The unary answer was handed out (or refused): iteration is over.
        self._unary_taken = False
        #: The node's completion count was refused: the controller estimates it.
        self._usage_refused = False
        #: The unary answer, parsed (once iteration is over and it was valid).
        self.answer: dict[str, Any] | None = None
        self.error: NexaError | None = None

    def __aiter__(self) -> Answer:
        return self

    async def __anext__(self) -> bytes:
        if self.work.capability is Capability.SPEECH:
            return await self._next()  # audio: passed on as it comes, never parsed
        if not self.work.stream:
            return await self._next_unary()
        while True:
            try:
                chunk = await self._next()
            except StopAsyncIteration:
                rest, self._rest = self._rest, b""
                last = self._checked_events([rest], rest) if rest else b""  # a last event without its blank line
                if last:
                    return last
                raise
            buf = self._rest + chunk
            events, self._rest = answers.split_events(buf)
            whole = buf[: len(buf) - len(self._rest)] if self._rest else buf
            if len(self._rest) > MAX_EVENT_BYTES:
                self._refuse(f"an event longer than {MAX_EVENT_BYTES} bytes")
                events, whole = [], b""
            out = self._checked_events(events, whole)
            if out:
                return out
            if self._stream is None and not self._pending:
                raise StopAsyncIteration

    async def read_all(self) -> bytes:
        return b"".join([chunk async for chunk in self])

    def _checked_events(self, events: list[bytes], whole: bytes) -> bytes:
        """`whole` (the events as they came, not re-joined) when every one is a valid stream event;
        else the events before the first that is not (which ends the call)."""
        native = self.work.capability.native
        for at, event in enumerate(events):
            check = answers.check_native_event(event) if native else answers.check_event(event)
            if check.problem is not None:
                self._refuse(check.problem)
                return b"".join(events[:at])
            if check.prompt_tokens is not None:  # a native API's usage: the node reads OpenAI's only
                self._progress.prompt_tokens = check.prompt_tokens
            if check.completion_tokens is not None:
                self._progress.completion_tokens = check.completion_tokens
            if check.text:
                # The output events, counted here only (one a token): the completion count when
                # the runtime sends no usage, or the stream ends without it (node lost, client gone).
                self._events += 1
            if check.usage:
                self._usage_seen = True
            if check.done:
                self._done_seen = True
                if self.work.include_usage and not self._usage_seen and not native:
                    # The client asked for usage and the runtime sent none: say what was counted.
                    self._usage_seen = True
                    made = answers.usage_event(prompt_estimate(self.work), min(self._events, MAX_TOKENS))
                    return b"".join(events[:at]) + made + b"".join(events[at:])
        return whole

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
                self._progress.completion_tokens = answers.completion_estimate(answer)
            capability = self.work.capability
            counted = answers.counted_prompt_tokens(capability, answer, self.work.body)
            if counted is not None and not self._progress.prompt_tokens:
                self._progress.prompt_tokens = min(counted, MAX_TOKENS)
            if capability.native and self.work.route is None:  # its own usage names: the node reads OpenAI's only
                prompt, completion = answers.native_usage(capability, answer)
                self._progress.prompt_tokens = prompt if prompt is not None else self._progress.prompt_tokens
                if completion is not None:
                    self._progress.completion_tokens = completion
        return body

    def _refuse(self, problem: str) -> None:
        """End the call with RuntimeFailed: the runtime's answer is not what the API promises.
        Leaving the relay stream (when the call is left) cancels the rest at the node."""
        self._stream = None
        self._pending.clear()
        self._rest = b""
        self._meter.invalid_answer(self.kind)
        log.warning("request %s: the runtime's %s answer is unusable: %s", self.work.request_id, self.kind, problem)
        if self.error is None:
            self.error = RuntimeFailed(f"the runtime's answer is unusable ({problem})")
            self._progress.status = self.error.code

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
        self._finish_stream(stream.end)
        raise StopAsyncIteration

    def _finish_stream(self, end: wire.EndHead | None) -> None:
        self._stream = None
        if end is not None:
            self.take_usage(end)
            if not self.work.stream:
                self.take_overhead(end.overhead_ms)  # a stream's figure came with its first chunk
            if end.status is not wire.EndStatus.OK:
                self.error = end_error(end)
                self._progress.status = self.error.code

    def take_overhead(self, value: float | None) -> None:
        """The node's overhead figure for the response head (`take_node_overhead`)."""
        take_node_overhead(self._progress, self._meter, value)

    def take_usage(self, end: wire.EndHead) -> None:
        """The node's token counts, checked again where they enter the controller (whatever the wire
        contract let through). A count that is not a whole number in 0..2^31 is never used: it is
        counted (`nexa_usage_records_refused_total{reason="tokens_out_of_range"}`), logged by
        request id, and replaced by the controller's own estimate: about four characters a token of
        the prompt; for the completion, the streamed events (one a token, when the call ends), or
        the unary answer's own `usage` (checked) or four characters a token of its text."""
        progress = self._progress
        prompt, completion = end.prompt_tokens, end.completion_tokens
        refused = []
        if prompt is not None:
            if token_count_ok(prompt):
                progress.prompt_tokens = prompt
            else:
                refused.append("prompt_tokens")
                progress.prompt_tokens = prompt_estimate(self.work)
        if completion is not None:
            if token_count_ok(completion):
                progress.completion_tokens = completion
            else:
                refused.append("completion_tokens")
                self._usage_refused = True
                progress.completion_tokens = 0
        for name in refused:
            self._meter.refused(REFUSED_TOKENS)
            log.warning(
                "request %s: node %s reported %s out of range; metered with the controller's estimate",
                self.work.request_id,
                progress.node_id,
                name,
            )

    def _clamp_to_request(self) -> None:
        """No more tokens than the request could produce are billed or taken from its quota: a count
        above `usage_bounds` is clamped to it and counted
        (`nexa_usage_records_refused_total{reason="tokens_over_request"}`), logged by request id."""
        progress = self._progress
        prompt_max, completion_max = usage_bounds(self.work.capability, self.work.body)
        for name, bound in (("prompt_tokens", prompt_max), ("completion_tokens", completion_max)):
            reported = getattr(progress, name)
            if reported > bound:
                setattr(progress, name, bound)
                self._meter.refused(REFUSED_OVER_REQUEST)
                log.warning(
                    "request %s: node %s reported %d %s, more than the request allows (%d); metered as %d",
                    self.work.request_id,
                    progress.node_id,
                    reported,
                    name,
                    bound,
                    bound,
                )

    async def conclude(self) -> None:
        """The call is being left: take what the node still owes, and what was streamed."""
        if self._stream is not None and self._done_seen:
            # The client had the whole answer and went away before the node's `end` (it often
            # closes right after `[DONE]`): wait briefly for the end, which carries the usage.
            stream, self._stream = self._stream, None
            with trio.move_on_after(TAIL_S, shield=True):
                while await stream.receive() is not None:
                    pass
            if stream.end is not None:
                self._finish_stream(stream.end)
        if self._stream is not None:
            # Left before the end: the client went away or the caller gave up. The relay cancels.
            self._stream = None
            if self._progress.status == "ok":
                self._progress.status = Cancelled.code
        if self._progress.completion_tokens == 0 and self._events:
            # No usage came back (the runtime sends none, the node was lost, or the client left):
            # count what was streamed, one token per event, as the runtime's own streams send them.
            self._progress.completion_tokens = min(self._events, MAX_TOKENS)
        self._clamp_to_request()


async def release(stack: contextlib.AsyncExitStack, request_id: str) -> None:
    """Close `stack`, shielded from the caller's cancellation for at most RELEASE_TIMEOUT_S (a call
    left by a client that went away must still release its slot, replica and quota ticket). Past
    it, what was not released yet is logged (never a payload), not lost silently."""
    with trio.move_on_after(RELEASE_TIMEOUT_S, shield=True) as bounded:
        await stack.aclose()
    if bounded.cancelled_caught:
        log.error("request %s: releasing the call took over %.0f s and was cut short", request_id, RELEASE_TIMEOUT_S)


def node_overhead_ms(value: object) -> float | None:
    """A node's reported overhead (ms) when it can be used: a finite number in 0 …
    `MAX_NODE_OVERHEAD_MS`; None for anything else (negative, NaN, infinite, huge, not a number)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if isinstance(value, int):
        return float(value) if 0 <= value <= MAX_NODE_OVERHEAD_MS else None
    return value if math.isfinite(value) and 0.0 <= value <= MAX_NODE_OVERHEAD_MS else None


def overhead_ms(total_s: float, waited_s: float, node_ms: float | None) -> float:
    """nexa's own time in a response, in ms (`x-nexa-overhead-ms`): the controller's part, the time
    from the request's arrival to its response head (`total_s`) less the time it waited outside
    nexa (`waited_s`: admission queueing, the relay waiting for nodes' answers), never below 0;
    plus the nodes' own part (`node_ms`, already checked; None: no node reported one)."""
    return max(0.0, total_s - waited_s) * 1000.0 + (node_ms or 0.0)


def take_node_overhead(progress: Progress, meter: Meter, value: float | None, node_id: str = "") -> None:
    """Add a node's overhead figure to the call's; one that is not usable is ignored, counted
    (`nexa_usage_records_refused_total{reason="timing_invalid"}`) and logged by request id."""
    if not progress.add_node_overhead(value):
        meter.refused(REFUSED_TIMING)
        log.warning(
            "request %s: node %s reported an overhead outside 0..%g ms; ignored",
            progress.work.request_id,
            node_id or progress.node_id,
            MAX_NODE_OVERHEAD_MS,
        )


def prompt_estimate(work: Work) -> int:
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


def end_error(end: wire.EndHead) -> NexaError:
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
