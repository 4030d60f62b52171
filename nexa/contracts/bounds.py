"""Range checks for the numbers contract types carry: numbers are checked where they enter. Pure.

Each factory returns an attrs validator, so a value out of range fails both when a contract is
decoded (the codec turns the ValueError into a ContractError naming the field) and when one is
built in code (the sender finds its own bug before the receiver does).
"""

from __future__ import annotations

import math
from typing import Any, Final

import attrs

#: Token counts on the wire and in usage records: 0 … 2^31 (issue 12 §3).
MAX_TOKENS: Final = 2**31
#: Bytes of memory, storage or a size: far above any machine, far below int64.
MAX_BYTES: Final = 2**62
#: Unix seconds (timestamps, deadlines, lease expiries): up to the year ~36812.
MAX_UNIX_S: Final = float(2**40)
#: A sequence number, epoch or generation: a signed 64-bit integer.
MAX_SEQ: Final = 2**63 - 1
#: The highest epoch a controller takes: one below `MAX_SEQ`, so that "one above" any epoch a
#: controller issued or a signed set carries still fits (`EpochExhausted` at the limit).
MAX_EPOCH: Final = MAX_SEQ - 1
#: A duration in milliseconds: about 285 years.
MAX_MS: Final = float(2**53)

Validator = Any  # attrs' validator protocol, (instance, attribute, value) -> None


def whole(lo: int, hi: int, *, optional: bool = False) -> Validator:
    """An int (never a bool) from `lo` to `hi` inclusive; None too when `optional`."""

    def check(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if value is None and optional:
            return
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise ValueError(f"{attribute.name} must be a whole number from {lo} to {hi}")

    return check


def finite(lo: float, hi: float, *, optional: bool = False) -> Validator:
    """A finite number from `lo` to `hi` inclusive (an int is accepted); None too when `optional`."""

    def check(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if value is None and optional:
            return
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError(f"{attribute.name} must be a finite number from {lo:g} to {hi:g}")
        if isinstance(value, int):
            if not lo <= value <= hi:  # compared as ints: no OverflowError for huge ones
                raise ValueError(f"{attribute.name} must be a finite number from {lo:g} to {hi:g}")
        elif not (math.isfinite(value) and lo <= value <= hi):
            raise ValueError(f"{attribute.name} must be a finite number from {lo:g} to {hi:g}")

    return check


def in_range(value: float | int | None, lo: float, hi: float) -> bool:
    """Whether a figure passes `finite(lo, hi)` (for producers that turn bad figures into None)."""
    if value is None or isinstance(value, bool):
        return False
    if isinstance(value, int):
        return lo <= value <= hi
    return math.isfinite(value) and lo <= value <= hi


def declared_bytes(value: str | None) -> int | None:
    """A byte count another program declared in text (an HTTP `Content-Length`), or None unless it
    is ASCII digits for 0 … MAX_BYTES: `"²".isdigit()` is true and `int()` refuses it, and `int()`
    of thousands of digits raises."""
    if value is None or not (value.isascii() and value.isdigit()) or len(value) > len(str(MAX_BYTES)):
        return None
    count = int(value)
    return count if count <= MAX_BYTES else None
