"""The run's S3 store as a `nexa` process is told about it: a credentials file."""

from __future__ import annotations

from pathlib import Path

from nexa.s3 import write_s3_credentials
from tests.realparts import S3Store


def write_credentials(path: Path, s3: S3Store) -> Path:
    """Write the store's keys to `path` (mode 0600, as nexa requires of a secrets file); `path`."""
    return write_s3_credentials(path, s3.credentials)
