"""The inference gateway's records: the canonical envelope, workloads, receipts, usage and quotas.

Pure data and validation; no I/O. Both northbound APIs (OpenAI-compatible `/v1/*` and the
canonical `/api/v1/workloads`) become one `Work` item for the one pipeline in
`control/gateway.py`. Payloads (prompts, outputs) pass through as opaque JSON and never appear in
any record defined here: usage records and receipts carry counts, ids and timings only.
"""

from __future__ import annotations

import enum
import re
from typing import Final

import attrs

from nexa.contracts.domain import KeyId, TenantId

#: The canonical envelope's version; anything else is refused.
API_VERSION: Final = "nexa.v1"
#: Idempotency keys and workload ids: opaque, printable, at most 256 characters.
IDENT_RE: Final = re.compile(r"^[A-Za-z0-9._:@/+=-]{1,256}$")
#: Largest canonical payload, serialised (the HTTP body limit applies too).
MAX_PAYLOAD_BYTES: Final = 1_048_576


class Capability(enum.StrEnum):
    """What a request asks of a model; each maps to one OpenAI-compatible runtime path."""

    CHAT = "chat"
    COMPLETION = "completion"
    EMBEDDING = "embedding"

    @property
    def path(self) -> str:
        return _PATHS[self]


_PATHS: Final = {
    Capability.CHAT: "/v1/chat/completions",
    Capability.COMPLETION: "/v1/completions",
    Capability.EMBEDDING: "/v1/embeddings",
}


class Priority(enum.StrEnum):
    """Admission order: every queued `interactive` request goes before any `standard`, and so on."""

    INTERACTIVE = "interactive"
    STANDARD = "standard"
    BATCH = "batch"

    @property
    def rank(self) -> int:
        return _RANKS[self]


_RANKS: Final = {Priority.INTERACTIVE: 0, Priority.STANDARD: 1, Priority.BATCH: 2}


class LatencyClass(enum.StrEnum):
    """What the caller expects; recorded with usage (routing treats all alike for now)."""

    REALTIME = "realtime"
    STANDARD = "standard"
    BATCH = "batch"


class Retention(enum.StrEnum):
    """What may be kept of a request's payload. Only `ephemeral` is served without an encrypted
    retention store (none is configured in this version: the others are refused)."""

    EPHEMERAL = "ephemeral"
    RETAIN_UNTIL = "retain_until"
    EVALUATION_CAPTURE = "evaluation_capture"


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
    data_class: str = "internal"
    retention: Retention = Retention.EPHEMERAL
    #: Wall-clock Unix seconds; None: the gateway's default deadline. Queue time counts.
    deadline_at: float | None = None
    priority: Priority = Priority.STANDARD
    latency_class: LatencyClass = LatencyClass.STANDARD
    #: Answer as server-sent events (`chunk`, then one `end` event) instead of one JSON body.
    stream: bool = False


@attrs.frozen(kw_only=True)
class Usage:
    prompt_tokens: int = 0
    completion_tokens: int = 0

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


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


@attrs.frozen(kw_only=True)
class WorkloadView:
    """`GET /api/v1/workloads/{id}` and the answer to `POST /api/v1/workloads`."""

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


@attrs.frozen(kw_only=True)
class WindowStats:
    """Finished requests of one deployment (its canary replicas, or the others) over a recent window."""

    requests: int
    errors: int
    #: None when there were no requests.
    p95_ms: float | None

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


@attrs.frozen(kw_only=True)
class UsageRow:
    """`GET /api/v1/usage`: one (tenant, model, UTC day) group."""

    tenant: TenantId
    model: str
    day: str
    requests: int
    errors: int
    prompt_tokens: int
    completion_tokens: int


@attrs.frozen(kw_only=True)
class UsageReport:
    since: float
    until: float
    rows: list[UsageRow]


# --- quotas ------------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class QuotaLimits:
    """`PUT /api/v1/quotas/{tenant}`. None: no limit of that kind. A tenant with no record has none."""

    concurrent_requests: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    tokens_per_day: int | None = None


@attrs.frozen(kw_only=True)
class QuotaUse:
    concurrent_requests: int
    #: Over the last 60 s (sliding), and since 00:00 UTC.
    requests_last_minute: int
    tokens_last_minute: int
    tokens_today: int


@attrs.frozen(kw_only=True)
class QuotaView:
    tenant: TenantId
    limits: QuotaLimits
    use: QuotaUse
    updated_at: float | None = None
    updated_by: KeyId | None = None


@attrs.frozen(kw_only=True)
class QuotaList:
    quotas: list[QuotaView]


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


# --- validation --------------------------------------------------------------------------------------


def quota_problems(limits: QuotaLimits) -> list[str]:
    return [
        f"{name}: a positive integer, or null for no limit"
        for name, value in attrs.asdict(limits).items()
        if value is not None and (isinstance(value, bool) or value < 1)
    ]


def workload_problems(req: WorkloadCreate) -> list[str]:
    """Everything wrong with an envelope's shape (not whether the model is served or the quota allows)."""
    problems = []
    if req.version != API_VERSION:
        problems.append(f"version: must be {API_VERSION}")
    for field in ("idempotency_key", "workload_id"):
        if not IDENT_RE.match(getattr(req, field)):
            problems.append(f"{field}: 1 to 256 characters of A-Z a-z 0-9 . _ : @ / + = -")
    if not req.model or len(req.model) > 256:
        problems.append("model: an alias name")
    if "model" in req.payload or "stream" in req.payload:
        problems.append("payload: must not hold `model` or `stream` (they are envelope fields)")
    if req.deadline_at is not None and req.deadline_at <= 0:
        problems.append("deadline_at: Unix seconds, in the future")
    return problems
