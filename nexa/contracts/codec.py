"""The private cattrs converters (api, store, wire) and their dumps/loads helpers.

This is the only place structure hooks are registered. Each boundary has its own converter
and every converter rejects unknown keys.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Callable
from typing import Any, Final, TypeVar

import attrs
import cattrs
import cattrs.cols
from cattrs.gen import make_dict_structure_fn, make_dict_unstructure_fn, override
from cattrs.preconf.json import make_converter

from nexa.errors import ContractError

T = TypeVar("T")


def _make() -> cattrs.Converter:
    conv = make_converter(forbid_extra_keys=True, omit_if_default=False)
    register_strict_hooks(conv)
    # Free-form JSON fields (`dict[str, object]`) pass through as parsed. A predicate, not a
    # class hook: a hook on `object` would match every class through singledispatch.
    conv.register_structure_hook_func(lambda type_: type_ is object, lambda value, _: value)
    # JSON names that are Python keywords: a class lists them as `JSON_NAMES = {"from_": "from"}`.
    conv.register_structure_hook_factory(_renamed, _renamed_structure)
    conv.register_unstructure_hook_factory(_renamed, _renamed_unstructure)
    return conv


def _renamed(type_: Any) -> bool:
    return attrs.has(type_) and bool(getattr(type_, "JSON_NAMES", None))


def _overrides(type_: Any) -> dict[str, Any]:
    return {attr: override(rename=key) for attr, key in type_.JSON_NAMES.items()}


def _renamed_structure(type_: Any, conv: cattrs.Converter) -> Any:
    return make_dict_structure_fn(type_, conv, _cattrs_forbid_extra_keys=True, **_overrides(type_))


def _renamed_unstructure(type_: Any, conv: cattrs.Converter) -> Any:
    return make_dict_unstructure_fn(type_, conv, _cattrs_omit_if_default=False, **_overrides(type_))


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
#: Southbound controller⇄node message bodies (`contracts/wire.py`).
wire: Final = _make()


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
    except (cattrs.BaseValidationError, ValueError, TypeError, KeyError) as exc:
        problems = describe(exc)
        raise ContractError("invalid body: " + "; ".join(problems), problems=problems) from None


def loads(conv: cattrs.Converter, raw: bytes | str, cls: type[T]) -> T:
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ContractError(f"body is not valid JSON: {exc.msg if hasattr(exc, 'msg') else exc}") from None
    return structure(conv, data, cls)


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
