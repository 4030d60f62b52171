"""Errors of the data path: quotas and queues, replicas, the runtime's own answer, workloads and retention."""

from __future__ import annotations

from nexa.errors.base import Conflict, NexaError, NotFound, Overloaded, Unavailable


class QuotaExceeded(Overloaded):
    code = "quota_exceeded"

    def __init__(self, message: str, *, limit: str, retry_after_s: float) -> None:
        super().__init__(message, retry_after_s=retry_after_s)
        #: Which limit: `concurrent`, `requests_per_minute`, `tokens_per_minute`, `tokens_per_day`,
        #: `adapter_tokens_per_day` (a LoRA adapter's, the message names it), or a media one
        #: (`audio_seconds_per_day`, `speech_characters_per_day`, `images_per_day`).
        self.limit = limit


class QueueFull(Overloaded):
    code = "queue_full"


class NoReadyReplica(Unavailable):
    code = "no_ready_replica"


class NoReplicaForDataClass(NoReadyReplica):
    code = "no_replica_for_data_class"

    def __init__(self, message: str, *, data_class: str) -> None:
        super().__init__(message)
        self.data_class = data_class


class RuntimeFailed(Unavailable):
    code = "runtime_failed"


class ModelNotServed(NotFound):
    code = "model_not_found"


class ApiNotServed(NotFound):
    """The model is served, but none of its Ready replicas' runtimes serves the API asked for."""

    code = "api_not_served"


class ResponseNotFound(NotFound):
    """A `previous_response_id` this controller keeps no record of for the tenant (another tenant's,
    never stored, expired, or remembered by another controller): resend the conversation."""

    code = "response_not_found"


class StoredResponseLost(NotFound):
    """A stored response whose replica is gone or not Ready: the response went with its memory.
    Never routed elsewhere (no other replica has it): resend the conversation as input items."""

    code = "stored_response_lost"


class WorkloadAlreadyActive(Conflict):
    code = "workload_already_active"


class RetentionUnavailable(NexaError):
    code = "retention_unavailable"


class RuntimeRejected(NexaError):
    code = "runtime_rejected"
