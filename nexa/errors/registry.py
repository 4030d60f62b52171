"""Errors of the model registry and of deployments: a model's lifecycle, a deployment the registry
or the fleet does not allow, and a claim the controller checked at its source that does not hold."""

from __future__ import annotations

from nexa.errors.base import Conflict, NexaError


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


class ApprovalRequirementsUnmet(Conflict):
    """`models approve` of a version without the measured, passing results `[models] approval_requires`
    names; `missing` is one line per requirement not met."""

    code = "approval_requirements_unmet"

    def __init__(self, message: str, *, model: str, missing: tuple[str, ...]) -> None:
        super().__init__(message)
        self.model = model
        self.missing = missing


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


class CanarySuiteUnmet(Conflict):
    """Promoting a canary started with a suite (`CanaryCreate.suite`) before a measured run of it
    against the canary's replicas passed."""

    code = "canary_suite_unmet"


class NoCanary(Conflict):
    code = "no_canary"


class NothingToRollBack(Conflict):
    code = "nothing_to_roll_back"


class NoRollout(Conflict):
    code = "no_rollout"


class RolloutAlreadyPaused(Conflict):
    code = "rollout_paused"


class RolloutNotPaused(Conflict):
    code = "rollout_not_paused"


class NotDeployable(NexaError):
    """The controller refuses to run a deployment: its model, licence, runtime or the fleet does not allow it."""

    code = "not_deployable"


class DeployModelNotApproved(NotDeployable):
    code = "model_not_approved"


class DeployLicenseInvalid(NotDeployable):
    code = "license_invalid"


class DeployModelUnknown(NotDeployable):
    code = "model_unknown"


class DeployModelUnverified(NotDeployable):
    """An evaluation replica (`nexa eval run --model`) of a version whose artifact the controller has
    not verified yet (Candidate), or that is Retired."""

    code = "model_not_verified"


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


class LoraBaseInvalid(VerificationFailed):
    """A LoRA adapter whose base model versions do not exist, are not models, are retired, are of
    another format, or (at verification) whose GGUF header names another architecture or is not
    a LoRA adapter's; `base` names the version at fault ("" when the adapter's own file is)."""

    code = "lora_base_invalid"

    def __init__(self, message: str, *, adapter: str, base: str = "") -> None:
        super().__init__(message)
        self.adapter = adapter
        self.base = base


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
