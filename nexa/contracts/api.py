"""Northbound HTTP request and response bodies, and the error envelope."""

from __future__ import annotations

import attrs

from nexa.contracts.domain import AuditEvent, KeyId, NodeAdminState, NodeState, Priority, Role, TenantId
from nexa.contracts.node import NodeInventory
from nexa.contracts.wire import AssignmentStatus, CacheDisk, MemoryPressure, RejectReason, RuntimeCacheDisk


@attrs.frozen(kw_only=True)
class ErrorBody:
    code: str
    message: str
    retryable: bool
    request_id: str


@attrs.frozen(kw_only=True)
class ErrorEnvelope:
    error: ErrorBody


@attrs.frozen(kw_only=True)
class Health:
    status: str


@attrs.frozen(kw_only=True)
class Readiness:
    """`GET /readyz` (no key): ready for traffic, and this controller's part in its cluster."""

    #: "ready", or "recovering" (reads and inference only, `nexa recovery finish`).
    status: str
    #: "leader" (reconciles and signs desired state) or "follower" (serves, passes writes on).
    role: str = "leader"
    #: The epoch it signs with as the leader; a follower's is the last one it held (0: never).
    epoch: int = 0
    #: Seconds since the leader's lease was last renewed, as this controller knows it; None
    #: without a lease (the embedded SQLite store: one controller, always the leader).
    lease_age_s: float | None = None


@attrs.frozen(kw_only=True)
class ClusterMember:
    """One controller on the store, as it last wrote itself."""

    id: str
    #: Its API's base URL (where followers forward writes when it leads).
    address: str
    #: "leader" or "follower" as it saw itself when last seen; `leader` says who holds the lease.
    role: str
    epoch: int
    #: Seconds since it last wrote its row (each `[cluster] renew_s` while it runs).
    seen_age_s: float
    #: Whether it holds the unexpired lease now.
    leader: bool = False
    #: The leader's only: seconds since it last renewed the lease.
    lease_age_s: float | None = None


@attrs.frozen(kw_only=True)
class ClusterView:
    """`GET /api/v1/cluster`: every controller on this store and which one leads."""

    #: The id of the lease's holder while unexpired; None while no controller leads.
    leader: str | None
    #: The leader's epoch (the newest while none leads).
    epoch: int
    #: The controller that answered.
    answered_by: str
    controllers: list[ClusterMember] = attrs.field(factory=list)


@attrs.frozen(kw_only=True)
class VersionInfo:
    """`GET /version` (no key): also what `nexa node doctor` checks a node against. The later
    fields have defaults so that an older controller's answer still reads (as "not reported")."""

    version: str
    epoch: int
    started_at: float
    #: `security.controller_fingerprint` of the controller's keys: what enrolled nodes have pinned.
    controller_fingerprint: str = ""
    #: The controller's wall clock (Unix seconds) when it answered; 0: not reported.
    now: float = 0.0
    #: Its `nodes.max_clock_skew_s`: heartbeats further than this from `now` are refused; 0: not reported.
    max_clock_skew_s: float = 0.0
    #: True while the controller is recovering (reconciliation only: `nexa recovery plan`, `nexa recovery finish`).
    recovering: bool = False


@attrs.frozen(kw_only=True)
class ControllerKey:
    """One of the controller's Ed25519 keys, current or retired by `nexa keys rotate-controller`."""

    #: `security.key_id` of the public key: what receipts and assignment sets name it by.
    key_id: str
    #: base64 of the raw 32 bytes.
    public_key: str
    #: When it was rotated away from (Unix seconds); 0: the current key.
    retired_at: float = 0.0


@attrs.frozen(kw_only=True)
class ReceiptPublicKey:
    """`GET /api/v1/receipts/public-key`: the Ed25519 key receipts and audit heads are signed with
    (base64), and every key the controller signed with (`keys`, current first, by id)."""

    public_key: str
    key_id: str = ""
    keys: list[ControllerKey] = attrs.field(factory=list)


@attrs.frozen(kw_only=True)
class ControllerKeysRotated:
    """`POST /api/v1/controller/rotate-keys` (`nexa keys rotate-controller`): the new keys' ids and
    until when nodes still accept the previous signing key."""

    key_id: str
    previous_key_id: str
    signing_public_key: str
    curve_public_key: str
    overlap_until: float
    #: Nodes the new keys were announced to now (the others get them when they next say hello).
    announced_to: int
    #: `security.controller_fingerprint` of the new keys (what new enrollment tokens carry).
    controller_fingerprint: str


@attrs.frozen(kw_only=True)
class KeyCreate:
    role: Role
    name: str = ""
    tenant: TenantId | None = None
    #: Seconds from now (the controller's clock) until the key stops working; None: never.
    expires_in_s: float | None = None
    #: The priority classes requests with the key may ask for (inference keys); None: standard
    #: and batch. `interactive` is granted only here.
    priorities: list[Priority] | None = None


@attrs.frozen(kw_only=True)
class KeyRotate:
    """`POST /api/v1/keys/{id}/rotate`: the old key keeps working for `grace_s`, then expires."""

    grace_s: float = 86400.0
    #: The successor's lifetime; None: the old key's (created to expiry), or never if it had none.
    expires_in_s: float | None = None


@attrs.frozen(kw_only=True)
class KeyView:
    """An API key as the API shows it: never the secret, never its hash."""

    id: KeyId
    name: str
    role: Role
    tenant: TenantId | None
    created_at: float
    created_by: KeyId | None
    revoked_at: float | None
    #: When it stops working (a 401 `key_expired` after); None: never.
    expires_at: float | None = None
    #: The successor a rotation issued.
    rotated_to: KeyId | None = None
    #: The priority classes requests with the key may ask for.
    priorities: list[Priority] = attrs.Factory(list)


@attrs.frozen(kw_only=True)
class KeyCreated:
    """The one answer that carries a key's secret; it is not shown again."""

    key: str
    info: KeyView


@attrs.frozen(kw_only=True)
class KeyRotated:
    """A rotation: the successor's secret (shown once) and info, and the old key with its new expiry."""

    key: str
    info: KeyView
    previous: KeyView


@attrs.frozen(kw_only=True)
class KeyList:
    """`GET /api/v1/keys`: a page, oldest first (`contracts.pages`)."""

    keys: list[KeyView]
    #: The cursor of the next page; None at the end (and from controllers that did not page).
    next_cursor: str | None = None


@attrs.frozen(kw_only=True)
class TenantCreate:
    id: TenantId
    display_name: str = ""


@attrs.frozen(kw_only=True)
class TenantView:
    id: TenantId
    display_name: str
    created_at: float


@attrs.frozen(kw_only=True)
class TenantList:
    """`GET /api/v1/tenants`: a page, by tenant id (`contracts.pages`)."""

    tenants: list[TenantView]
    #: The cursor of the next page; None at the end (and from controllers that did not page).
    next_cursor: str | None = None


@attrs.frozen(kw_only=True)
class AuditPage:
    """`GET /api/v1/audit`: a page of events in chain order (`contracts.pages`)."""

    events: list[AuditEvent]
    #: The cursor of the next page; None at the end.
    next_cursor: str | None = None


@attrs.frozen(kw_only=True)
class AuditVerdict:
    ok: bool
    checked: int
    first_bad_seq: int | None = None
    first_bad_id: str | None = None
    reason: str | None = None


@attrs.frozen(kw_only=True)
class AuditCheckpoint:
    """The audit chain's head at one moment (`GET /api/v1/audit/head`): event `seq` has `sha256`."""

    seq: int
    sha256: str
    #: Unix seconds when the controller signed it.
    at: float
    epoch: int


@attrs.frozen(kw_only=True)
class SignedAuditCheckpoint:
    """A checkpoint with the controller's Ed25519 signature (standard base64), over
    `nexa.audit-head.v1 NUL` + the checkpoint's canonical JSON. `public_key` is a hint only:
    a verifier compares it with the controller key it trusts."""

    checkpoint: AuditCheckpoint
    signature: str
    public_key: str


@attrs.frozen(kw_only=True)
class AuditVerifyRequest:
    """`POST /api/v1/audit/verify`: optionally against a checkpoint saved earlier (`nexa audit head`)."""

    against: SignedAuditCheckpoint | None = None


@attrs.frozen(kw_only=True)
class EnrollmentTokenCreate:
    ttl_s: float = 900.0
    labels: dict[str, str] = attrs.field(factory=dict)


@attrs.frozen(kw_only=True)
class EnrollmentTokenCreated:
    """The one answer that carries the token; the controller keeps only its hash."""

    id: str
    #: `nxb_<secret>.<controller fingerprint>`: the node sends only the secret and pins the keys
    #: of the answering controller only if they have that fingerprint.
    token: str
    expires_at: float
    labels: dict[str, str]
    #: SHA-256 (hex) of the controller's public keys (`security.controller_fingerprint`).
    controller_fingerprint: str = ""


@attrs.frozen(kw_only=True)
class EnrollRequest:
    """A node's first call: a one-time token and its public keys (private keys never leave it)."""

    token: str
    hostname: str
    #: Ed25519 public key, raw 32 bytes in base64 (`security.PublicKey.b64`).
    signing_public_key: str
    #: Curve25519 public key for CurveZMQ, Z85 text.
    curve_public_key: str
    agent_version: str = ""


@attrs.frozen(kw_only=True)
class EnrollResponse:
    node_id: str
    controller_signing_public_key: str
    controller_curve_public_key: str
    #: Where the node dials its channel, e.g. `tcp://127.0.0.1:8471`.
    channel_endpoint: str
    labels: dict[str, str]


@attrs.frozen(kw_only=True)
class NodeView:
    """A node as operators see it: keys never, state and capacity always."""

    id: str
    hostname: str
    state: NodeState
    admin_state: NodeAdminState
    #: Enrollment (admin) labels, plus the node's own inventory.json labels for keys the admin did
    #: not set, never a reserved `nexa.io` key (`control.fleet.grants`).
    labels: dict[str, str]
    enrolled_at: float
    last_heartbeat_at: float | None
    last_heartbeat_age_s: float | None
    agent_version: str
    inventory: NodeInventory | None
    free_memory_bytes: int
    free_accelerators: int
    assignments: list[AssignmentStatus]
    desired_generation: int
    acked_epoch: int
    acked_generation: int
    ack_reason: RejectReason | None
    #: The node pins only a controller key retired for good (it was offline through a rotation's
    #: overlap): it shows Unreachable and is sent nothing until enrolled again, as `hint` says.
    needs_reenrollment: bool = False
    hint: str = ""
    #: The artifact cache's disk, as the last heartbeat said (None: not reported).
    cache_disk: CacheDisk | None = None
    #: Its channel since this controller started: refused messages by reason, and `disconnected`
    #: (connections closed: it left or went silent, or the transport dropped an oversized message).
    channel: dict[str, int] = attrs.field(factory=dict)
    #: The replicas' writable caches, as the last heartbeat said (None: not reported).
    runtime_cache: RuntimeCacheDisk | None = None
    #: Set while the node reports memory pressure: placement puts nothing more on it.
    memory_pressure: MemoryPressure | None = None
    #: The data classes it may process: its inventory's that the admin granted (`control.fleet.grants`).
    data_classes: list[str] = attrs.field(factory=list)
    #: The fabric it is on (`contracts.fabric.effective_fabric`): its `fabric` label, else the name
    #: its inventory's fabric discovery gave; None without either.
    fabric: str | None = None


@attrs.frozen(kw_only=True)
class NodeList:
    """`GET /api/v1/nodes`: a page, by node id (`contracts.pages`)."""

    nodes: list[NodeView]
    #: The cursor of the next page; None at the end (and from controllers that did not page).
    next_cursor: str | None = None
