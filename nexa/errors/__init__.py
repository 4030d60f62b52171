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
    - ApiNotServed [api_not_served]: the model's runtimes do not serve the API asked for (rerank, score, tokenize …)
    - ResponseNotFound [response_not_found]: a `previous_response_id` not stored here for the tenant
    - StoredResponseLost [stored_response_lost]: a stored response whose replica is gone or not Ready
  + Conflict [conflict, HTTP 409]: the request is valid but the current state forbids it
    - AlreadyExists [already_exists]: a record with that name (and version) is registered already
    - IllegalTransition [illegal_transition]: a model's lifecycle state does not allow the action
    - LicenseInvalid [license_invalid]: approval needs an accepted licence that has not expired
    - ApprovalRequirementsUnmet [approval_requirements_unmet]: approval lacks a measured result it requires
    - ModelNotApproved [model_not_approved]: an alias may point only at an Approved model
    - NoRollbackTarget [no_rollback_target]: an alias has no earlier promotion to return to
    - ModelInUse [model_in_use]: a model an alias points at cannot be retired
    - RolloutInProgress [rollout_in_progress]: a deployment already runs a canary or a rollout
    - NoCanary [no_canary]: promoting a deployment that runs no canary
    - CanarySuiteUnmet [canary_suite_unmet]: promoting a canary its suite has not passed against yet
    - NothingToRollBack [nothing_to_roll_back]: a deployment with no canary and no earlier promotion to return to
    - NoRollout [no_rollout]: pausing, resuming or undoing a rollout where none is in progress
    - RolloutAlreadyPaused [rollout_paused]: pausing a rollout that is paused already
    - RolloutNotPaused [rollout_not_paused]: resuming a rollout that is not paused
    - WorkloadAlreadyActive [workload_already_active]: that workload id is still running
    - NotRecovering [not_recovering]: `nexa recovery finish` while the controller is not recovering
    - ControllersRunning [controllers_running]: a controller key rotation while other controllers share the store
    - RotationEndpointInUse [rotation_endpoint_in_use]: a key rotation whose second channel endpoint cannot be bound
    - StoreConflict: a write the store refused by a constraint (unique, foreign key, check): names it
  + NotDeployable [not_deployable, HTTP 422]: a deployment the registry or the fleet does not allow
    - DeployModelNotApproved [model_not_approved]: its model is not Approved
    - DeployLicenseInvalid [license_invalid]: its model's licence is not accepted or has expired
    - DeployModelUnknown [model_unknown]: no such alias or model version
    - DeployModelUnverified [model_not_verified]: an evaluation replica of a version not Verified (or later), or Retired
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
    - LoraBaseInvalid [lora_base_invalid]: a LoRA adapter's base versions are unknown, not models, or do not match it
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

The package, one module per family (`base` holds the root and the classes a status names; every
other module imports only `base`): `config`, `registry` (models and deployments), `serving` (the
data path), `cluster`, `channel` (the node channel), `store` (and backups), `engine` (the container
engine) and `artifacts`. Import every name from `nexa.errors` itself, the one import point: this
module re-exports each class (and `REENROLL_HINT`), and `tests/test_errors.py` checks that it does.
"""

from __future__ import annotations

from nexa.errors.artifacts import ArtifactDigestMismatch as ArtifactDigestMismatch
from nexa.errors.artifacts import ArtifactError as ArtifactError
from nexa.errors.artifacts import ArtifactInUse as ArtifactInUse
from nexa.errors.artifacts import ArtifactInvalid as ArtifactInvalid
from nexa.errors.artifacts import ArtifactRefused as ArtifactRefused
from nexa.errors.artifacts import ArtifactSizeMismatch as ArtifactSizeMismatch
from nexa.errors.artifacts import ArtifactUnavailable as ArtifactUnavailable
from nexa.errors.artifacts import GgufInvalid as GgufInvalid
from nexa.errors.artifacts import InsufficientDisk as InsufficientDisk
from nexa.errors.artifacts import RuntimeCacheNoRoom as RuntimeCacheNoRoom
from nexa.errors.base import AuthError as AuthError
from nexa.errors.base import BodyTimeout as BodyTimeout
from nexa.errors.base import Cancelled as Cancelled
from nexa.errors.base import Conflict as Conflict
from nexa.errors.base import ContractError as ContractError
from nexa.errors.base import DeadlineExceeded as DeadlineExceeded
from nexa.errors.base import FieldNotSupported as FieldNotSupported
from nexa.errors.base import Forbidden as Forbidden
from nexa.errors.base import IdempotencyKeyReused as IdempotencyKeyReused
from nexa.errors.base import KeyExpired as KeyExpired
from nexa.errors.base import MethodNotAllowed as MethodNotAllowed
from nexa.errors.base import MetricsUnreadable as MetricsUnreadable
from nexa.errors.base import NexaError as NexaError
from nexa.errors.base import NotFound as NotFound
from nexa.errors.base import Overloaded as Overloaded
from nexa.errors.base import PayloadTooLarge as PayloadTooLarge
from nexa.errors.base import PriorityNotGranted as PriorityNotGranted
from nexa.errors.base import RemoteError as RemoteError
from nexa.errors.base import RetentionNotPermitted as RetentionNotPermitted
from nexa.errors.base import Unauthenticated as Unauthenticated
from nexa.errors.base import Unavailable as Unavailable
from nexa.errors.channel import REENROLL_HINT as REENROLL_HINT
from nexa.errors.channel import BadSignature as BadSignature
from nexa.errors.channel import ChannelClosed as ChannelClosed
from nexa.errors.channel import ChannelError as ChannelError
from nexa.errors.channel import ClockSkew as ClockSkew
from nexa.errors.channel import ControllerKeyMismatch as ControllerKeyMismatch
from nexa.errors.channel import MessageTooLarge as MessageTooLarge
from nexa.errors.channel import NodeNeedsReenrollment as NodeNeedsReenrollment
from nexa.errors.channel import NodeRateLimited as NodeRateLimited
from nexa.errors.channel import NotConnected as NotConnected
from nexa.errors.channel import Replayed as Replayed
from nexa.errors.channel import UnprovenEpoch as UnprovenEpoch
from nexa.errors.channel import WrongNode as WrongNode
from nexa.errors.cluster import ControllersRunning as ControllersRunning
from nexa.errors.cluster import NodeUnreachable as NodeUnreachable
from nexa.errors.cluster import NotLeader as NotLeader
from nexa.errors.cluster import NotRecovering as NotRecovering
from nexa.errors.cluster import Recovering as Recovering
from nexa.errors.cluster import RotationEndpointInUse as RotationEndpointInUse
from nexa.errors.config import CertificateNotTrusted as CertificateNotTrusted
from nexa.errors.config import ConfigError as ConfigError
from nexa.errors.config import ControllerKeysDiffer as ControllerKeysDiffer
from nexa.errors.config import PlainHttpPeer as PlainHttpPeer
from nexa.errors.engine import ContainerNotFound as ContainerNotFound
from nexa.errors.engine import EngineError as EngineError
from nexa.errors.engine import EngineUnavailable as EngineUnavailable
from nexa.errors.engine import ImageNotFound as ImageNotFound
from nexa.errors.engine import SimulationDisabled as SimulationDisabled
from nexa.errors.registry import AlreadyExists as AlreadyExists
from nexa.errors.registry import ApprovalRequirementsUnmet as ApprovalRequirementsUnmet
from nexa.errors.registry import ArtifactMissing as ArtifactMissing
from nexa.errors.registry import CanarySuiteUnmet as CanarySuiteUnmet
from nexa.errors.registry import CheckpointRejected as CheckpointRejected
from nexa.errors.registry import DeployLicenseInvalid as DeployLicenseInvalid
from nexa.errors.registry import DeployModelNotApproved as DeployModelNotApproved
from nexa.errors.registry import DeployModelUnknown as DeployModelUnknown
from nexa.errors.registry import DeployModelUnverified as DeployModelUnverified
from nexa.errors.registry import DeployRuntimeUnknown as DeployRuntimeUnknown
from nexa.errors.registry import DigestUnknown as DigestUnknown
from nexa.errors.registry import IllegalTransition as IllegalTransition
from nexa.errors.registry import LicenseInvalid as LicenseInvalid
from nexa.errors.registry import LoraBaseInvalid as LoraBaseInvalid
from nexa.errors.registry import ManifestInvalid as ManifestInvalid
from nexa.errors.registry import MemoryOverReservation as MemoryOverReservation
from nexa.errors.registry import ModelInUse as ModelInUse
from nexa.errors.registry import ModelNotApproved as ModelNotApproved
from nexa.errors.registry import NoCanary as NoCanary
from nexa.errors.registry import NoRollbackTarget as NoRollbackTarget
from nexa.errors.registry import NoRollout as NoRollout
from nexa.errors.registry import NotDeployable as NotDeployable
from nexa.errors.registry import NothingToRollBack as NothingToRollBack
from nexa.errors.registry import QualificationFailed as QualificationFailed
from nexa.errors.registry import RegistryAnswerRefused as RegistryAnswerRefused
from nexa.errors.registry import RolloutAlreadyPaused as RolloutAlreadyPaused
from nexa.errors.registry import RolloutInProgress as RolloutInProgress
from nexa.errors.registry import RolloutNotPaused as RolloutNotPaused
from nexa.errors.registry import RuntimeFlagOwned as RuntimeFlagOwned
from nexa.errors.registry import SignatureRejected as SignatureRejected
from nexa.errors.registry import Unplaceable as Unplaceable
from nexa.errors.registry import VerificationFailed as VerificationFailed
from nexa.errors.serving import ApiNotServed as ApiNotServed
from nexa.errors.serving import ModelNotServed as ModelNotServed
from nexa.errors.serving import NoReadyReplica as NoReadyReplica
from nexa.errors.serving import NoReplicaForDataClass as NoReplicaForDataClass
from nexa.errors.serving import QueueFull as QueueFull
from nexa.errors.serving import QuotaExceeded as QuotaExceeded
from nexa.errors.serving import ResponseNotFound as ResponseNotFound
from nexa.errors.serving import RetentionUnavailable as RetentionUnavailable
from nexa.errors.serving import RuntimeFailed as RuntimeFailed
from nexa.errors.serving import RuntimeRejected as RuntimeRejected
from nexa.errors.serving import StoredResponseLost as StoredResponseLost
from nexa.errors.serving import WorkloadAlreadyActive as WorkloadAlreadyActive
from nexa.errors.store import BackupDamaged as BackupDamaged
from nexa.errors.store import BackupError as BackupError
from nexa.errors.store import BackupKeyMismatch as BackupKeyMismatch
from nexa.errors.store import BackupNotConfigured as BackupNotConfigured
from nexa.errors.store import BackupNotSupported as BackupNotSupported
from nexa.errors.store import EpochExhausted as EpochExhausted
from nexa.errors.store import RestoreTargetNotEmpty as RestoreTargetNotEmpty
from nexa.errors.store import StateDirLocked as StateDirLocked
from nexa.errors.store import StoreBusy as StoreBusy
from nexa.errors.store import StoreConflict as StoreConflict
from nexa.errors.store import StoreError as StoreError
from nexa.errors.store import StoreUnavailable as StoreUnavailable
from nexa.errors.store import StoreUnusable as StoreUnusable
