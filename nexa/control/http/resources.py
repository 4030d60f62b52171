"""The management API's resource modules, in one place: each declares its routes beside their
handlers (`http.declare`); `api.create_app` serves and authorizes `ROUTES`, `openapi` describes
them, and the console's role checks read `ROLES`. A new resource module is added here.
"""

from __future__ import annotations

from types import ModuleType
from typing import Final

from nexa.contracts.domain import Role
from nexa.control.http import (
    audit,
    backups,
    deployments,
    evals,
    health,
    idle,
    keys,
    models,
    nodes,
    records,
    retention,
    rollouts,
    runtimes,
    tenants,
    usage,
)
from nexa.control.http.declare import Route, RouteKey, collect, role_table

#: Every resource module of the management API.
MODULES: Final[tuple[ModuleType, ...]] = (
    health,
    keys,
    tenants,
    nodes,
    audit,
    runtimes,
    models,
    deployments,
    idle,
    usage,
    backups,
    records,
    retention,
    evals,
    rollouts,
)
#: Every management route, declared once.
ROUTES: Final[tuple[Route, ...]] = collect(MODULES)
#: Every management route and the roles that may call it; `None` means no credential is needed.
#: A route missing from it is refused for everyone.
ROLES: Final[dict[RouteKey, frozenset[Role] | None]] = dict(role_table(ROUTES))
