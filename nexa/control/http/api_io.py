"""What the management API's handlers share to read a request and answer it (quart's `request`).

The body and query decoders (`contracts.codec`, `contracts.pages`), the JSON answer and the
caller (`Actor`, set by `api._authorize`). Used by `api` and every resource module (`http.resources`).
"""

from __future__ import annotations

import enum
import math
from typing import TypeVar

from quart import Response, g, request

from nexa.contracts import codec, pages
from nexa.contracts.domain import Actor
from nexa.errors import ContractError

E = TypeVar("E", bound=enum.StrEnum)


def json_response(obj: object, status: int = 200) -> Response:
    return Response(codec.dumps(codec.api, obj), status=status, content_type="application/json")


async def body(cls: type[codec.T]) -> codec.T:
    raw = await request.get_data(as_text=False)
    return codec.loads(codec.api, raw, cls)


async def optional_body(cls: type[codec.T]) -> codec.T:
    """A body that may be left out: none (or `{}`) means every field's default."""
    raw = await request.get_data(as_text=False)
    return codec.loads(codec.api, raw, cls) if raw.strip() else cls()


async def no_body() -> None:
    raw = await request.get_data(as_text=False)
    if raw.strip() and codec.loads(codec.api, raw, dict[str, object]):
        raise ContractError("this route takes no body (or an empty object)", problems=("(body): must be empty",))


def actor() -> Actor:
    return g.actor  # type: ignore[no-any-return]


def page(kind: str, shape: tuple[type, ...]) -> tuple[pages.Key | None, int]:
    """A list route's `?cursor=&limit=` (`contracts.pages`): the key to continue after, and the page size."""
    return pages.from_query(kind, shape, request.args.get("cursor"), request.args.get("limit"))


def next_cursor(kind: str, last: pages.Key | None) -> str | None:
    return None if last is None else pages.encode_cursor(kind, last)


def query_enum(name: str, cls: type[E]) -> E | None:
    """Query parameter `name` as one of `cls`'s values; None when left out; a typed 400 otherwise."""
    raw = request.args.get(name)
    if raw is None:
        return None
    try:
        return cls(raw)
    except ValueError:
        values = ", ".join(v.value for v in cls)
        raise ContractError(f"query {name} must be one of {values}", problems=(f"{name}: unknown",)) from None


def query_int(name: str, default: int, lo: int, hi: int) -> int:
    raw = request.args.get(name)
    if raw is None:
        return default
    # ASCII digits only ("²".isdigit() is true, and int() refuses it), and few of them: int() of
    # thousands of digits raises ValueError (found by the OpenAPI fuzzer).
    if not (raw.isascii() and raw.isdigit()) or len(raw) > len(str(hi)) or not lo <= int(raw) <= hi:
        raise ContractError(f"query {name} must be an integer from {lo} to {hi}", problems=(f"{name}: out of range",))
    return int(raw)


def query_float(name: str) -> float | None:
    raw = request.args.get(name)
    if raw is None:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):  # `nan` and `inf` parse, and then cannot be answered in JSON
        raise ContractError(f"query {name} must be a number (unix seconds)", problems=(f"{name}: not a number",))
    return value
