"""JSON Schema (2020-12, as OpenAPI 3.1 has it) of the contract types, as the API codec reads and
writes them: the OpenAPI document (`control/http/openapi.py`) describes every body with it. Pure; no I/O."""

from __future__ import annotations

import enum
import inspect
import json
import types
import typing
from collections.abc import Mapping
from typing import Any, Final, Literal

import attrs

from nexa.contracts import codec

Json = dict[str, Any]


class JsonSchemas:
    """Contract types → JSON Schema (2020-12, as OpenAPI 3.1 has it); classes and enums become
    components, referred to by `$ref`."""

    def __init__(self) -> None:
        self.components: Json = {}
        self._names: dict[type, str] = {}

    def of(self, tp: Any) -> Json:  # noqa: PLR0911, PLR0912 -- one case per kind of annotation
        if isinstance(tp, dict):
            return tp  # a JSON Schema given as data
        if tp is None or tp is type(None):
            return {"type": "null"}
        supertype = getattr(tp, "__supertype__", None)
        if supertype is not None:  # a NewType id
            return self.of(supertype)
        origin = typing.get_origin(tp)
        args = typing.get_args(tp)
        if origin in {typing.Union, types.UnionType}:
            return {"anyOf": [self.of(a) for a in args]}
        if origin is Literal:
            return {"enum": list(args)}
        if origin in {list, tuple} and (origin is list or (len(args) == 2 and args[1] is Ellipsis)):
            return {"type": "array", "items": self.of(args[0])}
        if origin is tuple:
            return {
                "type": "array",
                "prefixItems": [self.of(a) for a in args],
                "minItems": len(args),
                "maxItems": len(args),
            }
        if origin is dict:
            return {"type": "object", "additionalProperties": self.of(args[1])}
        if tp is bool:
            return {"type": "boolean"}
        if tp is int:
            return {"type": "integer", "minimum": -codec.MAX_INT, "maximum": codec.MAX_INT}
        if tp is float:
            return {"type": "number"}
        if tp is str:
            return {"type": "string"}
        if tp is object or tp is Any:
            return {}
        if inspect.isclass(tp) and issubclass(tp, enum.Enum):
            return self._component(tp, lambda: {"type": "string", "enum": [m.value for m in tp]})
        if inspect.isclass(tp) and attrs.has(tp):
            return self._component(tp, lambda: self._object(tp))
        raise TypeError(f"no JSON Schema for {tp!r}")

    def _component(self, cls: type, build: typing.Callable[[], Json]) -> Json:
        name = self._names.get(cls)
        if name is None:
            name = cls.__name__ if cls.__name__ not in self.components else f"{cls.__module__}.{cls.__name__}"
            name = name.replace("nexa.contracts.", "").replace(".", "_")
            self._names[cls] = name
            self.components[name] = {}  # reserved first: a class may refer to itself
            schema = build()
            doc = inspect.getdoc(cls)
            if doc and doc != inspect.getdoc(cls.__mro__[1]):
                schema["description"] = doc.split("\n\n")[0].replace("\n", " ")
            self.components[name] = schema
        return {"$ref": f"#/components/schemas/{name}"}

    def _object(self, cls: type) -> Json:
        """An attrs class as the API codec reads and writes it: every field a key (renamed by
        `JSON_NAMES`), fields without a default required, no other key allowed."""
        hints = typing.get_type_hints(cls)
        renamed: Mapping[str, str] = getattr(cls, "JSON_NAMES", None) or {}
        props: Json = {}
        required: list[str] = []
        for field in attrs.fields(cls):
            if not field.init:
                continue  # cattrs neither reads nor writes these
            key = renamed.get(field.name, field.name)
            schema = dict(self.of(hints[field.name]))
            default = json_default(field)
            if field.default is attrs.NOTHING:
                required.append(key)
            elif default is not NO_DEFAULT:
                schema = {"allOf": [schema], "default": default} if "$ref" in schema else {**schema, "default": default}
            props[key] = schema
        out: Json = {"type": "object", "properties": props, "additionalProperties": False}
        if required:
            out["required"] = required
        return out


NO_DEFAULT: Final = object()


def json_default(field: attrs.Attribute[Any]) -> object:
    """A field's default as JSON, or `NO_DEFAULT` when it has none that JSON can show."""
    default = field.default
    if default is attrs.NOTHING:
        return NO_DEFAULT
    factory = getattr(default, "factory", None)  # an `attrs.Factory` (a function to mypy)
    if callable(factory):
        if getattr(default, "takes_self", False):
            return NO_DEFAULT
        default = factory()
    try:
        return json.loads(codec.dumps(codec.api, default))
    except (TypeError, ValueError):
        return NO_DEFAULT
