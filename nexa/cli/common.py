"""What every operator command shares: the connection flags, the client, argument types."""

from __future__ import annotations

import argparse
import datetime
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Final

from nexa.errors import ConfigError

if TYPE_CHECKING:
    from nexa.client import ApiClient
    from nexa.security import PublicKey

DEFAULT_URL: Final = "http://127.0.0.1:8470"


def common_flags() -> argparse.ArgumentParser:
    """`--url`, `--token` and `--json`: the parent parser of every operator command."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--url",
        default=os.environ.get("NEXA_URL", DEFAULT_URL),
        help="controller URL ($NEXA_URL); an https controller's certificate is checked against the system's "
        "CAs, or the CA file $NEXA_CA_FILE names",
    )
    common.add_argument("--token", default=os.environ.get("NEXA_TOKEN"), help="API key ($NEXA_TOKEN)")
    common.add_argument("--json", action="store_true", help="print JSON for scripts")
    return common


def page_flags(s: argparse.ArgumentParser, *, limit: int | None = None) -> None:
    """`--cursor` and `--limit` of a list that can grow (`?cursor=&limit=`, answered with `next_cursor`)."""
    s.add_argument("--cursor", help="the page after this cursor (as a previous page printed it)")
    s.add_argument("--limit", type=int, default=limit, help="at most this many items")


def page_params(args: argparse.Namespace) -> dict[str, str | None]:
    return {"cursor": args.cursor, "limit": None if args.limit is None else str(args.limit)}


def client(args: argparse.Namespace) -> ApiClient:
    from nexa.client import ApiClient  # httpx: only for the commands that call the controller

    require_token(args)
    return ApiClient(args.url, args.token)


def require_token(args: argparse.Namespace) -> None:
    if not args.token:
        raise ConfigError("no API key: set NEXA_TOKEN or pass --token")


_UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def duration(text: str) -> float:
    number, unit = (text[:-1], text[-1]) if text and text[-1] in _UNITS else (text, "s")
    try:
        value = float(number) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (use e.g. 900, 90s, 15m, 2h)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError("a duration must be positive")
    return value


def model_version(text: str) -> dict[str, str]:
    """`NAME@VERSION` as the API's `{"model", "version"}` (a LoRA adapter's base, an alias's adapter)."""
    name, sep, version = text.partition("@")
    if not sep or not name or not version:
        raise argparse.ArgumentTypeError(f"not NAME@VERSION: {text!r} (e.g. llama-8b@v1)")
    return {"model": name, "version": version}


def labels(text: str) -> dict[str, str]:
    out = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--labels: {item!r} is not key=value")
        out[key.strip()] = value.strip()
    return out


_SIZE_UNITS: Final = {
    "": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def size(text: str) -> int:
    number = text.strip().rstrip("BbIiKkMmGgTt")
    unit = text.strip()[len(number) :].lower()
    try:
        value = float(number) * _SIZE_UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use bytes, or e.g. 512MiB, 8GiB, 7.5GB)") from None
    if value <= 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"a size must be a positive whole number of bytes: {text!r}")
    return int(value)


def when(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a time: {text!r} (use 2027-01-31, an ISO time or unix seconds)"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    return moment.timestamp()


def read_file(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None


def public_key(given: str | None, fetch: Callable[[], str]) -> PublicKey:
    """`--public-key B64|@FILE`, or the controller's own key (`fetch`) when none is given."""
    from nexa.security import PublicKey

    if given is None:
        given = fetch()
    elif given.startswith("@"):
        given = read_file(given[1:]).decode("ascii", "replace").strip()
    return PublicKey.from_b64(given)
