"""The private cattrs converters (api, store, wire) and their dumps/loads helpers.

This is the only place structure hooks are registered. Each boundary has its own converter
and every converter rejects unknown keys.
"""

from __future__ import annotations

import enum
import hashlib
import json
import math
import re
from collections.abc import Callable
from typing import Any, Final, TypeVar

import attrs
import cattrs
import cattrs.cols
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override
from cattrs.preconf.json import make_converter

from nexa.errors import ContractError

T = TypeVar("T")


def _make(*, omit_defaults: bool = False) -> cattrs.Converter:
    conv = make_converter(forbid_extra_keys=True, omit_if_default=omit_defaults)
    register_strict_hooks(conv)
    # Free-form JSON fields (`dict[str, object]`) pass through as parsed. A predicate, not a
    # class hook: a hook on `object` would match every class through singledispatch.
    conv.register_structure_hook_func(lambda type_: type_ is object, lambda value, _: value)
    # JSON names that are Python keywords: a class lists them as `JSON_NAMES = {"from_": "from"}`.
    conv.register_structure_hook_factory(_renamed, _renamed_structure)
    conv.register_unstructure_hook_factory(
        _overridden, lambda type_, c: _overridden_unstructure(type_, c, omit_defaults=omit_defaults)
    )
    return conv


def _renamed(type_: Any) -> bool:
    return attrs.has(type_) and bool(getattr(type_, "JSON_NAMES", None))


def _overridden(type_: Any) -> bool:
    return _renamed(type_) or (attrs.has(type_) and bool(getattr(type_, "ALWAYS_SENT", None)))


def _overrides(type_: Any) -> dict[str, Any]:
    return {attr: override(rename=key) for attr, key in getattr(type_, "JSON_NAMES", {}).items()}


def _renamed_structure(type_: Any, conv: cattrs.Converter) -> Any:
    return make_dict_structure_fn(type_, conv, _cattrs_forbid_extra_keys=True, **_overrides(type_))


def _overridden_unstructure(type_: Any, conv: cattrs.Converter, *, omit_defaults: bool) -> Any:
    """A class's JSON names (`JSON_NAMES`), and the fields written even at their defaults
    (`ALWAYS_SENT`: what an older peer must not take its own default for, such as a version)."""
    fields = _overrides(type_)
    for attr in getattr(type_, "ALWAYS_SENT", ()):
        fields[attr] = override(omit_if_default=False, rename=getattr(type_, "JSON_NAMES", {}).get(attr))
    return make_dict_unstructure_fn(type_, conv, _cattrs_omit_if_default=omit_defaults, **fields)


def register_strict_hooks(conv: cattrs.Converter) -> None:
    """No coercion: a string is not a number, `true` is not an integer, enums take their values."""
    # bool is an int in Python; never let `true` pass for a number, nor a number for a string.
    conv.register_structure_hook(int, _strict_int)
    conv.register_structure_hook(bool, _strict_bool)
    conv.register_structure_hook(float, _strict_float)
    conv.register_structure_hook(str, _strict_str)
    # StrEnum sits before str in an enum's MRO, so this keeps enums out of the str hook.
    conv.register_structure_hook(enum.StrEnum, _strict_enum)
    # cattrs would iterate a string into characters ("ab" -> ["a", "b"]): demand a JSON list.
    conv.register_structure_hook_factory(cattrs.cols.is_sequence, _list_only)  # copies pass themselves


def _list_only(type_: Any, conv: cattrs.Converter) -> Callable[[object, Any], Any]:
    if cattrs.cols.is_mutable_sequence(type_):
        inner = cattrs.cols.list_structure_factory(type_, conv)
    else:
        inner = cattrs.cols.homogenous_tuple_structure_factory(type_, conv)

    def structure(value: object, t: Any) -> Any:
        if not isinstance(value, list | tuple):
            raise ValueError(f"expected a list, got {type(value).__name__}")
        return inner(value, t)

    return structure


def _strict_int(value: object, _: type) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"expected an integer, got {type(value).__name__}")
    return value


def _strict_bool(value: object, _: type) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"expected true or false, got {type(value).__name__}")
    return value


def _strict_enum(value: object, type_: type[enum.StrEnum]) -> enum.StrEnum:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {type(value).__name__}")
    try:
        return type_(value)
    except ValueError:
        raise ValueError("must be one of " + ", ".join(m.value for m in type_)) from None


def _strict_float(value: object, _: type) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"expected a number, got {type(value).__name__}")
    return float(value)


def _strict_str(value: object, _: type) -> str:
    if not isinstance(value, str):
        raise ValueError(f"expected a string, got {type(value).__name__}")
    return value


#: Northbound HTTP bodies.
api: Final = _make()
#: JSON bodies kept in the store.
store: Final = _make()
#: Southbound controller⇄node message bodies (`contracts/wire.py`), read, and written in full where
#: they are hashed or signed as records (a replica's spec digest, receipts): those bytes never change.
wire: Final = _make()
#: The same bodies as they are sent (`channel.framing`): a field at its default is left out, and the
#: receiver's decoder (`wire`) gives it back. So a peer of an earlier release, which refuses fields it
#: does not know, reads every message that uses none of the fields added since; a field an older
#: peer must not take its own default for is written always (a class's `ALWAYS_SENT`). Rule for
#: every wire field added: it has a default meaning "not used", and that default never changes.
wire_sent: Final = _make(omit_defaults=True)


def describe(exc: BaseException) -> tuple[str, ...]:
    """Turn a cattrs validation error into `path: problem` lines, one per bad field or key."""
    if not isinstance(exc, cattrs.BaseValidationError):
        return (str(exc),)
    out: list[str] = []
    for line in cattrs.transform_error(exc, path="$", format_exception=_format_problem):
        problem, _, path = line.rpartition(" @ ")
        where = path.removeprefix("$").removeprefix(".")
        if problem.startswith(_UNKNOWN):
            names = problem.removeprefix(_UNKNOWN).split(", ")
            out.extend(f"{where + '.' if where else ''}{name}: unknown key" for name in names)
        else:
            out.append(f"{where or '(top level)'}: {problem}")
    return tuple(out)


_UNKNOWN: Final = "unknown keys: "


def _format_problem(exc: BaseException, type_: Any) -> str:
    if isinstance(exc, cattrs.ForbiddenExtraKeysError):
        return _UNKNOWN + ", ".join(sorted(exc.extra_fields))
    if isinstance(exc, KeyError):
        return "required key is missing"
    if isinstance(exc, ValueError | TypeError) and str(exc):
        return str(exc)
    return cattrs.v.format_exception(exc, type_)


def structure(conv: cattrs.Converter, data: Any, cls: type[T]) -> T:
    """Structure `data` into `cls` or raise ContractError naming every bad field."""
    if attrs.has(cls) and not isinstance(data, dict):
        raise ContractError("invalid body: expected a JSON object", problems=("(top level): expected an object",))
    try:
        return conv.structure(data, cls)
    except (cattrs.BaseValidationError, ValueError, TypeError, KeyError, ArithmeticError, AttributeError) as exc:
        problems = describe(exc)
        raise ContractError("invalid body: " + "; ".join(problems), problems=problems) from None


def loads(conv: cattrs.Converter, raw: bytes | str, cls: type[T], *, limits: DecodeLimits | None = None) -> T:
    """Strictly parse `raw` (`parse_json`, with the converter's limits) and structure it into `cls`.

    Raises ContractError, and nothing else, for any input.
    """
    return structure(conv, parse_json(raw, limits or limits_of(conv)), cls)


# --- the one strict JSON decoder ------------------------------------------------------------------

#: The largest magnitude of an integer any decoder accepts: a signed 64-bit integer (SQLite's
#: INTEGER). Contract types bound their own fields further (token counts: `MAX_TOKENS`).
MAX_INT: Final = 2**63 - 1
#: An integer literal longer than this is refused before it is converted (sign included).
_MAX_INT_CHARS: Final = 20


@attrs.frozen(kw_only=True)
class DecodeLimits:
    """Bounds one boundary's decoder enforces on every JSON document, whatever its contract."""

    #: Deepest nesting of arrays and objects (the document itself is depth 1).
    max_depth: int
    #: Longest string, keys included (characters).
    max_string_chars: int
    #: Most items in one array.
    max_array_items: int
    #: Most keys in one object.
    max_object_keys: int


#: Node⇄controller message bodies and data-path heads (`codec.wire`).
WIRE_LIMITS: Final = DecodeLimits(max_depth=32, max_string_chars=64 * 1024, max_array_items=4096, max_object_keys=1024)
#: Northbound HTTP bodies (`codec.api`); the body size limit bounds them first.
API_LIMITS: Final = DecodeLimits(
    max_depth=64, max_string_chars=16 * 1024 * 1024, max_array_items=1 << 20, max_object_keys=1 << 16
)
#: What the controller wrote itself (`codec.store`): generous, but never unbounded.
STORE_LIMITS: Final = DecodeLimits(
    max_depth=128, max_string_chars=64 * 1024 * 1024, max_array_items=1 << 24, max_object_keys=1 << 20
)

_SURROGATE: Final = re.compile("[\ud800-\udfff]")


class _Refused(ValueError):
    """Raised inside `json.loads` hooks; becomes a ContractError."""


def _parse_int(text: str) -> int:
    if len(text) > _MAX_INT_CHARS:
        raise _Refused(f"an integer beyond ±{MAX_INT}")
    value = int(text)
    if not -MAX_INT <= value <= MAX_INT:
        raise _Refused(f"an integer beyond ±{MAX_INT}")
    return value


def _parse_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise _Refused("a number too large to represent")
    return value


def _parse_constant(name: str) -> float:
    raise _Refused(f"{name} is not a JSON number")


def _pairs(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        raise _Refused("an object with a duplicate key")
    return out


def parse_json(raw: bytes | bytearray | str, limits: DecodeLimits = WIRE_LIMITS) -> Any:
    """The one strict JSON decoder: UTF-8, no NaN or Infinity, integers within ±`MAX_INT`, no
    duplicate keys, no lone surrogates, and `limits` on depth, string length and sizes.

    Raises ContractError for any input that breaks a rule, and never anything else (no
    RecursionError, OverflowError, UnicodeDecodeError, ...).
    """
    try:
        text = raw if isinstance(raw, str) else bytes(raw).decode("utf-8")
        data = json.loads(
            text,
            parse_int=_parse_int,
            parse_float=_parse_float,
            parse_constant=_parse_constant,
            object_pairs_hook=_pairs,
        )
    except _Refused as exc:
        raise ContractError(f"body refused: {exc}") from None
    except json.JSONDecodeError as exc:
        raise ContractError(f"body is not valid JSON: {exc.msg} at position {exc.pos}") from None
    except UnicodeDecodeError:
        raise ContractError("body is not valid JSON: not UTF-8") from None
    except (ValueError, RecursionError, OverflowError, MemoryError, TypeError):
        raise ContractError("body is not valid JSON: nested too deeply or too large") from None
    problem = _tree_problem(data, limits)
    if problem is not None:
        raise ContractError(f"body refused: {problem}")
    return data


def _tree_problem(root: object, limits: DecodeLimits) -> str | None:
    """Why a parsed document breaks `limits`, or None. Iterative: depth costs no stack."""
    stack: list[tuple[object, int]] = [(root, 1)]
    while stack:
        value, depth = stack.pop()
        if isinstance(value, str):
            problem = _string_problem(value, limits)
        elif isinstance(value, list | dict):
            problem = _container_problem(value, depth, limits)
            if problem is None:
                items = value.items() if isinstance(value, dict) else enumerate(value)
                for key, item in items:
                    if isinstance(key, str):
                        stack.append((key, depth))
                    if isinstance(item, str | list | dict):
                        stack.append((item, depth + 1))
        else:
            continue
        if problem is not None:
            return problem
    return None


def _string_problem(value: str, limits: DecodeLimits) -> str | None:
    if len(value) > limits.max_string_chars:
        return f"a string longer than {limits.max_string_chars} characters"
    if not value.isascii() and _SURROGATE.search(value):
        return "a string with an unpaired surrogate"
    return None


def _container_problem(value: list[object] | dict[str, object], depth: int, limits: DecodeLimits) -> str | None:
    if depth > limits.max_depth:
        return f"nested deeper than {limits.max_depth}"
    if isinstance(value, list) and len(value) > limits.max_array_items:
        return f"an array of more than {limits.max_array_items} items"
    if isinstance(value, dict) and len(value) > limits.max_object_keys:
        return f"an object of more than {limits.max_object_keys} keys"
    return None


def limits_of(conv: cattrs.Converter) -> DecodeLimits:
    """The decoder limits of one of this module's converters (copies get the API's)."""
    if conv is wire:
        return WIRE_LIMITS
    if conv is store:
        return STORE_LIMITS
    return API_LIMITS


def dumps(conv: cattrs.Converter, obj: object) -> str:
    return canonical_json(conv.unstructure(obj))


def canonical_json(data: object) -> str:
    """The one canonical encoding: sorted keys, no spaces, UTF-8, no NaN."""
    return json.dumps(data, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def sha256_of(conv: cattrs.Converter, obj: object | None) -> str | None:
    """Digest of an object's canonical form (None stays None: 'no state')."""
    if obj is None:
        return None
    return hashlib.sha256(dumps(conv, obj).encode()).hexdigest()
