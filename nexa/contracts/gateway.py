"""The inference gateway's records: the canonical envelope, workloads, receipts, usage and quotas.

Pure data and validation; no I/O. Both northbound APIs (OpenAI-compatible `/v1/*` and the
canonical `/api/v1/workloads`) become one `Work` item for the one pipeline in
`control/datapath/gateway.py`. Payloads (prompts, outputs) pass through as opaque JSON and never appear in
any record defined here: usage records and receipts carry counts, ids and timings only.

What happened to one call is made once, when it ends, as a `CallOutcome`; the records made of it
(`UsageRecord.from_outcome`, `Receipt.from_outcome`, and `WorkloadView.from_receipt` of that
receipt) are derived from it by the constructors beside their types, never copied by hand.
"""

from __future__ import annotations

import enum
import hashlib
import math
import re
from typing import Final

import attrs

from nexa.contracts import codec
from nexa.contracts.capabilities import MEDIA_UNITS as MEDIA_UNITS  # noqa: PLC0414 - re-exported
from nexa.contracts.capabilities import TEXT_CAPABILITIES as TEXT_CAPABILITIES  # noqa: PLC0414 - re-exported
from nexa.contracts.capabilities import Capability as Capability  # noqa: PLC0414 - re-exported
from nexa.contracts.domain import KeyId, TenantId
from nexa.contracts.domain import Priority as Priority  # noqa: PLC0414 - re-exported: it lives in domain
from nexa.contracts.models import ModelRef
from nexa.contracts.node import data_class_problem
from nexa.contracts.retention import EPHEMERAL, retention_problem

#: The canonical envelope's version; anything else is refused.
API_VERSION: Final = "nexa.v1"
#: Idempotency keys: opaque, printable, at most 256 characters.
IDENT_RE: Final = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,256}$")
#: Workload ids: as idempotency keys but without `/` (an id is one segment of `/api/v1/workloads/{id}`).
WORKLOAD_ID_RE: Final = re.compile(r"^[A-Za-z0-9._:@+=-]{1,256}$")
#: The longest `model` (alias or `name:version`) any inference route takes.
MAX_MODEL_CHARS: Final = 256
#: What usage records and receipts name when the requested model never resolved: the name the
#: client sent is not stored (it is the client's free text, up to MAX_MODEL_CHARS of it).
UNRESOLVED_MODEL: Final = "(unresolved)"
#: Bounds of the token figures a request may ask for (`max_tokens`, `max_completion_tokens`).
MAX_REQUEST_TOKENS: Final = 2**31 - 1
#: Completions one request may ask for (`n`).
MAX_CHOICES: Final = 128
#: Largest canonical payload, serialised (the HTTP body limit applies too).
MAX_PAYLOAD_BYTES: Final = 1_048_576


class LatencyClass(enum.StrEnum):
    """What the caller expects of the envelope's latency; it sets the admission priority."""

    REALTIME = "realtime"
    STANDARD = "standard"
    BATCH = "batch"

    @property
    def priority(self) -> Priority:
        return _LATENCY_PRIORITY[self]


_LATENCY_PRIORITY: Final = {
    LatencyClass.REALTIME: Priority.INTERACTIVE,
    LatencyClass.STANDARD: Priority.STANDARD,
    LatencyClass.BATCH: Priority.BATCH,
}


class WorkloadState(enum.StrEnum):
    QUEUED = "queued"
    RUNNING = "running"
    STREAMING = "streaming"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"

    @property
    def terminal(self) -> bool:
        return self in {WorkloadState.SUCCEEDED, WorkloadState.FAILED, WorkloadState.CANCELLED}


class Api(enum.StrEnum):
    """Which northbound API a request came through (recorded with its usage)."""

    OPENAI = "openai"
    WORKLOADS = "workloads"
    MESSAGES = "messages"
    RESPONSES = "responses"


# --- the outcome of a call ---------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class CallOutcome:
    """What happened to one call through the gateway, made once when it ended (also when it was
    refused): the usage record, and a workload's receipt, are derived from it. No payload."""

    request_id: str
    workload_id: str | None
    api: Api
    tenant: TenantId
    key_id: KeyId
    capability: Capability
    #: The alias the model was asked for by; empty for a pinned `name:version` or a name never resolved.
    alias: str
    #: The version that served it (or that the name resolved to); None when it never resolved.
    model: ModelRef | None
    #: Empty when the call never reached a replica (refused, queued past its deadline).
    deployment: str
    node_id: str
    canary: bool
    #: `ok`, or the error code the call ended with.
    status: str
    prompt_tokens: int
    completion_tokens: int
    queue_ms: float
    ttft_ms: float | None
    duration_ms: float
    #: Wall-clock Unix seconds at which it ended.
    finished_at: float
    #: Replicas tried.
    attempts: int
    #: A replica answered (its first output, or a clean end) and the caller got the answer to read;
    #: False when the call was refused or failed before that.
    opened: bool
    #: A media call's use in its capability's unit (`MEDIA_UNITS`: seconds of audio, characters of
    #: speech, images); 0 for text calls.
    units: float = 0.0
    #: The LoRA adapter that served it on `model` (the alias's), None for none.
    adapter: ModelRef | None = None

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


# --- the canonical envelope ------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class WorkloadCreate:
    """`POST /api/v1/workloads`: one unit of inference work in the `nexa.v1` envelope.

    The tenant is never part of it: it comes from the inference key.
    """

    version: str
    idempotency_key: str
    workload_id: str
    capability: Capability
    #: An alias name (or `name:version` of an Approved model being served).
    model: str
    #: The OpenAI-shaped request body for the capability, without `model` and `stream`.
    payload: dict[str, object]
    #: The payload's data classification: only replicas on nodes whose inventory lists it in
    #: `data_classes` serve it (503 `no_replica_for_data_class` when none does). None: any node.
    data_class: str | None = None
    #: `ephemeral` (keep nothing), or the name of a retention policy the tenant may use: its
    #: request and answer are then kept encrypted (`contracts.retention`).
    retention: str = EPHEMERAL
    #: Wall-clock Unix seconds; None: the gateway's default deadline. Queue time counts.
    deadline_at: float | None = None
    #: The admission priority; None: the one `latency_class` maps to (realtime → interactive,
    #: standard → standard, batch → batch), else standard. Both given must agree.
    priority: Priority | None = None
    latency_class: LatencyClass | None = None
    #: Answer as server-sent events (`chunk`, then one `end` event) instead of one JSON body.
    #: Embeddings do not stream (refused).
    stream: bool = False

    @property
    def admission_priority(self) -> Priority:
        if self.priority is not None:
            return self.priority
        if self.latency_class is not None:
            return self.latency_class.priority
        return Priority.STANDARD


@attrs.frozen(kw_only=True)
class AcceptedWorkload:
    """A canonical workload as it was accepted: whose, what it asks for, and when; fixed from then
    on. Held while it runs (`control.datapath.workloads.ActiveWorkload`) and stored with its state and
    receipt (`control.store.WorkloadRow`); its receipt names the same ids (`Receipt.from_outcome`)."""

    tenant: TenantId
    workload_id: str
    #: sha256 of the idempotency key (the key itself is the client's).
    idempotency_key_sha256: str
    key_id: KeyId
    capability: Capability
    #: The alias (or `name:version`) it was sent for.
    alias: str
    #: What the client asked for (`WorkloadCreate.model`), as its views name it.
    model: str
    priority: Priority
    accepted_at: float
    #: sha256 of the canonical envelope (`request_sha256`); None: not checked (older rows).
    request_sha256: str | None = None


@attrs.frozen(kw_only=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


def adapter_key(adapter: ModelRef | None) -> str:
    """A LoRA adapter as usage and receipts name it: `name:version` (as `name:version` models are asked for)."""
    return f"{adapter.model}:{adapter.version}" if adapter is not None else ""


@attrs.frozen(kw_only=True)
class Receipt:
    """What the controller attests about one finished workload. Counts and ids only, never payloads."""

    receipt_id: str
    workload_id: str
    #: sha256 of the idempotency key (the key itself is the client's).
    idempotency_key_sha256: str
    tenant: TenantId
    key_id: KeyId
    capability: Capability
    alias: str
    model: str
    model_version: str
    deployment: str
    node_id: str
    state: WorkloadState
    #: The error code when not succeeded.
    error: str | None
    prompt_tokens: int
    completion_tokens: int
    queue_ms: float
    ttft_ms: float | None
    duration_ms: float
    accepted_at: float
    finished_at: float
    controller_epoch: int
    #: The LoRA adapter that served it on `model`, `name:version`; "" for none (then left out of
    #: the signed bytes, as receipts were signed before adapters).
    adapter: str = ""

    @classmethod
    def from_outcome(
        cls,
        outcome: CallOutcome | None,
        *,
        accepted: AcceptedWorkload,
        receipt_id: str,
        state: WorkloadState,
        error: str | None,
        finished_at: float,
        controller_epoch: int,
    ) -> Receipt:
        """The receipt of the `accepted` workload whose call ended with `outcome`. A call no replica
        answered (refused, or failed before any output; or no call at all: None) attests no model
        and no figures: the receipt names the workload and how it ended only."""
        served = outcome if outcome is not None and outcome.opened else None
        model = served.model if served is not None else None
        return cls(
            receipt_id=receipt_id,
            workload_id=accepted.workload_id,
            idempotency_key_sha256=accepted.idempotency_key_sha256,
            tenant=accepted.tenant,
            key_id=accepted.key_id,
            capability=accepted.capability,
            alias=served.alias if served is not None else "",
            model=model.model if model is not None else UNRESOLVED_MODEL,
            model_version=model.version if model is not None else "",
            deployment=served.deployment if served is not None else "",
            node_id=served.node_id if served is not None else "",
            state=state,
            error=error,
            prompt_tokens=served.prompt_tokens if served is not None else 0,
            completion_tokens=served.completion_tokens if served is not None else 0,
            queue_ms=served.queue_ms if served is not None else 0.0,
            ttft_ms=served.ttft_ms if served is not None else None,
            duration_ms=served.duration_ms if served is not None else 0.0,
            accepted_at=accepted.accepted_at,
            finished_at=finished_at,
            controller_epoch=controller_epoch,
            adapter=adapter_key(served.adapter if served is not None else None),
        )


@attrs.frozen(kw_only=True)
class SignedReceipt:
    """A receipt and the controller's Ed25519 signature over its canonical JSON (`codec.wire`).

    `nexa receipts verify FILE` checks it offline with the controller's public key.
    """

    receipt: Receipt
    #: base64 Ed25519 signature over `b"nexa.receipt.v1\\0" + canonical JSON of receipt`.
    signature: str
    #: The signing key's public half (base64) — verify against the controller's published key, not this.
    public_key: str
    #: `security.key_id` of that key (outside the signed receipt): picks it among the controller's
    #: current and retired keys; "" in receipts signed before keys had ids.
    key_id: str = ""


@attrs.frozen(kw_only=True)
class WorkloadView:
    """`GET /api/v1/workloads/{id}`, an item of `GET /api/v1/workloads`, and the answer to `POST /api/v1/workloads`."""

    version: str
    workload_id: str
    state: WorkloadState
    model: str
    priority: Priority
    accepted_at: float
    finished_at: float | None = None
    error: str | None = None
    usage: Usage | None = None
    #: The runtime's answer (unary requests, in the POST response only: never stored).
    output: dict[str, object] | None = None
    receipt: SignedReceipt | None = None

    @classmethod
    def of(cls, accepted: AcceptedWorkload, state: WorkloadState, receipt: SignedReceipt | None = None) -> WorkloadView:
        """An accepted workload in `state`: as its signed receipt tells it once it has one."""
        if receipt is not None:
            return cls.from_receipt(receipt, model=accepted.model, priority=accepted.priority)
        return cls(
            version=API_VERSION,
            workload_id=accepted.workload_id,
            state=state,
            model=accepted.model,
            priority=accepted.priority,
            accepted_at=accepted.accepted_at,
        )

    @classmethod
    def from_receipt(cls, signed: SignedReceipt, *, model: str, priority: Priority) -> WorkloadView:
        """A finished workload as its signed receipt tells it (`model`: what the client asked for)."""
        r = signed.receipt
        return cls(
            version=API_VERSION,
            workload_id=r.workload_id,
            state=r.state,
            model=model,
            priority=priority,
            accepted_at=r.accepted_at,
            finished_at=r.finished_at,
            error=r.error,
            usage=Usage(prompt_tokens=r.prompt_tokens, completion_tokens=r.completion_tokens),
            receipt=signed,
        )


@attrs.frozen(kw_only=True)
class WorkloadList:
    """`GET /api/v1/workloads`: a page of the caller's tenant's workloads, oldest accepted first."""

    workloads: list[WorkloadView]
    #: The cursor of the next page (`contracts.pages`); None at the end.
    next_cursor: str | None = None


# --- metering ----------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class UsageRecord:
    """One finished request, as metering writes it (in batches, at least every `metering_flush_s`)."""

    request_id: str
    workload_id: str | None
    api: Api
    tenant: TenantId
    key_id: KeyId
    capability: Capability
    alias: str
    model: str
    model_version: str
    #: Empty when the request never reached a replica (refused, queued past its deadline).
    deployment: str
    node_id: str
    #: `ok`, or the error code it ended with.
    status: str
    prompt_tokens: int
    completion_tokens: int
    queue_ms: float
    ttft_ms: float | None
    duration_ms: float
    #: Wall-clock Unix seconds at which it finished.
    finished_at: float
    #: Replica the request was served by was the deployment's canary.
    canary: bool = False
    #: A media request's use in its capability's unit (`MEDIA_UNITS`); 0 for text requests.
    units: float = 0.0
    #: The LoRA adapter that served it on the model, `name:version`; "" for none.
    adapter: str = ""

    @classmethod
    def from_outcome(cls, outcome: CallOutcome) -> UsageRecord:
        ref = outcome.model
        return cls(
            request_id=outcome.request_id,
            workload_id=outcome.workload_id,
            api=outcome.api,
            tenant=outcome.tenant,
            key_id=outcome.key_id,
            capability=outcome.capability,
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
            finished_at=outcome.finished_at,
            canary=outcome.canary,
            units=outcome.units,
            adapter=adapter_key(outcome.adapter),
        )


# --- OpenAI-shaped errors ----------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class OpenAIErrorBody:
    message: str
    type: str
    code: str
    param: str | None = None


@attrs.frozen(kw_only=True)
class OpenAIError:
    """The error shape of OpenAI's API, so its SDKs raise their usual exceptions."""

    error: OpenAIErrorBody


@attrs.frozen(kw_only=True)
class AnthropicErrorBody:
    #: invalid_request_error, authentication_error, permission_error, not_found_error,
    #: request_too_large, rate_limit_error, api_error or overloaded_error.
    type: str
    message: str


@attrs.frozen(kw_only=True)
class AnthropicError:
    """The error shape of Anthropic's API (on `/v1/messages`), so its SDKs raise their usual exceptions."""

    error: AnthropicErrorBody
    request_id: str
    type: str = "error"


# --- validation --------------------------------------------------------------------------------------


def workload_problems(req: WorkloadCreate) -> list[str]:
    """Everything wrong with an envelope's shape (not whether the model is served or the quota allows)."""
    problems = []
    if req.version != API_VERSION:
        problems.append(f"version: must be {API_VERSION}")
    if not IDENT_RE.match(req.idempotency_key):
        problems.append("idempotency_key: 1 to 256 characters of A-Z a-z 0-9 . _ : @ / + = -")
    if not WORKLOAD_ID_RE.match(req.workload_id):
        problems.append("workload_id: 1 to 256 characters of A-Z a-z 0-9 . _ : @ + = - (no /)")
    problem = model_problem(req.model)
    if problem is not None:
        problems.append(problem)
    if req.capability.native:
        problems.append(f"capability: {req.capability.value} is served at {req.capability.path}, not as a workload")
    if (problem := retention_problem(req.retention)) is not None:
        problems.append(problem)
    if "model" in req.payload or "stream" in req.payload:
        problems.append("payload: must not hold `model` or `stream` (they are envelope fields)")
    if "stream_options" in req.payload:
        problems.append("payload.stream_options: set by the gateway (streams always end with the usage)")
    if req.deadline_at is not None and (not math.isfinite(req.deadline_at) or req.deadline_at <= 0):
        problems.append("deadline_at: Unix seconds, in the future")
    if req.data_class is not None and (problem := data_class_problem(req.data_class)) is not None:
        problems.append(f"data_class: {problem}")
    if req.priority is not None and req.latency_class is not None and req.latency_class.priority is not req.priority:
        problems.append(
            f"latency_class: {req.latency_class.value} means priority {req.latency_class.priority.value},"
            f" not {req.priority.value} (send one of them, or both agreeing)"
        )
    if req.capability.media:
        problems.append(f"capability: {req.capability.value} is served on {req.capability.path} only")
    problems += [f"payload.{p}" for p in body_problems(req.capability, req.payload)]
    return problems


def model_problem(model: object) -> str | None:
    """Why `model` is not an alias or `name:version` the inference routes take, or None."""
    if not isinstance(model, str) or not model:
        return "model: the alias to use is required"
    if len(model) > MAX_MODEL_CHARS:
        return f"model: at most {MAX_MODEL_CHARS} characters"
    return None


def body_problems(capability: Capability, body: dict[str, object]) -> list[str]:
    """What the gateway refuses in an OpenAI-shaped body: non-finite numbers anywhere (JSON has
    none; Python's parser accepts NaN and Infinity), and token figures it reserves quota by."""
    problems = [f"{path}: a finite number (not NaN or Infinity)" for path in _nonfinite(body)]
    if capability.streams:
        for name in ("max_tokens", "max_completion_tokens"):
            value = body.get(name)
            if value is not None and not _int_in(value, 1, MAX_REQUEST_TOKENS):
                problems.append(f"{name}: an integer from 1 to {MAX_REQUEST_TOKENS}")
        n = body.get("n")
        if n is not None and not _int_in(n, 1, MAX_CHOICES):
            problems.append(f"n: an integer from 1 to {MAX_CHOICES}")
    return problems + _pooling_problems(capability, body)


def _pooling_problems(capability: Capability, body: dict[str, object]) -> list[str]:
    """What a rerank, score, tokenize or detokenize body lacks (checked before it is routed; the
    runtime checks the rest)."""
    out = []
    if capability is Capability.RERANK:
        if not isinstance(body.get("query"), str):
            out.append("query: a string")
        documents = body.get("documents")
        if not isinstance(documents, list) or not documents:
            out.append("documents: a non-empty list")
        top_n = body.get("top_n")
        if top_n is not None and not _int_in(top_n, 0, MAX_REQUEST_TOKENS):
            out.append("top_n: an integer, 0 or more")
    elif capability is Capability.SCORE:
        out += [
            f"{name}: a string or a list" for name in ("text_1", "text_2") if not isinstance(body.get(name), str | list)
        ]
    elif capability is Capability.TOKENIZE:
        if not any(isinstance(body.get(name), str | list) for name in ("prompt", "messages", "content")):
            out.append("prompt: a string (or messages, a list; llama.cpp's content)")
    elif capability is Capability.DETOKENIZE:
        tokens = body.get("tokens")
        if not isinstance(tokens, list) or not all(_int_in(t, 0, MAX_REQUEST_TOKENS) for t in tokens):
            out.append("tokens: a list of token ids (integers, 0 or more)")
    return out


def _int_in(value: object, low: int, high: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and low <= value <= high


def _nonfinite(body: object) -> list[str]:
    """Paths of the non-finite floats in parsed JSON; iterative, so depth cannot exhaust the stack."""
    out: list[str] = []
    todo: list[tuple[str, object]] = [("(body)", body)]
    while todo:
        path, value = todo.pop()
        if isinstance(value, float) and not math.isfinite(value):
            out.append(path.removeprefix("(body)."))
        elif isinstance(value, dict):
            todo += [(f"{path}.{k}", v) for k, v in value.items()]
        elif isinstance(value, list):
            todo += [(f"{path}[{i}]", v) for i, v in enumerate(value)]
    return sorted(out)


def token_reservation(capability: Capability, body: dict[str, object], *, default_completion: int) -> int:
    """Tokens a request is counted for against its tenant's token quotas while it runs: about one
    per four characters of its prompt (or embedding input), plus the completion it may produce
    (`max_completion_tokens`, else `max_tokens`, else `default_completion`, times `n`). Settled
    to the runtime's usage when it finishes."""
    if capability is Capability.EMBEDDING:
        return _chars(body.get("input")) // 4 + 1
    if capability.media:
        return 0  # counted in its own units (`MEDIA_UNITS`)
    if capability is Capability.DETOKENIZE:
        return _listed(body.get("tokens")) + 1
    if not capability.streams:  # rerank, score, tokenize: every string of the body is read, nothing made
        return _chars(body) // 4 + 1
    prompt = _prompt_of(capability, body)
    asked = body.get("max_completion_tokens") or body.get("max_tokens") or body.get("max_output_tokens")
    completion = asked if isinstance(asked, int) and _int_in(asked, 1, MAX_REQUEST_TOKENS) else default_completion
    choices = body.get("n")
    n = choices if isinstance(choices, int) and _int_in(choices, 1, MAX_CHOICES) else 1
    return _chars(prompt) // 4 + 1 + completion * n


#: What a chat template adds around each message and the prompt (role tokens, separators, a system
#: preamble), in tokens: generous, so that only a count no tokenizer could produce is clamped.
_TEMPLATE_TOKENS_PER_MESSAGE: Final = 64
_TEMPLATE_TOKENS: Final = 1024


def usage_bounds(capability: Capability, body: dict[str, object]) -> tuple[int, int]:
    """The most (prompt, completion) tokens a request could produce: a tokenizer makes at most one
    token per byte of the prompt (plus a chat template's own tokens); the completion is at most what
    the request allowed (`max_completion_tokens`, else `max_tokens`, times `n`), or the largest count
    a request may ask for when it set none. Usage a runtime or node reports above them is clamped."""
    if capability is Capability.EMBEDDING:
        return _bytes(body.get("input")) + _TEMPLATE_TOKENS, 0
    if capability.media:
        # Metered in its own units; the tokens some media runtimes report (vLLM's Whisper) are kept as told.
        return MAX_REQUEST_TOKENS, MAX_REQUEST_TOKENS
    if capability is Capability.DETOKENIZE:
        return _listed(body.get("tokens")), 0
    if not capability.streams:  # rerank, score (a template around each pair), tokenize
        pairs = _listed(body.get("documents")) + _listed(body.get("text_2")) + _listed(body.get("messages"))
        return _bytes(body) + (1 + pairs) * _TEMPLATE_TOKENS_PER_MESSAGE + _TEMPLATE_TOKENS, 0
    prompt = _prompt_of(capability, body)
    messages = len(prompt) if isinstance(prompt, list) else 1
    prompt_max = _bytes(prompt) + messages * _TEMPLATE_TOKENS_PER_MESSAGE + _TEMPLATE_TOKENS
    if capability.native:  # a system prompt, instructions and tool definitions beside the messages
        prompt_max += _bytes({k: v for k, v in body.items() if k not in ("messages", "input")})
    asked = body.get("max_completion_tokens") or body.get("max_tokens") or body.get("max_output_tokens")
    completion = asked if isinstance(asked, int) and _int_in(asked, 1, MAX_REQUEST_TOKENS) else MAX_REQUEST_TOKENS
    choices = body.get("n")
    n = choices if isinstance(choices, int) and _int_in(choices, 1, MAX_CHOICES) else 1
    return prompt_max, completion * n


def _prompt_of(capability: Capability, body: dict[str, object]) -> object:
    """What a generating request's prompt is: completions' `prompt`, the Responses API's `input`,
    otherwise `messages`."""
    name = {Capability.COMPLETION: "prompt", Capability.RESPONSES: "input"}.get(capability, "messages")
    return body.get(name)


def _listed(value: object) -> int:
    """Items of a JSON list (0 for anything else)."""
    return len(value) if isinstance(value, list) else 0


def _bytes(value: object) -> int:
    """UTF-8 bytes of the strings in parsed JSON (at most 4 a character)."""
    return 4 * _chars(value)


def _chars(value: object) -> int:
    """Characters of the strings in parsed JSON (what a prompt's length is estimated from)."""
    total = 0
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, str):
            total += len(item)
        elif isinstance(item, dict):
            todo += item.values()
        elif isinstance(item, list):
            todo += item
    return total


def request_sha256(req: WorkloadCreate) -> str:
    """The digest stored with an idempotency key: sha256 of the envelope's canonical JSON, so a
    replay with another body is told apart (call after `workload_problems`: no NaN left)."""
    return hashlib.sha256(codec.dumps(codec.api, req).encode()).hexdigest()
