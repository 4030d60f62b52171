"""Southbound controller⇄node messages: the bodies carried by the node channel. Pure data.

On the wire each message is three frames, `[kind, body, signature]`: `kind` is the class's
`kind` below, `body` its canonical JSON (`codec.wire_sent`: fields at their defaults left out), and
the signature is the sender's Ed25519 signature over `kind NUL body` (`nexa.security`). Every kind
here is signed.

Releases mix: a peer refuses a field it does not know, and every field added to these records has
a default that means "not used", which is never written. So a controller and nodes of neighbouring
releases read each other's messages, whichever is upgraded first, as long as no message uses what
the older side lacks (a new feature is used once both sides run it; a message that does use it is
refused by the older side, as a `ContractError` naming the field). `Hello.protocol` is always sent.

Node → controller messages carry `seq` and `ts` for the receiver's replay window; controller
→ node desired state is fenced by `(epoch, generation)` and a lease instead.

The data path (inference) uses four-frame messages `[kind, request_id, head, body]` of the
kinds in `DATA_KINDS`, multiplexed by request id. They are not Ed25519-signed: CurveZMQ already
authenticates and encrypts every message of the channel (the controller knows the node from its
Curve key through ZAP, the node pinned the controller's Curve key), and signing each stream chunk
would cost more than relaying it. `head` is canonical JSON of the kind's head class (read and
written by `nexa.contracts.heads`, msgspec's compiled codec, as `codec.wire` would; empty for
`chunk`, but for a stream's first: `ChunkHead`); `body` is opaque bytes (the runtime request for
`infer`, runtime output for `chunk`). A node joins the data messages it has queued at once into
one zmq message of several such groups of four, in order (`nexa.channel.framing.decode_data_batch`).

Liveness (`LIVENESS`) is the third shape, node → controller only: `[alive, node_id, state_seq]`,
not signed either (CurveZMQ authenticates it as it does data frames; `node_id` must be the
channel's). It says only "this node's agent runs and its channel works" and changes nothing the
node reports: `state_seq` is the `seq` of the last signed `Heartbeat` (the node's state) it sent,
so that a controller that missed that state asks for it again (`StateRequest`).
"""

from __future__ import annotations

import enum
from typing import ClassVar, Final

import attrs

from nexa.contracts.bounds import MAX_BYTES, MAX_MS, MAX_SEQ, MAX_TOKENS, MAX_UNIX_S, finite, whole
from nexa.contracts.node import NodeInventory
from nexa.contracts.runtime import LoraSpec, RuntimeSpec

#: What this release's node takes, sent in every `Hello`: each level adds something a controller
#: may then send that node, and takes nothing away (neighbouring releases read each other's
#: messages by the rule above). 1: all before levels were counted. 2: adapters given at run time
#: (`Assignment.loras`, `RuntimeSpec.live_loras`); a node below gets its adapters in the spec.
PROTOCOL_VERSION: Final = 2
#: The first level whose nodes take adapters at run time.
LIVE_LORAS_PROTOCOL: Final = 2
#: The most accelerators one node reports.
MAX_GPUS: Final = 4096
#: The largest flow-control window (chunks) and credit one frame carries.
MAX_WINDOW: Final = 1 << 20
#: The largest accepted set a node attaches as its epoch's proof (bytes of its body); a larger
#: one is not attached (its epoch then counts only within what the controller issued).
MAX_PROOF_BYTES: Final = 32 * 1024
#: An Ed25519 signature in base64, with room to spare.
MAX_SIGNATURE_CHARS: Final = 128
#: The longest state interval a node may announce (`Heartbeat.state_interval_s`).
MAX_STATE_INTERVAL_S: Final = 3600.0


class RuntimeState(enum.StrEnum):
    """What a node observes about one assignment's runtime (`Failed` carries a reason)."""

    PENDING = "Pending"
    PULLING = "Pulling"
    FETCHING = "Fetching"
    STARTING = "Starting"
    READY = "Ready"
    UNHEALTHY = "Unhealthy"
    FAILED = "Failed"
    STOPPED = "Stopped"


#: `AssignmentStatus.reason` of a Ready runtime whose own sleep failed (it is awake).
SLEEP_FAILED: Final = "sleep_failed"


class RejectReason(enum.StrEnum):
    """Why a node refused an assignment set (sent back in its Ack and counted on both sides)."""

    WRONG_NODE = "wrong_node"
    STALE_EPOCH = "stale_epoch"
    STALE_GENERATION = "stale_generation"
    LEASE_EXPIRED = "lease_expired"


#: Most buckets one reported latency histogram keeps (vLLM's TTFT histogram has 18).
MAX_HISTOGRAM_BUCKETS: Final = 64
#: Longest reason a node gives for a failed metrics scrape.
METRICS_ERROR_MAX: Final = 200
#: Largest count or queue a runtime may report (figures above it are refused as nonsense).
MAX_COUNT: Final = float(2**53)


def _latency_bounds(instance: LatencyHistogram, attribute: attrs.Attribute[object], value: object) -> None:
    if not isinstance(value, tuple) or len(value) > MAX_HISTOGRAM_BUCKETS:
        raise ValueError(f"{attribute.name} must be at most {MAX_HISTOGRAM_BUCKETS} bucket bounds")
    check = finite(0.0, MAX_MS)
    previous = -1.0
    for bound in value:
        check(instance, attribute, bound)
        if bound <= previous:
            raise ValueError(f"{attribute.name} must increase")
        previous = bound


def _cumulative_counts(instance: LatencyHistogram, attribute: attrs.Attribute[object], value: object) -> None:
    if not isinstance(value, tuple) or len(value) != len(instance.bounds):
        raise ValueError(f"{attribute.name} must have one count per bound")
    check = finite(0.0, MAX_COUNT)
    previous = 0.0
    for count in value:
        check(instance, attribute, count)
        if count < previous:
            raise ValueError(f"{attribute.name} must be cumulative (never decrease)")
        previous = count


@attrs.frozen(kw_only=True)
class LatencyHistogram:
    """A runtime's own cumulative latency histogram, as its metrics endpoint last showed it.

    `bounds` are the finite `le` upper bounds in seconds, increasing; `counts[i]` the observations
    at or under `bounds[i]` (cumulative, as Prometheus counts them); `count` all observations (the
    `+Inf` bucket) and `sum` their total in seconds. Counted since the runtime started.
    """

    bounds: tuple[float, ...] = attrs.field(validator=_latency_bounds)
    counts: tuple[float, ...] = attrs.field(validator=_cumulative_counts)
    count: float = attrs.field(validator=finite(0.0, MAX_COUNT))
    sum: float = attrs.field(validator=finite(0.0, MAX_MS))

    def __attrs_post_init__(self) -> None:
        if self.counts and self.counts[-1] > self.count:
            raise ValueError("count must be at least the last bucket's count")


@attrs.frozen(kw_only=True)
class RuntimeLoad:
    """What one Ready replica's runtime said on its metrics endpoint (the adapter names it and the
    series): node → controller in every heartbeat, for export and for routing.

    `ok` False: the last scrape failed (`error` says why) and no figure is sent; the replica stays
    Ready (a metrics endpoint never decides readiness). A figure is None where the runtime does not
    export it. `age_s` is how old the figures were when the heartbeat was made, so the controller
    can tell fresh from stale without comparing clocks.
    """

    ok: bool
    age_s: float = attrs.field(validator=finite(0.0, MAX_MS))
    error: str = attrs.field(default="", validator=attrs.validators.max_len(METRICS_ERROR_MAX))
    #: Requests the runtime holds waiting for a batch slot.
    queue_depth: float | None = attrs.field(default=None, validator=finite(0.0, MAX_COUNT, optional=True))
    #: Requests the runtime is working on.
    running: float | None = attrs.field(default=None, validator=finite(0.0, MAX_COUNT, optional=True))
    #: KV-cache use, 0..1.
    kv_cache_ratio: float | None = attrs.field(default=None, validator=finite(0.0, 1.0, optional=True))
    #: Share of prompt tokens served from the prefix cache, 0..1 (over the runtime's lifetime).
    prefix_cache_hit_ratio: float | None = attrs.field(default=None, validator=finite(0.0, 1.0, optional=True))
    #: Time to first token and time per output token (seconds), where the runtime has them.
    ttft: LatencyHistogram | None = None
    tpot: LatencyHistogram | None = None


@attrs.frozen(kw_only=True)
class CacheDisk:
    """The node's artifact cache: what it holds and the room left on its filesystem (bytes)."""

    used_bytes: int = attrs.field(validator=whole(0, MAX_BYTES))
    free_bytes: int = attrs.field(validator=whole(0, MAX_BYTES))
    total_bytes: int = attrs.field(validator=whole(0, MAX_BYTES))


@attrs.frozen(kw_only=True)
class RuntimeCacheDisk:
    """The replicas' writable caches (`node.runtime_cache`): their bytes on disk, the bound they are
    evicted to, how many directories there are and how many replicas hold, the filesystem's room."""

    used_bytes: int = attrs.field(validator=whole(0, MAX_BYTES))
    max_bytes: int = attrs.field(validator=whole(0, MAX_BYTES))
    directories: int = attrs.field(validator=whole(0, MAX_SEQ))
    in_use: int = attrs.field(validator=whole(0, MAX_SEQ))
    free_bytes: int = attrs.field(validator=whole(0, MAX_BYTES))
    total_bytes: int = attrs.field(validator=whole(0, MAX_BYTES))


@attrs.frozen(kw_only=True)
class ReplicaMemory:
    """What one replica was measured to hold on its node (bytes; None: not measurable there).

    `measured_bytes` is the largest of the others: the container's cgroup memory (less its
    inactive page cache, as `docker stats` counts it), the GPU memory nvidia-smi reports for its
    processes (discrete GPUs), and, on a unified-memory node, the drop in the host's MemAvailable
    from the start to Ready (what its GPU allocations took from the shared pool, which the cgroup
    does not see).
    """

    measured_bytes: int = attrs.field(validator=whole(0, MAX_BYTES))
    cgroup_bytes: int | None = attrs.field(default=None, validator=whole(0, MAX_BYTES, optional=True))
    gpu_bytes: int | None = attrs.field(default=None, validator=whole(0, MAX_BYTES, optional=True))
    available_drop_bytes: int | None = attrs.field(default=None, validator=whole(0, MAX_BYTES, optional=True))


@attrs.frozen(kw_only=True)
class MemoryPressure:
    """A unified-memory node whose MemAvailable is under its `[memory] pressure_floor_bytes`."""

    available_bytes: int = attrs.field(validator=whole(0, MAX_BYTES))
    floor_bytes: int = attrs.field(validator=whole(0, MAX_BYTES))

    def describe(self) -> str:
        """Both figures, in words (the scheduler's explanation and the audit event say this)."""
        gib = 1024**3
        return (
            f"memory pressure: MemAvailable {self.available_bytes / gib:.2f} GiB is under the node's "
            f"floor of {self.floor_bytes / gib:.2f} GiB"
        )


#: The `AssignmentStatus.reason` of a replica the node's memory-pressure guard stopped.
MEMORY_PRESSURE: Final = "memory_pressure"


@attrs.frozen(kw_only=True)
class AssignmentStatus:
    """One assignment as the node sees it, reported in every heartbeat."""

    assignment_id: str
    state: RuntimeState
    detail: str = ""
    #: Stable machine reason for `Failed` (e.g. `artifact_digest_mismatch`, `insufficient_disk`,
    #: `image_not_found`, `crash_loop`, `runtime_program_missing`); on `Ready`, `sleep_failed`:
    #: the runtime's own sleep failed and it is awake.
    reason: str | None = None
    #: Restarts after crashes since the assignment was accepted.
    restarts: int = attrs.field(default=0, validator=whole(0, MAX_TOKENS))
    #: The runtime's own load figures (Ready replicas whose adapter has a metrics endpoint; None
    #: otherwise, and from agents before telemetry).
    load: RuntimeLoad | None = None
    #: What the replica was measured to hold (None until measured, and from older agents).
    memory: ReplicaMemory | None = None
    #: The runtime answered that it sleeps (its own sleep: `Assignment.asleep`); never routed then.
    asleep: bool = False


@attrs.frozen(kw_only=True)
class Assignment:
    """One unit of desired state for a node: a runtime replica of a deployment."""

    id: str
    deployment: str
    runtime: RuntimeSpec
    #: Put the runtime to sleep with its own sleep (`adapters.native_sleep_for`), keeping its
    #: container; False: awake. Not part of the spec: changing it never restarts the container.
    asleep: bool = False
    #: The LoRA adapters a runtime that loads them at run time (`RuntimeSpec.live_loras`) may load
    #: now, by the name a request uses (`<alias>@<version>`). Not part of the spec either: a new
    #: adapter version given beside the earlier one, or an earlier one taken away, keeps the
    #: container; the node unloads from the runtime what is no longer given.
    loras: list[LoraSpec] = attrs.field(factory=list)


@attrs.frozen(kw_only=True)
class DesiredAssignments:
    """What the controller wants one node to run, and the last answer the node gave (controller side)."""

    node_id: str
    generation: int
    assignments: list[Assignment] = attrs.field(factory=list)
    acked_epoch: int = 0
    acked_generation: int = 0
    ack_reason: RejectReason | None = None
    ack_at: float | None = None


# --- node → controller --------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class Hello:
    """First message on a (re)connected channel: who the node is and what it last accepted."""

    kind: ClassVar[str] = "hello"
    #: Sent even at its default (`codec.wire_sent`): a controller must never take its own for it.
    ALWAYS_SENT: ClassVar[tuple[str, ...]] = ("protocol",)

    node_id: str
    seq: int = attrs.field(validator=whole(0, MAX_SEQ))
    ts: float = attrs.field(validator=finite(0.0, MAX_UNIX_S))
    agent_version: str
    protocol: int = attrs.field(default=PROTOCOL_VERSION, validator=whole(0, MAX_TOKENS))
    #: Highest (epoch, generation) of an assignment set the node accepted; (0, 0) if none.
    epoch: int = attrs.field(default=0, validator=whole(0, MAX_SEQ))
    generation: int = attrs.field(default=0, validator=whole(0, MAX_SEQ))
    #: The id (`PublicKey.fingerprint`) of the controller signing key the node pins as current;
    #: "" from agents before it was sent. A retired key here, once its overlap has ended, marks
    #: the node as needing re-enrollment.
    controller_key_id: str = ""
    #: The proof of (epoch, generation): the signed `AssignmentSet` the node accepted there, as it
    #: came (its body, and the controller's signature over it in base64). "" from older agents and
    #: for a set over `MAX_PROOF_BYTES`. The controller trusts an epoch above what it issued only
    #: with a proof that one of its signing keys, current or retired, verifies (`control.fleet.claims`).
    proof_set: str = attrs.field(default="", validator=attrs.validators.max_len(MAX_PROOF_BYTES))
    proof_signature: str = attrs.field(default="", validator=attrs.validators.max_len(MAX_SIGNATURE_CHARS))


@attrs.frozen(kw_only=True)
class Heartbeat:
    """Periodic liveness, capacity and per-assignment runtime state."""

    kind: ClassVar[str] = "heartbeat"

    node_id: str
    seq: int = attrs.field(validator=whole(0, MAX_SEQ))
    ts: float = attrs.field(validator=finite(0.0, MAX_UNIX_S))
    inventory: NodeInventory
    free_memory_bytes: int = attrs.field(validator=whole(0, MAX_BYTES))
    free_accelerators: int = attrs.field(validator=whole(0, MAX_GPUS))
    assignments: list[AssignmentStatus] = attrs.field(factory=list)
    #: Highest (epoch, generation) the node accepted, so the controller can re-push a newer set.
    epoch: int = attrs.field(default=0, validator=whole(0, MAX_SEQ))
    generation: int = attrs.field(default=0, validator=whole(0, MAX_SEQ))
    #: As in `Hello`: the controller key the node pins as current ("" from older agents).
    controller_key_id: str = ""
    #: The artifact cache's disk (None from older agents, or when the cache cannot be measured).
    cache_disk: CacheDisk | None = None
    #: The replicas' writable caches (None from older agents, or before they are first measured).
    runtime_cache: RuntimeCacheDisk | None = None
    #: Set while the node is under memory pressure: the controller places nothing more on it.
    memory_pressure: MemoryPressure | None = None
    #: Replicas the memory-pressure guard stopped since the agent started.
    memory_pressure_stops: int = attrs.field(default=0, validator=whole(0, MAX_TOKENS))
    #: As in `Hello`: the signed set behind (epoch, generation), so that a controller restored from
    #: an older backup while the agent kept running can trust it.
    proof_set: str = attrs.field(default="", validator=attrs.validators.max_len(MAX_PROOF_BYTES))
    proof_signature: str = attrs.field(default="", validator=attrs.validators.max_len(MAX_SIGNATURE_CHARS))
    #: The longest the node goes without sending its state again (`[node] state_interval_s`); the
    #: controller holds this state current that long plus its lease. 0 (agents before liveness was
    #: split from state, which sent it with every beat): only for the lease, as before.
    state_interval_s: float = attrs.field(default=0.0, validator=finite(0.0, MAX_STATE_INTERVAL_S))


@attrs.frozen(kw_only=True)
class Ack:
    """The node's answer to an assignment set: accepted, or refused with a reason."""

    kind: ClassVar[str] = "ack"

    node_id: str
    seq: int = attrs.field(validator=whole(0, MAX_SEQ))
    ts: float = attrs.field(validator=finite(0.0, MAX_UNIX_S))
    epoch: int = attrs.field(validator=whole(0, MAX_SEQ))
    generation: int = attrs.field(validator=whole(0, MAX_SEQ))
    accepted: bool
    reason: RejectReason | None = None
    detail: str = ""


# --- controller → node --------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class AssignmentSet:
    """The complete desired state of one node. Newer (epoch, generation) replaces older."""

    kind: ClassVar[str] = "assignments"

    node_id: str
    epoch: int = attrs.field(validator=whole(0, MAX_SEQ))
    generation: int = attrs.field(validator=whole(0, MAX_SEQ))
    #: Wall-clock time (Unix seconds) after which the node must not act on this set.
    lease_expires_at: float = attrs.field(validator=finite(0.0, MAX_UNIX_S))
    assignments: list[Assignment] = attrs.field(factory=list)
    #: The id (`PublicKey.fingerprint`) of the controller key that signed it; "": not said.
    key_id: str = ""


@attrs.frozen(kw_only=True)
class Drain:
    """Stop taking new work; finish what is in flight."""

    kind: ClassVar[str] = "drain"

    node_id: str
    epoch: int = attrs.field(validator=whole(0, MAX_SEQ))
    reason: str = ""


# --- node key rotation (`nexa node rotate-keys`, `nexa nodes rotate`) ------------------------------


@attrs.frozen(kw_only=True)
class RotateKeys:
    """Node → controller: "from now on, know me by these public keys". Signed with the node's
    current signing key; sent again (the same keys) until a `KeysRotated` answers it."""

    kind: ClassVar[str] = "rotate_keys"

    node_id: str
    seq: int = attrs.field(validator=whole(0, MAX_SEQ))
    ts: float = attrs.field(validator=finite(0.0, MAX_UNIX_S))
    #: The new Ed25519 public key (base64 of the raw 32 bytes).
    signing_public_key: str
    #: The new Curve25519 public key (Z85).
    curve_public_key: str


@attrs.frozen(kw_only=True)
class KeysRotated:
    """Controller → node: the answer to `RotateKeys`. Accepted: the controller stored the new keys
    and admits them; the node switches to them. Refused: the node drops them and keeps its own."""

    kind: ClassVar[str] = "keys_rotated"

    node_id: str
    signing_public_key: str
    curve_public_key: str
    accepted: bool = True
    detail: str = ""


@attrs.frozen(kw_only=True)
class RotateKeysRequest:
    """Controller → node: make new keys and rotate to them (`nexa nodes rotate`)."""

    kind: ClassVar[str] = "rotate_keys_request"

    node_id: str


@attrs.frozen(kw_only=True)
class ControllerKeysAnnounced:
    """Controller → node (`nexa keys rotate-controller`): the controller's new keys, signed with the
    key the node pins now (`previous_key_id`). The node pins the new signing key beside it until
    `overlap_until`, then only the new one. It redials `channel_endpoint` (served with the new Curve
    key from the rotation on; "" from controllers that did not yet: it keeps the key for later)."""

    kind: ClassVar[str] = "controller_keys"

    node_id: str
    #: `PublicKey.fingerprint` of `signing_public_key`.
    key_id: str
    signing_public_key: str
    curve_public_key: str
    previous_key_id: str
    overlap_until: float = attrs.field(validator=finite(0.0, MAX_UNIX_S))
    channel_endpoint: str = ""


@attrs.frozen(kw_only=True)
class StateRequest:
    """Controller → node: send your state (a `Heartbeat`) now. Sent when a node's liveness comes but
    the controller holds no current state of it: it has just started, it missed the node's last
    state (`Liveness.state_seq`), or the node was Unreachable. Changes nothing on the node."""

    kind: ClassVar[str] = "state_request"

    node_id: str


NodeMessage = Hello | Heartbeat | Ack | RotateKeys
ControllerMessage = AssignmentSet | Drain | KeysRotated | RotateKeysRequest | ControllerKeysAnnounced | StateRequest
WireMessage = NodeMessage | ControllerMessage

#: What a controller accepts from a node, by kind.
FROM_NODE: Final[dict[str, type[NodeMessage]]] = {cls.kind: cls for cls in (Hello, Heartbeat, Ack, RotateKeys)}
#: What a node accepts from its controller, by kind.
FROM_CONTROLLER: Final[dict[str, type[ControllerMessage]]] = {
    cls.kind: cls
    for cls in (AssignmentSet, Drain, KeysRotated, RotateKeysRequest, ControllerKeysAnnounced, StateRequest)
}


# --- liveness: [alive, node_id, state_seq] (node → controller, authenticated by the channel) -----

#: The kind frame of a liveness message.
LIVENESS: Final = "alive"


@attrs.frozen(kw_only=True)
class Liveness:
    """A node's liveness beat as received (`nexa.channel.framing.decode_liveness`)."""

    node_id: str
    #: `seq` of the last signed `Heartbeat` the node sent (0: none yet).
    state_seq: int


# --- the data path: [kind, request_id, head, body] ----------------------------------------------

#: Controller → node: run one request. Node → controller: output bytes, then exactly one `end`.
#: Controller → node: `cancel` (stop it) and `credit` (the client read this many more chunks).
INFER: Final = "infer"
CHUNK: Final = "chunk"
END: Final = "end"
CANCEL: Final = "cancel"
CREDIT: Final = "credit"
DATA_KINDS: Final = frozenset({INFER, CHUNK, END, CANCEL, CREDIT})
#: Data kinds each side accepts.
DATA_FROM_CONTROLLER: Final = frozenset({INFER, CANCEL, CREDIT})
#: `InferHead.content_type`: a media type with parameters, in printable ASCII (no line breaks).
_CONTENT_TYPE: Final = r"[\x20-\x7e]{1,200}"
DATA_FROM_NODE: Final = frozenset({CHUNK, END})


class RuntimeMethod(enum.StrEnum):
    """The HTTP method of an `infer` request to the runtime. Only POST carries a body: a GET or
    DELETE (a stored response's own routes, `control.datapath.stored`) with one is refused."""

    POST = "POST"
    GET = "GET"
    DELETE = "DELETE"


@attrs.frozen(kw_only=True)
class InferHead:
    """Head of an `infer` frame; its body is the JSON request the runtime receives."""

    assignment_id: str
    #: The runtime's OpenAI-compatible path: /v1/chat/completions, /v1/completions or /v1/embeddings.
    path: str
    stream: bool
    #: POST with the body (every API's call), or a body-less GET, DELETE or POST (an empty body).
    method: RuntimeMethod = RuntimeMethod.POST
    #: Wall-clock Unix seconds; the node gives up (and ends with `deadline_exceeded`) after it.
    deadline_at: float = attrs.field(validator=finite(0.0, MAX_UNIX_S))
    #: Chunks the node may send before it must wait for `credit` (flow control per request).
    window: int = attrs.field(validator=whole(1, MAX_WINDOW))
    #: The gateway asked the runtime for usage in a stream but the client did not: drop the
    #: runtime's usage-only chunk (its `choices` is empty) after reading the counts.
    strip_usage_chunk: bool = False
    #: The gateway's estimate of the prompt's tokens, for runtimes that report no usage in streams
    #: (llama-cpp-python ignores `stream_options`): then the node reports this estimate and no
    #: completion count; the controller counts the stream's output events (`calls.Answer`, the one
    #: place they are counted) and, when the client asked for usage, adds a usage-only event
    #: before `data: [DONE]`.
    prompt_tokens_estimate: int = attrs.field(default=0, validator=whole(0, MAX_TOKENS))
    #: The body's media type, as the runtime gets it: JSON, or a media upload's
    #: `multipart/form-data; boundary=…` (`control.datapath.media`). Printable ASCII only.
    content_type: str = attrs.field(default="application/json", validator=attrs.validators.matches_re(_CONTENT_TYPE))
    #: The LoRA adapter the request is for, by the name the assignment gives it (`RuntimeSpec.loras`);
    #: the node names it to the runtime as the runtime expects (`nexa.node.lora`). Empty: the base.
    lora: str = attrs.field(default="", validator=attrs.validators.max_len(64))


class EndStatus(enum.StrEnum):
    OK = "ok"
    ERROR = "error"
    CANCELLED = "cancelled"


@attrs.frozen(kw_only=True)
class EndHead:
    """Head of the `end` frame that closes every request the node accepted (body empty)."""

    status: EndStatus
    #: For errors: `runtime_unavailable` (could not connect / not Ready), `runtime_error` (5xx or
    #: broken stream), `runtime_rejected` (4xx), `deadline_exceeded`, `node_busy`,
    #: `unknown_assignment`, `cancelled`.
    code: str | None = None
    #: The runtime's HTTP status, when it answered.
    http_status: int | None = attrs.field(default=None, validator=whole(0, 999, optional=True))
    #: For the client only (the runtime's own error message): never logged or stored.
    message: str = ""
    #: Whether any `chunk` was sent for this request (a retry is allowed only when False).
    first_byte_sent: bool = False
    #: Token counts: 0 … 2^31 (`bounds.MAX_TOKENS`), or None when the runtime reported none.
    prompt_tokens: int | None = attrs.field(default=None, validator=whole(0, MAX_TOKENS, optional=True))
    completion_tokens: int | None = attrs.field(default=None, validator=whole(0, MAX_TOKENS, optional=True))
    #: Time the runtime took, from the node's request to its last byte.
    runtime_ms: float = attrs.field(default=0.0, validator=finite(0.0, MAX_MS))
    #: The node's time outside the runtime, in ms: from the `infer` frame's arrival to the runtime
    #: request written, plus from the runtime's whole answer to this `end` (all of it when the runtime
    #: was never asked). None from nodes before it was sent. Not validated here: the controller checks
    #: it where it enters (`calls.node_overhead_ms`) and ignores a bad one, so it never fails a request.
    overhead_ms: float | None = None


@attrs.frozen(kw_only=True)
class ChunkHead:
    """Head of a stream's first `chunk` (every other chunk's head is empty; controllers before it
    ignore chunk heads)."""

    #: The node's time outside the runtime up to this chunk, in ms: from the `infer` frame's arrival
    #: to the runtime request written, plus from the runtime's first bytes to this chunk. Checked by
    #: the controller where it enters, like `EndHead.overhead_ms`.
    overhead_ms: float | None = None


@attrs.frozen(kw_only=True)
class CancelHead:
    reason: str = ""


@attrs.frozen(kw_only=True)
class CreditHead:
    chunks: int = attrs.field(validator=whole(0, MAX_WINDOW))


@attrs.frozen(kw_only=True)
class DataFrame:
    """One data-path message as received (heads still encoded: each kind parses its own)."""

    kind: str
    request_id: str
    head: bytes
    body: bytes
