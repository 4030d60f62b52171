"""The data path's heads (`wire.InferHead`, `EndHead`, `ChunkHead`, `CancelHead`, `CreditHead`),
encoded and decoded by msgspec's compiled JSON codec instead of `codec.wire`'s generic one.

The bytes are the same JSON (`codec.wire_sent`'s: sorted keys, no spaces, fields at their defaults
left out), so a controller and a node of neighbouring releases read each other's heads as long as a
head uses nothing the older one lacks (`contracts.wire`); what changes is the cost: a head costs a few µs
each way instead of 10 to 60 (the strict decoder builds a dict, walks it for its limits, then cattrs
structures it). The checks a head from a node passes are as strict where it matters: each head is
decoded into a typed record whose fields take only their JSON type (no `true` for a number, no
number for a string), unknown keys are refused, strings are bounded (`WIRE_LIMITS`), a number out of
a float's range, NaN, Infinity, invalid UTF-8 and lone surrogates are refused, and the record's own
validators (`wire`: token counts, windows, deadlines) run as they do for `codec.wire`. What it lets
through that the strict decoder refuses: a duplicate key (the last one counts). Whatever it is
given, `decode` raises ContractError and nothing else. Signed messages and request bodies keep the
strict decoder (`codec.loads`).
"""

from __future__ import annotations

from typing import Annotated, Any, Final, TypeVar

import attrs
import msgspec

from nexa.contracts import codec, wire
from nexa.errors import ContractError

T = TypeVar("T")

_Str = Annotated[str, msgspec.Meta(max_length=codec.WIRE_LIMITS.max_string_chars)]


# Typed mirrors of the heads, for the decoder only: msgspec refuses unknown keys of a Struct (not of
# an attrs class), then the attrs record is built from the fields, its validators included.
class _InferHead(msgspec.Struct, forbid_unknown_fields=True):
    assignment_id: _Str
    path: _Str
    stream: bool
    deadline_at: float
    window: int
    strip_usage_chunk: bool = False
    prompt_tokens_estimate: int = 0
    content_type: _Str = "application/json"
    lora: _Str = ""
    method: wire.RuntimeMethod = wire.RuntimeMethod.POST


class _EndHead(msgspec.Struct, forbid_unknown_fields=True):
    status: wire.EndStatus
    code: _Str | None = None
    http_status: int | None = None
    message: _Str = ""
    first_byte_sent: bool = False
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    runtime_ms: float = 0.0
    overhead_ms: float | None = None


class _ChunkHead(msgspec.Struct, forbid_unknown_fields=True):
    overhead_ms: float | None = None


class _CancelHead(msgspec.Struct, forbid_unknown_fields=True):
    reason: _Str = ""


class _CreditHead(msgspec.Struct, forbid_unknown_fields=True):
    chunks: int


_MIRRORS: Final[dict[type[Any], type[msgspec.Struct]]] = {
    wire.InferHead: _InferHead,
    wire.EndHead: _EndHead,
    wire.ChunkHead: _ChunkHead,
    wire.CancelHead: _CancelHead,
    wire.CreditHead: _CreditHead,
}
_DECODERS: Final = {cls: msgspec.json.Decoder(mirror) for cls, mirror in _MIRRORS.items()}
_FIELDS: Final = {cls: tuple(a.name for a in attrs.fields(cls)) for cls in _MIRRORS}
#: Each head's fields and their defaults (`attrs.NOTHING`, never equal to a value, for none).
_DEFAULTS: Final = {cls: tuple((a.name, a.default) for a in attrs.fields(cls)) for cls in _MIRRORS}
# Sorted keys: `codec.wire`'s canonical form.
_ENCODER: Final = msgspec.json.Encoder(order="sorted")


def encode(head: wire.InferHead | wire.EndHead | wire.ChunkHead | wire.CancelHead | wire.CreditHead) -> bytes:
    """A head's JSON, as `codec.dumps(codec.wire_sent, head)` writes it: its fields at their
    defaults left out (an older peer reads a head that uses nothing it lacks; `contracts.wire`)."""
    # Compared with ==, as cattrs does (msgspec's own `omit_defaults` compares by identity).
    return _ENCODER.encode(
        {name: value for name, default in _DEFAULTS[type(head)] if (value := getattr(head, name)) != default}
    )


def decode(raw: bytes, cls: type[T]) -> T:
    """The head of class `cls` (one of the five) in `raw`. Raises ContractError for any input it
    refuses (the module docstring says what), and nothing else."""
    try:
        mirror = _DECODERS[cls].decode(raw)
        return cls(**{name: getattr(mirror, name) for name in _FIELDS[cls]})
    except msgspec.DecodeError as exc:  # ValidationError included
        raise ContractError(f"invalid head: {exc}") from None
    except (ValueError, TypeError, OverflowError) as exc:  # the record's validators; huge integers
        raise ContractError(f"invalid head: {exc}") from None
