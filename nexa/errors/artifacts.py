"""Errors of model artifacts: fetched from the S3-compatible store, checked, cached, pushed."""

from __future__ import annotations

from nexa.errors.base import NexaError


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
