"""S3 credentials: read from a file (JSON or the AWS shared-credentials INI, re-read when it changes)
or the standard AWS environment variables, and written for the local parts nexa starts itself.
Never logged, never quoted in a message. Sync: no httpx here.
"""

from __future__ import annotations

import configparser
import json
import logging
import stat
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Final, TypeAlias

from nexa.config import WatchedFile
from nexa.errors import ConfigError
from nexa.security import write_key_file
from nexa.sigv4 import S3Credentials

__all__ = [
    "ENV_ACCESS_KEY_ID",
    "ENV_SECRET_ACCESS_KEY",
    "ENV_SESSION_TOKEN",
    "CredentialsSource",
    "load_s3_credentials",
    "s3_credentials",
    "write_s3_credentials",
]

log = logging.getLogger(__name__)

#: The standard variables read when no credentials file is configured (`s3_credentials`).
ENV_ACCESS_KEY_ID: Final = "AWS_ACCESS_KEY_ID"
ENV_SECRET_ACCESS_KEY: Final = "AWS_SECRET_ACCESS_KEY"  # noqa: S105 (a variable's name, not a secret)
ENV_SESSION_TOKEN: Final = "AWS_SESSION_TOKEN"  # noqa: S105
#: Credentials as `S3Client` takes them: fixed, or a function asked before each request (a file
#: re-read when it changes, `config.WatchedFile.current`).
CredentialsSource: TypeAlias = "S3Credentials | Callable[[], S3Credentials]"


def load_s3_credentials(path: str | Path, profile: str = "default") -> S3Credentials:
    """Read S3 credentials from `path`: JSON `{"access_key_id": …, "secret_access_key": …}` (a file
    that starts with `{`, or parses as JSON), else an AWS shared-credentials file (INI: `[profile]`
    with `aws_access_key_id`, `aws_secret_access_key`, optionally `aws_session_token`).

    Raises ConfigError naming the file and the problem (unreadable, not JSON or INI, no such
    profile, a missing, empty or unknown key); the message never quotes the file's content. Sync.
    """
    path = Path(path)
    try:
        raw = path.read_bytes()
        mode = path.stat().st_mode
    except OSError as exc:
        raise ConfigError(f"cannot read S3 credentials file {path}: {exc.strerror}") from None
    credentials = _json_credentials(path, raw) if _is_json(raw) else _ini_credentials(path, raw, profile)
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        log.warning("S3 credentials file %s is readable by other users (mode %o); use 0600", path, mode & 0o777)
    return credentials


def _is_json(raw: bytes) -> bool:
    start = raw.lstrip()[:1]
    if start == b"{":
        return True
    if start != b"[":  # `[profile]` starts an INI file, and `[...]` a JSON array
        return False
    try:
        json.loads(raw)
    except (ValueError, UnicodeDecodeError):
        return False
    return True


def _json_credentials(path: Path, raw: bytes) -> S3Credentials:
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        # JSONDecodeError's message gives the position only, never the text around it.
        where = f" (line {exc.lineno}, column {exc.colno})" if isinstance(exc, json.JSONDecodeError) else ""
        raise ConfigError(f"S3 credentials file {path} is not valid JSON{where}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"S3 credentials file {path} must hold a JSON object")
    problems = [f"unknown key {key!r}" for key in sorted(data) if key not in {"access_key_id", "secret_access_key"}]
    for key in ("access_key_id", "secret_access_key"):
        value = data.get(key)
        if value is None:
            problems.append(f"{key} is missing")
        elif not isinstance(value, str) or not value.strip():
            problems.append(f"{key} must be a non-empty string")
    if problems:
        raise ConfigError(f"S3 credentials file {path}: " + "; ".join(problems), problems=tuple(problems))
    return S3Credentials(access_key_id=data["access_key_id"].strip(), secret_access_key=data["secret_access_key"])


def _ini_credentials(path: Path, raw: bytes, profile: str) -> S3Credentials:
    """The AWS CLI's shared-credentials format, read by `configparser` (no interpolation: a `%`
    in a secret is the secret's)."""
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read_string(raw.decode("utf-8"), source=str(path))
    except (configparser.Error, UnicodeDecodeError) as exc:
        line = getattr(exc, "lineno", None)
        where = f" (line {line})" if line is not None else ""
        raise ConfigError(
            f"S3 credentials file {path} is neither JSON nor an AWS shared-credentials (INI) file{where}"
        ) from None
    if not parser.has_section(profile):
        # The sections it has are not named: a mangled file could hold a secret in a header.
        raise ConfigError(f"S3 credentials file {path} has no profile [{profile}]; set artifacts.s3_profile")
    section = parser[profile]
    keys = ("aws_access_key_id", "aws_secret_access_key")
    problems = [f"[{profile}] {key} is missing or empty" for key in keys if not section.get(key, "").strip()]
    if problems:
        raise ConfigError(f"S3 credentials file {path}: " + "; ".join(problems), problems=tuple(problems))
    token = section.get("aws_session_token", "").strip() or None
    return S3Credentials(
        access_key_id=section["aws_access_key_id"].strip(),
        secret_access_key=section["aws_secret_access_key"].strip(),
        session_token=token,
    )


def s3_credentials(
    path: str,
    *,
    profile: str = "default",
    environ: Mapping[str, str],
    on_invalid: Callable[[], None] | None = None,
) -> CredentialsSource | None:
    """The credentials an S3 client should use, as config and the environment give them.

    A file (`path`): re-read whenever it changes; a file that turns invalid keeps the last good
    credentials (`config.WatchedFile`). No file: `AWS_ACCESS_KEY_ID` and `AWS_SECRET_ACCESS_KEY`
    (with `AWS_SESSION_TOKEN` if set), read once. Neither: None (anonymous requests). Raises
    ConfigError when the file is bad at start, or when only one of the two variables is set.
    Sync: call it off the event loop.
    """
    if path:
        return WatchedFile(path, partial(load_s3_credentials, profile=profile), on_invalid=on_invalid).current
    key_id = environ.get(ENV_ACCESS_KEY_ID, "").strip()
    secret = environ.get(ENV_SECRET_ACCESS_KEY, "").strip()
    if not key_id and not secret:
        return None
    if not (key_id and secret):
        present, missing = (
            (ENV_ACCESS_KEY_ID, ENV_SECRET_ACCESS_KEY) if key_id else (ENV_SECRET_ACCESS_KEY, ENV_ACCESS_KEY_ID)
        )
        raise ConfigError(f"{present} is set but {missing} is not; set both, or neither (then requests are anonymous)")
    token = environ.get(ENV_SESSION_TOKEN, "").strip() or None
    return S3Credentials(access_key_id=key_id, secret_access_key=secret, session_token=token)


def write_s3_credentials(path: Path, credentials: S3Credentials) -> Path:
    """Write `credentials` to `path` as `load_s3_credentials` reads them, owner-only (0600); `path`.
    For the local parts nexa starts itself (`nexa demo`, tests, benchmarks). Sync."""
    keys = {"access_key_id": credentials.access_key_id, "secret_access_key": credentials.secret_access_key}
    # Atomic (a reader, such as a running controller's `WatchedFile`, never sees half a file), 0600 from the start.
    write_key_file(path, json.dumps(keys).encode(), private=True, overwrite=True)
    return path
