"""One declaration per HTTP route, beside its handler: `@route(...)` on a plain async function.

A resource module (`http.keys`, `http.nodes`, …) declares each of its routes once: method, path,
the roles that may call it (`None`: no credential), the request and answer contract types, the
status, its particular errors and its description. From those declarations (`http.resources`
lists the modules) `api.create_app` builds the router and checks roles before any handler runs,
`openapi` builds the document, and the console's role checks read the same table
(`role_table`). The inference routes (plain ASGI, `datapath.inference`) are declared with the same
type, without a handler here. No quart and no I/O here.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Iterable, Mapping
from types import ModuleType
from typing import Any, Final, Literal

import attrs

from nexa.contracts import pages
from nexa.contracts.domain import Role
from nexa.errors import NexaError

JSON: Final = "application/json"

_A, _O, _I, _AU, _M = Role.ADMIN, Role.OPERATOR, Role.INFERENCE, Role.AUDIT, Role.MONITORING
#: The role sets routes share (a route may also name its own).
ADMIN: Final = frozenset({_A})
OPERATORS: Final = frozenset({_O, _A})
AUDITORS: Final = frozenset({_AU, _A})
MONITORS: Final = frozenset({_M, _A})
INFERENCE: Final = frozenset({_I})

#: What serves a route: called with the app state and the path's parameters (by name).
Handler = Callable[..., Awaitable[Any]]
RouteKey = tuple[str, str]


@attrs.frozen(kw_only=True)
class Param:
    """A query or header parameter; `schema` is a type the walker knows, or a JSON Schema."""

    name: str
    schema: Any
    where: Literal["query", "header"] = "query"
    description: str = ""
    deprecated: bool = False


@attrs.frozen(kw_only=True)
class Route:
    """One route, whole: what the router, the role check, the console and the OpenAPI document read.
    Types are contract classes (walked into schemas)."""

    method: str
    #: The rule, with `<name>` path parameters (quart's syntax; `{name}` in the document).
    path: str
    #: The roles that may call it; `None`: no credential is needed.
    roles: frozenset[Role] | None
    summary: str
    tag: str
    #: The JSON body: a contract class, or a JSON Schema (the OpenAI bodies, which are free-form).
    body: Any = None
    #: `optional`: no body (or `{}`) means every default; `empty`: the route takes none, or `{}`.
    body_kind: Literal["required", "optional", "empty", "none"] = "none"
    answer: Any = None
    status: int = 200
    #: Other media types the success answer may have (`text/event-stream` for streams, CSV, metrics).
    also: tuple[str, ...] = ()
    media: str = JSON
    params: tuple[Param, ...] = ()
    #: Errors particular to this route, over those every route of its kind can answer.
    errors: tuple[type[NexaError], ...] = ()
    #: What serves it (`handler(state, **path_params)`); None: served by another front end (inference).
    handler: Handler | None = attrs.field(default=None, eq=False, repr=False)
    #: The error body's JSON Schema when it is not the shape of the route's kind (Anthropic's on `/v1/messages`).
    error_shape: Any = None
    #: The request body's media type (`multipart/form-data` for the media uploads).
    body_media: str = JSON

    @property
    def key(self) -> RouteKey:
        return (self.method, self.path)


_NO_ROLES: Final[Any] = object()


def route(
    method: str,
    path: str,
    *,
    roles: frozenset[Role] | None = _NO_ROLES,
    summary: str,
    tag: str,
    request: Any = None,
    body_kind: Literal["required", "optional", "empty", "none"] | None = None,
    answer: Any = None,
    status: int = 200,
    also: tuple[str, ...] = (),
    media: str = JSON,
    params: tuple[Param, ...] = (),
    errors: tuple[type[NexaError], ...] = (),
) -> Callable[[Handler], Route]:
    """Declare the decorated handler's route. `roles` must be given (`None` for a keyless route);
    a `request` type is a required body unless `body_kind` says otherwise."""
    if roles is _NO_ROLES:
        raise TypeError(f"{method} {path}: name its roles (None for a route that needs no credential)")
    kind = body_kind or ("required" if request is not None else "none")

    def declare(handler: Handler) -> Route:
        return Route(
            method=method,
            path=path,
            roles=roles,
            summary=summary,
            tag=tag,
            body=request,
            body_kind=kind,
            answer=answer,
            status=status,
            also=also,
            media=media,
            params=params,
            errors=errors,
            handler=handler,
        )

    return declare


def declared(module: ModuleType) -> list[Route]:
    """The routes a module declares (its `Route` globals whose handler it defines), in the order it
    declares them; a route it imports from another module is that module's."""
    return [
        value
        for value in vars(module).values()
        if isinstance(value, Route) and getattr(value.handler, "__module__", module.__name__) == module.__name__
    ]


def collect(modules: Iterable[ModuleType]) -> tuple[Route, ...]:
    """Every route the modules declare; a route declared twice is an error naming both modules."""
    seen: dict[RouteKey, str] = {}
    out: list[Route] = []
    for module in modules:
        for r in declared(module):
            if r.key in seen:
                raise LookupError(f"{r.method} {r.path} is declared in {seen[r.key]} and in {module.__name__}")
            seen[r.key] = module.__name__
            out.append(r)
    return tuple(out)


def role_table(routes: Iterable[Route]) -> Mapping[RouteKey, frozenset[Role] | None]:
    """Route → the roles that may call it (`None`: no credential); a route not in it is refused."""
    return {r.key: r.roles for r in routes}


PAGE_QUERY: Final = (
    Param(
        name="cursor",
        schema={"type": "string", "minLength": 1, "maxLength": pages.MAX_CURSOR_CHARS},
        description="opaque: the next_cursor of the previous page; left out for the first page",
    ),
    Param(
        name="limit",
        schema={"type": "integer", "minimum": 1, "maximum": pages.MAX_LIMIT, "default": pages.DEFAULT_LIMIT},
        description="items per page",
    ),
)

#: A time parameter's schema.
UNIX_S: Final = {"type": "number", "description": "Unix seconds"}
