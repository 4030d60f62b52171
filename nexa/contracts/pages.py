"""One pagination convention for every list route that can grow: `?cursor=<opaque>&limit=N`.

A page answers its list and `next_cursor`: the cursor to send for the next page, or null at the
end. A cursor is keyset position (the sort key of the last item given out, never an offset), so
items inserted meanwhile neither shift a page nor repeat an item. Clients must treat it as
opaque: it is base64url of `[list, *key]`, and a cursor from another list, or edited, is refused
with `invalid_request`. Pure; no I/O.
"""

from __future__ import annotations

import base64
import binascii
import json
import math
from collections.abc import Callable, Iterable
from typing import Final, TypeVar

from nexa.contracts import codec
from nexa.errors import ContractError

T = TypeVar("T")

#: Items per page when `limit` is left out, and the most one page holds.
DEFAULT_LIMIT: Final = 100
MAX_LIMIT: Final = 1000
#: The longest cursor read (longer ones are refused before decoding).
MAX_CURSOR_CHARS: Final = 1024

#: A sort key: what a cursor carries (strings, integers and floats only).
Key = tuple[str | int | float, ...]

_CURSOR_HINT: Final = "send the next_cursor of the previous page, or leave cursor out for the first page"


def encode_cursor(kind: str, key: Key) -> str:
    """The opaque cursor of list `kind` positioned after the item whose sort key is `key`."""
    raw = codec.canonical_json([kind, *key]).encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(kind: str, cursor: str, shape: tuple[type, ...], name: str = "cursor") -> Key:
    """The sort key in `cursor` (query parameter `name`), one of list `kind`'s with key types `shape`.

    Raises ContractError (`invalid_request`) for anything else, naming what to send instead.
    """
    data: object = None
    if len(cursor) <= MAX_CURSOR_CHARS and cursor.isascii():
        try:
            data = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
        except (ValueError, binascii.Error):  # not base64, not UTF-8 or not JSON
            data = None
    if (
        not isinstance(data, list)
        or len(data) != 1 + len(shape)
        or data[0] != kind
        or not all(_is(value, tp) for value, tp in zip(data[1:], shape, strict=True))
    ):
        raise ContractError(
            f"query {name} is not a cursor of this list: {_CURSOR_HINT}", problems=(f"{name}: invalid",)
        )
    return tuple(data[1:])


def from_query(kind: str, shape: tuple[type, ...], cursor: str | None, limit: str | None) -> tuple[Key | None, int]:
    """A list route's `?cursor=&limit=` as sent (None: left out): the key to continue after (list
    `kind`'s, of key types `shape`), and the page size. ContractError (`invalid_request`) otherwise."""
    size = DEFAULT_LIMIT
    if limit is not None:
        # ASCII digits only ("²".isdigit() is true, and int() refuses it), and few of them: int() of
        # thousands of digits raises ValueError (found by the OpenAPI fuzzer).
        digits = limit.isascii() and limit.isdigit() and len(limit) <= len(str(MAX_LIMIT))
        if not digits or not 1 <= int(limit) <= MAX_LIMIT:
            raise ContractError(
                f"query limit must be an integer from 1 to {MAX_LIMIT}", problems=("limit: out of range",)
            )
        size = int(limit)
    return (None if cursor is None else decode_cursor(kind, cursor, shape)), size


def _is(value: object, tp: type) -> bool:
    if tp is float:  # finite: `NaN` and `Infinity` parse as JSON here, and compare with nothing
        return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    return isinstance(value, tp) and not isinstance(value, bool)


def cut(items: list[T], limit: int, sort_key: Callable[[T], Key]) -> tuple[list[T], Key | None]:
    """A page of `limit` items from `items` (in order; ask the store for `limit + 1`), and the key to
    continue from: the last one's, when an item was left over; None at the end."""
    page = items[:limit]
    return page, (sort_key(page[-1]) if len(items) > limit else None)


def page_of(
    items: Iterable[T], sort_key: Callable[[T], Key], after: Key | None, limit: int
) -> tuple[list[T], Key | None]:
    """Keyset pagination of a list held in memory: the first `limit` items (by `sort_key`, which
    must be unique) after `after`, and the key to continue from (None at the end)."""
    ordered = sorted(items, key=sort_key)
    return cut([item for item in ordered if after is None or sort_key(item) > after], limit, sort_key)
