"""The root of the tree, `NexaError`, and the classes a request's answer names by its HTTP status:
a contract a body breaks, a credential refused, no such record, a conflict, shed load, a dependency
down, a deadline passed, a cancelled request; and `RemoteError`, a controller's error envelope (CLI side)."""

from __future__ import annotations

from typing import ClassVar


class NexaError(Exception):
    """Base of every error nexa raises on purpose."""

    code: ClassVar[str] = "internal"
    retryable: ClassVar[bool] = False

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


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


class Overloaded(NexaError):
    code = "overloaded"
    retryable = True

    def __init__(self, message: str, *, retry_after_s: float = 1.0) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class Unavailable(NexaError):
    code = "unavailable"
    retryable = True


class DeadlineExceeded(NexaError):
    code = "deadline_exceeded"


class Cancelled(NexaError):
    code = "cancelled"


class RemoteError(NexaError):
    """An error envelope received from a controller; keeps the remote code and status."""

    def __init__(self, message: str, *, remote_code: str, status: int, request_id: str | None) -> None:
        super().__init__(message)
        self.remote_code = remote_code
        self.status = status
        self.request_id = request_id
