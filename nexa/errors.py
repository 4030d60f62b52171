"""The nexa exception tree. `control/http/common.py` maps classes to HTTP statuses (`STATUS`: the most
specific class in an error's MRO wins); the tree shows them.

Every error carries a stable machine `code` (snake_case, part of the public API), a human
message that never contains keys, file paths of other hosts, addresses or stack traces, and
whether retrying the same request may succeed.

Our exception hierarchy. Each class shows `[code, HTTP status]` where it sets its own (a class
without them answers its parent's); `tests/test_errors.py` checks the tree against the classes:

* NexaError [internal, HTTP 500]: every error nexa raises on purpose
  + ConfigError [invalid_config]: a config file or flag is invalid (names every bad key)
    - ControllerKeysDiffer [controller_keys_differ]: at start, keys other than those of the store's other controllers
    - CertificateNotTrusted [certificate_not_trusted]: an https peer's certificate does not verify against our CAs
    - PlainHttpPeer [plain_http_peer]: a write to forward to a controller off this host over plain http (not allowed)
  + ContractError [invalid_request, HTTP 400]: a request body or message does not fit its contract
    - PayloadTooLarge [payload_too_large, HTTP 413]: a request body over the configured limit
    - BodyTimeout [request_timeout, HTTP 408]: a request body that did not arrive within `[http] body_timeout_s`
    - FieldNotSupported [field_not_supported]: a request field this version does not implement (named, never ignored)
    - IdempotencyKeyReused [idempotency_key_reused, HTTP 422]: an idempotency key sent again with another body
    - MetricsUnreadable [metrics_unreadable]: a runtime's metrics answer is not in its format (node side)
  + AuthError [unauthenticated, HTTP 401]: a credential or a signed message is not accepted
    - Unauthenticated [unauthenticated, HTTP 401]: no credential, or one we do not know
      · KeyExpired [key_expired]: an API key past its expiry (or a rotated key past its grace)
    - Forbidden [forbidden, HTTP 403]: a known credential whose role may not do this
      · PriorityNotGranted [priority_not_granted]: a priority class the key is not granted
      · RetentionNotPermitted [retention_not_permitted]: a retention policy that is unknown or not open to the tenant
    - BadSignature [bad_signature]: a signed message that does not verify with the sender's key
    - Replayed [replayed]: a sequence number at or below the last one accepted
    - ClockSkew [clock_skew]: a timestamp too far from our clock
    - WrongNode [wrong_node]: a message naming another node than its channel's key
    - ControllerKeyMismatch [controller_key_mismatch]: an enrollment answer from another controller than the one pinned
    - NodeRateLimited [rate_limited]: a node sent signed messages faster than its channel allows (dropped)
    - NodeNeedsReenrollment [needs_reenrollment]: a node pins only a retired controller key (sent nothing)
    - UnprovenEpoch [unproven_epoch]: a node's epoch claim above what was issued, without proof (ignored)
  + NotFound (also LookupError) [not_found, HTTP 404]: no such record
    - MethodNotAllowed [method_not_allowed, HTTP 405]: the route exists but not for that method (names the allowed ones)
    - ModelNotServed [model_not_found]: no alias or model by that name is being served
  + Conflict [conflict, HTTP 409]: the request is valid but the current state forbids it
    - AlreadyExists [already_exists]: a record with that name (and version) is registered already
    - IllegalTransition [illegal_transition]: a model's lifecycle state does not allow the action
    - LicenseInvalid [license_invalid]: approval needs an accepted licence that has not expired
    - ModelNotApproved [model_not_approved]: an alias may point only at an Approved model
    - NoRollbackTarget [no_rollback_target]: an alias has no earlier promotion to return to
    - ModelInUse [model_in_use]: a model an alias points at cannot be retired
    - RolloutInProgress [rollout_in_progress]: a deployment already runs a canary or a rollout
    - NoCanary [no_canary]: promoting a deployment that runs no canary
    - NothingToRollBack [nothing_to_roll_back]: a deployment with no canary and no earlier promotion to return to
    - WorkloadAlreadyActive [workload_already_active]: that workload id is still running
    - NotRecovering [not_recovering]: `nexa recovery finish` while the controller is not recovering
    - ControllersRunning [controllers_running]: a controller key rotation while other controllers share the store
    - RotationEndpointInUse [rotation_endpoint_in_use]: a key rotation whose second channel endpoint cannot be bound
    - StoreConflict: a write the store refused by a constraint (unique, foreign key, check): names it
  + NotDeployable [not_deployable, HTTP 422]: a deployment the registry or the fleet does not allow
    - DeployModelNotApproved [model_not_approved]: its model is not Approved
    - DeployLicenseInvalid [license_invalid]: its model's licence is not accepted or has expired
    - DeployModelUnknown [model_unknown]: no such alias or model version
    - DeployRuntimeUnknown [runtime_unknown]: no runtime registered (and checked) under that name
    - Unplaceable [unplaceable]: no placement fits; the message explains every node
    - MemoryOverReservation [memory_over_reservation]: a memory setting would claim more of a unified pool than reserved
    - RuntimeFlagOwned [runtime_flag_owned]: `options.extra_args` gives a flag nexa sets itself (named)
    - QualificationFailed [qualification_failed]: a runtime qualification failed a step (named, with what to do)
  + Overloaded [overloaded, HTTP 429]: shed load; carries retry_after_s
    - QuotaExceeded [quota_exceeded]: a tenant limit (concurrency, requests or tokens per window) is used up
    - QueueFull [queue_full]: the model's admission queue for that priority is full
  + Unavailable [unavailable, HTTP 503]: a dependency is down; retryable
    - NoReadyReplica [no_ready_replica]: no Ready replica serves the model now, or none took it after retries
      · NoReplicaForDataClass [no_replica_for_data_class]: no replica is on a node allowed the request's data class
    - Recovering [recovering]: a write while the controller recovers from an older state (`nexa recovery finish`)
    - NodeUnreachable [node_unreachable]: the node has no open channel now, so it cannot be asked (`nexa nodes rotate`)
    - NotLeader [not_leader]: a leader-only write on a controller that is not (or no longer) the leader; retry
    - StoreUnavailable [store_unavailable]: the PostgreSQL store cannot be reached (also a StoreError; reconnects)
      · StoreBusy [store_busy]: another writer holds the lock too long, or a deadlock (either backend)
    - RuntimeFailed [runtime_failed, HTTP 502]: the runtime failed it (before any output: retried first)
  + DeadlineExceeded [deadline_exceeded, HTTP 504]: the request's deadline passed (queued or running)
  + Cancelled [cancelled, HTTP 499]: the client (or an operator) cancelled the request
  + RetentionUnavailable [retention_unavailable, HTTP 422]: retention other than `ephemeral` without an encrypted store
  + RuntimeRejected [runtime_rejected, HTTP 400]: the runtime refused the request itself (e.g. too long a prompt)
  + VerificationFailed [verification_failed, HTTP 422]: a claim the controller checked at its source does not hold
    - DigestUnknown [digest_unknown]: the OCI registry has no manifest with that digest
    - ManifestInvalid [manifest_invalid]: what the registry served for that digest is not a manifest of it
    - ArtifactMissing [artifact_missing]: the S3-compatible store has no such object
    - SignatureRejected [signature_rejected]: a required detached signature is missing or does not verify
    - CheckpointRejected [audit_checkpoint_rejected]: an audit checkpoint that this controller's key did not sign
    - RegistryAnswerRefused [registry_answer_refused]: a registry answer too large, or a redirect to another host
  + StoreError [store_error, HTTP 500]: the durable store failed
    - StoreUnusable [store_unusable]: the database cannot be used any more (ends the process)
    - StateDirLocked [state_dir_locked]: another process owns the state directory
    - EpochExhausted [epoch_exhausted]: the store's epoch is at the highest there is
  + BackupError [backup_error, HTTP 422]: a backup cannot be made or restored (nothing was written)
    - BackupNotConfigured [backup_not_configured, HTTP 409]: no backup key (`[backup] key_file` or NEXA_BACKUP_KEY)
    - BackupKeyMismatch [backup_key_mismatch]: the key given is not the one the backup was sealed with
    - BackupDamaged [backup_damaged]: the file is truncated, edited, or its manifest or a part does not verify
    - RestoreTargetNotEmpty [restore_target_not_empty]: `nexa restore` writes only into an empty or absent directory
    - BackupNotSupported [backup_not_supported]: the store is PostgreSQL: back it up with PostgreSQL's own tools
  + RemoteError: an error envelope returned by a nexa controller (CLI side)
  + EngineError [engine_error]: the container engine (podman or Docker) refused or failed a request (node side)
    - EngineUnavailable [engine_unavailable]: the engine's socket does not answer
    - ImageNotFound [image_not_found]: the registry has no image with that digest
    - ContainerNotFound (also LookupError) [container_not_found]: no container with that id
    - SimulationDisabled [simulation_disabled]: a `sim` runtime on a node that does not run simulated runtimes
  + ArtifactError [artifact_error]: a model artifact could not be provided
    - ArtifactUnavailable [artifact_unavailable]: the S3-compatible store refused or failed (retryable)
    - ArtifactDigestMismatch [artifact_digest_mismatch, HTTP 422]: the bytes do not match the pinned sha256 or size
      · ArtifactSizeMismatch [artifact_size_mismatch]: more or fewer bytes than declared
    - InsufficientDisk [insufficient_disk]: too little free disk for the files still to download (node side)
    - RuntimeCacheNoRoom [runtime_cache_no_room]: too little free disk for a replica's cache after eviction (node side)
    - ArtifactRefused [artifact_refused]: the S3-compatible store answered a request with a 4xx (not retryable)
    - ArtifactInvalid [artifact_invalid]: a local model directory that cannot be pushed (names the file)
    - ArtifactInUse [artifact_in_use]: a push would overwrite a registered version's file with other bytes
    - GgufInvalid [gguf_invalid]: a model file whose GGUF header cannot be read within bounds (names the entry)
  + ChannelError [channel_error]: the node channel (ZeroMQ) failed: bind, socket or protocol
    - ChannelClosed [channel_closed]: the link is not running, or has stopped
    - NotConnected [not_connected]: no open channel to that node right now; retryable
    - MessageTooLarge [message_too_large]: a node sent a message over the channel's size limit (dropped)
"""

from __future__ import annotations

from typing import ClassVar, Final


class NexaError(Exception):
    """Base of every error nexa raises on purpose."""

    code: ClassVar[str] = "internal"
    retryable: ClassVar[bool] = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ConfigError(NexaError):
    code = "invalid_config"

    def __init__(self, message: str, *, problems: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.problems = problems


class ControllerKeysDiffer(ConfigError):
    """At start: the fingerprint of this controller's keys directory is not the one stored in the
    database by the controllers before it. Several controllers on one store sign for one another
    (nodes pin one set of keys), so they must share the same keys; the store is left as it was."""

    code = "controller_keys_differ"

    def __init__(self, *, stored: str, got: str, keys_dir: str = "") -> None:
        where = f" in {keys_dir}" if keys_dir else ""
        super().__init__(
            f"the controller keys{where} have fingerprint {got}, but the store holds {stored}: "
            "every controller on one store must share the same controller keys; copy the keys directory "
            "of a controller already on this store (its <state_dir>/keys, mode 0700) over this one's and start again"
        )
        self.stored = stored
        self.got = got
        self.keys_dir = keys_dir


class CertificateNotTrusted(ConfigError):
    """An https peer (the controller, for the CLI and `nexa node doctor`; the leader, for a follower)
    presented a certificate that does not verify against the CAs in use: the system's store, or
    the CA file named (`ca_file`: NEXA_CA_FILE, `[cluster] peer_ca_file`). Never skipped."""

    code = "certificate_not_trusted"

    def __init__(self, *, url: str, reason: str, ca_file: str, fix: str) -> None:
        against = f"the CA file {ca_file}" if ca_file else "the system's CA store"
        super().__init__(f"the certificate of {url} is not trusted ({reason}) by {against}: {fix}")
        self.url = url
        self.reason = reason
        self.ca_file = ca_file


class PlainHttpPeer(ConfigError):
    """A follower would forward a write (API keys, cookies, bodies) to a leader off this host over
    plain http; refused unless `[cluster] allow_plain_http_peers` says the network is trusted."""

    code = "plain_http_peer"

    def __init__(self, *, url: str) -> None:
        super().__init__(
            f"the leader's address {url} is plain http to another host, and writes are not forwarded "
            "unencrypted: serve https on every controller ([http] tls_cert_file and tls_key_file) and give "
            "[cluster] address as an https:// URL, or set [cluster] allow_plain_http_peers = true on a "
            "network you trust"
        )
        self.url = url


class ContractError(NexaError):
    code = "invalid_request"

    def __init__(self, message: str, *, problems: tuple[str, ...] = ()) -> None:
        super().__init__(message)
        self.problems = problems


class BodyTimeout(ContractError):
    """A request's body did not arrive within `[http] body_timeout_s` of its head."""

    code = "request_timeout"

    def __init__(self, *, timeout_s: float) -> None:
        super().__init__(
            f"the request body did not arrive within {timeout_s:g} s ([http] body_timeout_s); send it again"
        )


class PayloadTooLarge(ContractError):
    code = "payload_too_large"

    def __init__(self, *, limit_bytes: int) -> None:
        super().__init__(f"request body is larger than {limit_bytes} bytes")
        self.limit_bytes = limit_bytes


class FieldNotSupported(ContractError):
    """A request field (or value of one) that this version does not implement: refused, not dropped."""

    code = "field_not_supported"

    def __init__(self, message: str, *, field: str) -> None:
        super().__init__(message, problems=(f"{field}: not supported",))
        self.field = field


class IdempotencyKeyReused(ContractError):
    """An idempotency key replayed with a body other than the one it was first sent with."""

    code = "idempotency_key_reused"


class MetricsUnreadable(ContractError):
    """What a runtime's metrics endpoint answered is not its format (too big, not text, not parsable)."""

    code = "metrics_unreadable"


class AuthError(NexaError):
    code = "unauthenticated"


class Unauthenticated(AuthError):
    code = "unauthenticated"


class KeyExpired(Unauthenticated):
    """A known API key whose `expires_at` has passed; it changes nothing and is never served again."""

    code = "key_expired"


class Forbidden(AuthError):
    code = "forbidden"


class PriorityNotGranted(Forbidden):
    """A request asking for a priority class its key is not granted (`[gateway] priority_over_grant = "refuse"`)."""

    code = "priority_not_granted"


class RetentionNotPermitted(Forbidden):
    """A request naming a retention policy that does not exist or that its tenant may not use;
    nothing of it is stored."""

    code = "retention_not_permitted"


class NotFound(NexaError, LookupError):
    code = "not_found"


class MethodNotAllowed(NotFound):
    """The path is a route, but not for this method; `allowed` are the methods it takes (`Allow`)."""

    code = "method_not_allowed"

    def __init__(self, allowed: tuple[str, ...]) -> None:
        super().__init__(f"this route takes {', '.join(allowed)}")
        self.allowed = allowed


class Conflict(NexaError):
    code = "conflict"


class AlreadyExists(Conflict):
    code = "already_exists"


class IllegalTransition(Conflict):
    """A lifecycle action the model's current state does not allow (nothing changed)."""

    code = "illegal_transition"

    def __init__(self, message: str, *, model: str, state: str, action: str) -> None:
        super().__init__(message)
        self.model = model
        self.state = state
        self.action = action


class LicenseInvalid(Conflict):
    code = "license_invalid"

    def __init__(self, message: str, *, model: str) -> None:
        super().__init__(message)
        self.model = model


class ModelNotApproved(Conflict):
    code = "model_not_approved"

    def __init__(self, message: str, *, model: str) -> None:
        super().__init__(message)
        self.model = model


class NoRollbackTarget(Conflict):
    code = "no_rollback_target"

    def __init__(self, message: str, *, alias: str) -> None:
        super().__init__(message)
        self.alias = alias


class ModelInUse(Conflict):
    code = "model_in_use"

    def __init__(self, message: str, *, model: str, aliases: tuple[str, ...]) -> None:
        super().__init__(message)
        self.model = model
        self.aliases = aliases


class RolloutInProgress(Conflict):
    code = "rollout_in_progress"


class NoCanary(Conflict):
    code = "no_canary"


class NothingToRollBack(Conflict):
    code = "nothing_to_roll_back"


class NotDeployable(NexaError):
    """The controller refuses to run a deployment: its model, licence, runtime or the fleet does not allow it."""

    code = "not_deployable"


class DeployModelNotApproved(NotDeployable):
    code = "model_not_approved"


class DeployLicenseInvalid(NotDeployable):
    code = "license_invalid"


class DeployModelUnknown(NotDeployable):
    code = "model_unknown"


class DeployRuntimeUnknown(NotDeployable):
    code = "runtime_unknown"


class Unplaceable(NotDeployable):
    """No placement fits; the message carries the per-node explanation."""

    code = "unplaceable"


class MemoryOverReservation(NotDeployable):
    """An operator-set runtime memory setting (vLLM `gpu_memory_utilization`, …) would let the
    runtime claim more of a unified-memory node's pool than the deployment reserves there."""

    code = "memory_over_reservation"

    def __init__(self, message: str, *, setting: str, node_id: str) -> None:
        super().__init__(message)
        self.setting = setting
        self.node_id = node_id


class RuntimeFlagOwned(NotDeployable):
    """A deployment's `options.extra_args` gives a flag nexa owns: the model path, the served name,
    the bind address or port, the memory bound, tensor parallelism, a typed setting's flag, or one
    that would reach a hub; `flags` names each."""

    code = "runtime_flag_owned"

    def __init__(self, message: str, *, flags: tuple[str, ...]) -> None:
        super().__init__(message)
        self.flags = flags


class QualificationFailed(NotDeployable):
    """A runtime qualification (`nexa runtimes qualify`) failed a step: `step` names it, the
    message says what was seen and what to do."""

    code = "qualification_failed"

    def __init__(self, message: str, *, step: str) -> None:
        super().__init__(message)
        self.step = step


class VerificationFailed(NexaError):
    """The controller asked the source (registry, object store, signature) and the claim does not hold."""

    code = "verification_failed"


class DigestUnknown(VerificationFailed):
    code = "digest_unknown"

    def __init__(self, message: str, *, image: str) -> None:
        super().__init__(message)
        self.image = image


class ManifestInvalid(VerificationFailed):
    """The registry served bytes for an image that are not its manifest: another digest, not JSON,
    not an OCI/Docker manifest or index, or a config naming no platform."""

    code = "manifest_invalid"

    def __init__(self, message: str, *, image: str) -> None:
        super().__init__(message)
        self.image = image


class ArtifactMissing(VerificationFailed):
    code = "artifact_missing"

    def __init__(self, message: str, *, uri: str) -> None:
        super().__init__(message)
        self.uri = uri


class SignatureRejected(VerificationFailed):
    code = "signature_rejected"


class CheckpointRejected(VerificationFailed):
    """`audit verify --against`: the checkpoint's signature is not the controller's (HTTP 422)."""

    code = "audit_checkpoint_rejected"


class RegistryAnswerRefused(VerificationFailed):
    """An OCI registry (or its token service) answered in a way nexa does not follow: more bytes
    than a token answer or manifest may hold, or a redirect for a manifest or a token to another
    host (where the request's credentials must not go). The message says what to check."""

    code = "registry_answer_refused"

    def __init__(self, message: str, *, registry: str) -> None:
        super().__init__(message)
        self.registry = registry


class Overloaded(NexaError):
    code = "overloaded"
    retryable = True

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class QuotaExceeded(Overloaded):
    code = "quota_exceeded"

    def __init__(self, message: str, *, limit: str, retry_after_s: float) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        #: Which limit: `concurrent`, `requests_per_minute`, `tokens_per_minute` or `tokens_per_day`.
        self.limit = limit


class QueueFull(Overloaded):
    code = "queue_full"


class Unavailable(NexaError):
    code = "unavailable"
    retryable = True


class NoReadyReplica(Unavailable):
    code = "no_ready_replica"


class NoReplicaForDataClass(NoReadyReplica):
    code = "no_replica_for_data_class"

    def __init__(self, message: str, *, data_class: str) -> None:
        super().__init__(message)
        self.data_class = data_class


class NodeUnreachable(Unavailable):
    """What needs the node itself (`nexa nodes rotate`) while its channel is not open. Changes nothing."""

    code = "node_unreachable"

    def __init__(self, *, node_id: str) -> None:
        super().__init__(
            f"node {node_id} is not connected, so it cannot be asked now: retry once it is Ready, "
            "or run `nexa node rotate-keys` on the node (its agent sends the new keys when it connects)"
        )
        self.node_id = node_id


class Recovering(Unavailable):
    """A mutation refused while the controller recovers (started from a restored or older state).

    Reads and inference go on; every write waits until recovery ends, which changes nothing now.
    """

    code = "recovering"

    def __init__(self, message: str = "") -> None:
        super().__init__(
            message
            or "the controller is recovering from a restored or older state and accepts no changes yet: "
            "see what it would change with `nexa recovery plan`, then end recovery with `nexa recovery finish`"
        )


class NotLeader(Unavailable):
    """A write only the leader may make (desired sets, placement, rollout steps), refused because this
    controller does not hold the lease at its epoch, checked in the write's own transaction: nothing
    was written. `leader_address` is where the leader was last seen (for forwarding, never shown)."""

    code = "not_leader"

    def __init__(self, message: str = "", *, leader_address: str | None = None) -> None:
        super().__init__(
            message
            or "this controller is not the leader, so it refused the write and changed nothing: "
            "retry the request (on any controller: followers pass writes to the leader)"
        )
        self.leader_address = leader_address


class RuntimeFailed(Unavailable):
    code = "runtime_failed"


class DeadlineExceeded(NexaError):
    code = "deadline_exceeded"


class Cancelled(NexaError):
    code = "cancelled"


class ModelNotServed(NotFound):
    code = "model_not_found"


class NotRecovering(Conflict):
    code = "not_recovering"


class ControllersRunning(Conflict):
    """`nexa keys rotate-controller` on a shared store while other controllers run on it: a
    rotation writes the keys directory of this host only, and the others would keep signing with
    the old keys. Nothing was changed."""

    code = "controllers_running"

    def __init__(self, *, others: list[str], wait_s: float) -> None:
        super().__init__(
            f"{len(others)} other controller(s) run on this store (GET /api/v1/cluster lists them), and a key "
            "rotation changes the keys directory of this controller only, so nothing was changed: stop every "
            f"other controller (a stopped one counts as running for {wait_s:g} s more), rotate here, then copy "
            "this controller's <state_dir>/keys (mode 0700) over each other one's before it starts again (the "
            "store accepts the rotated keys)"
        )
        self.others = others


class RotationEndpointInUse(Conflict):
    """`nexa keys rotate-controller` serves the new Curve key on the channel's second endpoint
    before it writes a key file; that endpoint could not be bound, so nothing was changed."""

    code = "rotation_endpoint_in_use"
    retryable = True

    def __init__(self, *, endpoint: str, reason: str) -> None:
        super().__init__(
            f"the key rotation serves the new Curve key on {endpoint} first, and it cannot be bound ({reason}), so "
            "the keys were not changed: free that port, or set [channel] rotation_listen (and rotation_advertise) to "
            "a free one and restart the controller, then rotate again"
        )
        self.endpoint = endpoint


class StoreConflict(Conflict):
    """A write the store refused by one of its constraints (a unique key, a foreign key, NOT NULL, a
    check), raised by either backend in the statement that violated it; the transaction is undone.
    `constraint`: the unique or foreign key by the database's name for it (`api_key.secret_sha256` on
    SQLite, `tenant_pkey` on PostgreSQL), else "constraint"."""

    def __init__(self, *, constraint: str) -> None:
        super().__init__(f"conflicts with existing state ({constraint})")
        self.constraint = constraint


class WorkloadAlreadyActive(Conflict):
    code = "workload_already_active"


class RetentionUnavailable(NexaError):
    code = "retention_unavailable"


class RuntimeRejected(NexaError):
    code = "runtime_rejected"


class StoreError(NexaError):
    code = "store_error"


class StoreUnusable(StoreError):
    """The database cannot be used any more (corrupt, not a database, disk I/O failed, full, read-only).

    The one failure of a running loop that ends the process (`nexa.supervision`; exit code 3)."""

    code = "store_unusable"


class EpochExhausted(StoreError):
    """The store's epoch is at `bounds.MAX_EPOCH`: no controller can take a higher one."""

    code = "epoch_exhausted"

    def __init__(self, *, epoch: int) -> None:
        super().__init__(
            f"the store's epoch is {epoch}, the highest there is: no controller can take a new one. Start"
            " the controller on a new state directory (or database) and enroll the nodes again"
        )
        self.epoch = epoch


class StateDirLocked(StoreError):
    code = "state_dir_locked"

    def __init__(self, *, state_dir: str) -> None:
        super().__init__(
            f"state directory {state_dir} is in use by another nexa control process; "
            "stop it first or pass a different --state-dir"
        )
        self.state_dir = state_dir


class StoreUnavailable(Unavailable, StoreError):
    """The PostgreSQL store did not answer: the connection is lost or refused, or a lock wait or
    deadlock timed out. Retryable (503): the next transaction connects again, and the process goes
    on (a damaged SQLite file is StoreUnusable instead). At start, it names the database and what
    to check; never a password."""

    code = "store_unavailable"


class StoreBusy(StoreUnavailable):
    """The store's lock stayed taken past its wait: SQLite's busy timeout (another process writes
    the file), PostgreSQL's `lock_timeout`, or a deadlock or serialization conflict that tries did
    not resolve. Retryable (503); nothing of the transaction was written."""

    code = "store_busy"


class BackupError(NexaError):
    """A backup could not be made or restored; what was refused wrote nothing."""

    code = "backup_error"


class BackupNotConfigured(BackupError):
    code = "backup_not_configured"


class BackupNotSupported(BackupError):
    """`nexa backup` copies the embedded SQLite store; a controller on PostgreSQL refuses it and
    names PostgreSQL's own tools (pg_dump, continuous archiving), which see the shared database whole."""

    code = "backup_not_supported"

    def __init__(self, message: str = "") -> None:
        super().__init__(
            message
            or "this controller's store is PostgreSQL ([store] url), which nexa does not back up: use "
            "PostgreSQL's own tools (pg_dump, or continuous archiving with pg_basebackup) on the database, "
            "and copy each controller's <state_dir>/keys with them"
        )


class BackupKeyMismatch(BackupError):
    code = "backup_key_mismatch"

    def __init__(self, *, expected_id: str, got_id: str) -> None:
        super().__init__(
            f"this backup was sealed with backup key {expected_id}, not with the key given ({got_id}):"
            " pass the key it was made with (--key-file or NEXA_BACKUP_KEY)"
        )
        self.expected_id = expected_id
        self.got_id = got_id


class BackupDamaged(BackupError):
    code = "backup_damaged"


class RestoreTargetNotEmpty(BackupError):
    code = "restore_target_not_empty"

    def __init__(self, *, target: str) -> None:
        super().__init__(f"{target} is not empty: restore into a new or empty directory (nothing was written)")
        self.target = target


class RemoteError(NexaError):
    """An error envelope received from a controller; keeps the remote code and status."""

    def __init__(self, message: str, *, remote_code: str, status: int, request_id: str | None) -> None:
        super().__init__(message)
        self.remote_code = remote_code
        self.status = status
        self.request_id = request_id


class BadSignature(AuthError):
    """A signature that does not verify. Says which kind of message, never the key or the bytes."""

    code = "bad_signature"

    def __init__(self, message: str, *, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class Replayed(AuthError):
    """A message whose sequence number is not above the last one accepted from that peer."""

    code = "replayed"

    def __init__(self, *, seq: int, last_seq: int) -> None:
        super().__init__(f"sequence number {seq} is not above the last accepted {last_seq}")
        self.seq = seq
        self.last_seq = last_seq


class ClockSkew(AuthError):
    """A message whose timestamp is further from our clock than the allowed skew."""

    code = "clock_skew"

    def __init__(self, *, skew_s: float, max_skew_s: float) -> None:
        super().__init__(f"timestamp is {skew_s:.3f} s from our clock (at most {max_skew_s:g} s allowed)")
        self.skew_s = skew_s
        self.max_skew_s = max_skew_s


class WrongNode(AuthError):
    """A message naming a node other than the one its channel's key belongs to."""

    code = "wrong_node"

    def __init__(self, *, channel_node: str, claimed_node: str) -> None:
        super().__init__(f"node {channel_node} sent a message naming node {claimed_node}")
        self.channel_node = channel_node
        self.claimed_node = claimed_node


class ControllerKeyMismatch(AuthError):
    """Enrollment: the answering controller's keys do not have the fingerprint the node was given
    (in the token, or by `--controller-fingerprint`). Nothing is saved."""

    code = "controller_key_mismatch"

    def __init__(self, *, expected: str, got: str) -> None:
        super().__init__(
            f"the controller answered with keys of fingerprint {got}, not the expected {expected}: "
            "refusing to enroll (wrong URL, or someone in between); nothing was saved"
        )
        self.expected = expected
        self.got = got


class NodeNeedsReenrollment(AuthError):
    """A node that pins only a controller key retired for good (it was offline through a rotation's
    overlap, `[nodes] key_overlap_s`): it cannot verify what the controller signs now, so its
    messages are refused and it is sent nothing until it is enrolled again."""

    code = "needs_reenrollment"

    def __init__(self, *, node_id: str, key_id: str) -> None:
        super().__init__(f"node {node_id} pins only the retired controller key {key_id}: {REENROLL_HINT}")
        self.node_id = node_id
        self.key_id = key_id


#: How an operator brings back a node that needs re-enrollment (`nexa nodes list` shows it).
REENROLL_HINT: Final = (
    "re-enroll: nexa tokens create, then on the node remove its state directory and run nexa node enroll"
    " (then nexa nodes revoke the old entry)"
)


class NodeRateLimited(AuthError):
    """A node's signed message above its channel's rate (`channel.signed_messages_per_s`): dropped unread."""

    code = "rate_limited"

    def __init__(self, *, node_id: str) -> None:
        super().__init__(f"node {node_id} sends signed messages faster than its channel allows")
        self.node_id = node_id


class UnprovenEpoch(AuthError):
    """A node's claimed (epoch, generation) above every epoch this controller issued, without a set
    one of its signing keys signed at it: the claim is ignored (counted, audited, shown on the node)."""

    code = "unproven_epoch"

    def __init__(self, *, node_id: str, epoch: int, issued: int, why: str) -> None:
        super().__init__(
            f"node {node_id} claims it accepted epoch {epoch}, above the highest this controller issued"
            f" ({issued}), {why}: the claim is ignored; if the node is not compromised, restart its agent"
            " (it then sends the signed set it accepted), else revoke it"
        )
        self.node_id = node_id
        self.epoch = epoch


class ChannelError(NexaError):
    code = "channel_error"


class ChannelClosed(ChannelError):
    code = "channel_closed"


class MessageTooLarge(ChannelError):
    """A node's message over the channel's limit; dropped, the connection kept (up to the transport's own bound)."""

    code = "message_too_large"

    def __init__(self, *, size: int, limit: int) -> None:
        super().__init__(f"a message of {size} bytes is over the channel's limit of {limit} bytes")


class NotConnected(ChannelError):
    code = "not_connected"
    retryable = True

    def __init__(self, *, node_id: str) -> None:
        super().__init__(f"node {node_id} has no open channel")
        self.node_id = node_id


class EngineError(NexaError):
    """What a container engine driver (`nexa.node.engines`) raises: each driver translates its own
    engine's answers into this tree, so callers never learn which engine answered."""

    code = "engine_error"


class EngineUnavailable(EngineError):
    code = "engine_unavailable"
    retryable = True


class ImageNotFound(EngineError):
    code = "image_not_found"


class ContainerNotFound(EngineError, LookupError):
    code = "container_not_found"


class SimulationDisabled(EngineError):
    """A `sim` runtime assigned to a node without `simulation = true` (and NEXA_SIMULATION_ONLY=1)."""

    code = "simulation_disabled"


class ArtifactError(NexaError):
    code = "artifact_error"


class ArtifactUnavailable(ArtifactError):
    """The S3-compatible store cannot be reached, or failed a request (a 5xx). `status` and
    `s3_code` are the HTTP status and S3 error code of its answer; None and "" when none came."""

    code = "artifact_unavailable"
    retryable = True

    def __init__(self, message: str, *, status: int | None = None, s3_code: str = "") -> None:
        super().__init__(message)
        self.status = status
        self.s3_code = s3_code


class ArtifactDigestMismatch(ArtifactError):
    code = "artifact_digest_mismatch"


class ArtifactSizeMismatch(ArtifactDigestMismatch):
    code = "artifact_size_mismatch"


class InsufficientDisk(ArtifactError):
    """The files still to download need more disk than is free, even after evicting every unused
    artifact; nothing was downloaded or evicted. Carries both figures."""

    code = "insufficient_disk"

    def __init__(self, message: str, *, needed_bytes: int, free_bytes: int) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes


class RuntimeCacheNoRoom(ArtifactError):
    """A replica cannot start: its writable cache's filesystem has less free disk than a start
    needs (`[cache] runtime_cache_start_free_bytes`), even with every unused runtime cache removed.
    Carries both figures."""

    code = "runtime_cache_no_room"

    def __init__(self, message: str, *, needed_bytes: int, free_bytes: int) -> None:
        super().__init__(message)
        self.needed_bytes = needed_bytes
        self.free_bytes = free_bytes


class ArtifactRefused(ArtifactError):
    """The S3-compatible store refused a request (access denied, bad signature, no such bucket):
    retrying the same request will not help. Names the status, the S3 error code and the key,
    and carries the first two as `status` and `s3_code` (the reason phrase when the body names
    no code), so that each caller can word its own hint."""

    code = "artifact_refused"

    def __init__(self, message: str, *, status: int, s3_code: str) -> None:
        super().__init__(message)
        self.status = status
        self.s3_code = s3_code


class ArtifactInUse(ArtifactError):
    """A push would put other bytes where a registered model version's file is (its manifest names
    that object): refused before anything is uploaded, naming the file and the version."""

    code = "artifact_in_use"


class ArtifactInvalid(ArtifactError):
    """A local file or directory that cannot be pushed as a model (a symlink leaving it, a special
    file, no files, no bytes, a path a manifest may not hold); names the file. Nothing was uploaded."""

    code = "artifact_invalid"


class GgufInvalid(ArtifactError):
    """A model file whose GGUF header is not one, or claims more than nexa reads (a count, a
    length, a nesting), or lacks the figures llama.cpp sizes its KV cache by; names the entry
    and its offset. Nothing is taken from such a header."""

    code = "gguf_invalid"
