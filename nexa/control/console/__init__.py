"""The operator console: server-rendered pages (Jinja), htmx for partial updates, SSE for live data.

It calls the same registry, fleet, model, deployment, quota and meter methods the API handlers call,
with the signed-in key's `Actor`, so role checks and audit events are the API's own: each view and
action names the API route it mirrors, and its declared roles (handed in by `api.create_app`) decide.
Nothing here logs or renders a payload.

- `sessions`: the signed-in sessions, their CSRF tokens, and the stateless sign-in form;
- `pages`: what every page shares (the session of a request, role checks, rendering, the live
  stream, refusals as pages) and the tables of actions and routes;
- `charts`: the request charts, sampled from the meter's `statistics()`; `fleet_charts`: the GPU
  and runtime charts of the overview and nodes pages, sampled from the Fleet;
- one module per resource, each adding its view and routes: `signin`, `overview`, `nodes`,
  `models`, `deployments`, `benchmarks` (runs and their curves), `jobs` (long-running work),
  `usage` (requests), `audit`, `keys` (keys and quotas), `docs` (the manual, rendered).

Its templates (`templates/console/`) and files (`static/`, the vendored libraries under
`static/vendor/` that `builds/console/vendor.sh` installs) live beside this package.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import trio
from quart import Blueprint
from quart_trio import QuartTrio

from nexa.contracts.domain import Role
from nexa.contracts.text import visible_text
from nexa.control.console import (
    audit,
    benchmarks,
    deployments,
    docs,
    evals,
    jobs,
    keys,
    models,
    nodes,
    overview,
    signin,
    usage,
)
from nexa.control.console.charts import RequestCharts
from nexa.control.console.fleet_charts import FleetCharts
from nexa.control.console.pages import (
    CONSOLE_ROUTES,
    Console,
    ConsoleState,
    ConsoleStatistics,
    Route,
    fmt_age,
    fmt_bytes,
    fmt_duration,
    fmt_time,
)
from nexa.control.console.sessions import (
    ANON_TTL_S,
    COOKIE,
    LOGIN_COOKIE,
    MAX_SESSIONS,
    MAX_SESSIONS_PER_KEY,
    SESSION_TTL_S,
)
from nexa.supervision import supervised


def register(
    app: QuartTrio,
    state: ConsoleState,
    route_roles: Mapping[Route, frozenset[Role] | None],
    *,
    trusted_proxies: Iterable[str] = (),
) -> Console:
    """Add the console's routes to `app`; every one is in `CONSOLE_ROUTES`."""
    console = Console(state, route_roles, trusted_proxies=trusted_proxies)
    charts = RequestCharts(state.meter)
    fleet_charts = FleetCharts(state.fleet)
    app.extensions["nexa.console"] = console  # its statistics(), for tests and diagnostics
    bp = Blueprint("console", __name__, template_folder="templates")
    sampler = trio.CancelScope()

    @app.before_serving
    async def _start_sampler() -> None:
        async def sample() -> None:
            with sampler:
                async with trio.open_nursery() as nursery:
                    nursery.start_soon(supervised, "console.sample", charts.sample_forever)
                    nursery.start_soon(supervised, "console.sample_fleet", fleet_charts.sample_forever)

        app.nursery.start_soon(sample)

    @app.after_serving
    async def _stop_sampler() -> None:
        sampler.cancel()

    app.jinja_env.filters.update(bytes=fmt_bytes, time=fmt_time, age=fmt_age, duration=fmt_duration)
    # Every `{{ value }}` a page shows: control and bidi characters as visible escapes (then HTML-escaped).
    app.jinja_env.finalize = _visible
    app.jinja_env.globals.update(
        node_age=nodes.node_age, node_actions=nodes.NODE_ACTIONS, node_fabric=nodes.node_fabric
    )

    # The navigation lists the views in this order; a signed-in key lands on the first it may see.
    signin.register(bp, console)
    overview.register(bp, console, charts)
    nodes.register(bp, console, fleet_charts)
    models.register(bp, console)
    deployments.register(bp, console)
    benchmarks.register(bp, console)
    evals.register(bp, console)
    jobs.register(bp, console)
    usage.register(bp, console, charts)
    audit.register(bp, console)
    keys.register(bp, console)
    docs.register(bp, console)

    app.register_blueprint(bp)
    return console


__all__ = [
    "ANON_TTL_S",
    "CONSOLE_ROUTES",
    "COOKIE",
    "LOGIN_COOKIE",
    "MAX_SESSIONS",
    "MAX_SESSIONS_PER_KEY",
    "SESSION_TTL_S",
    "Console",
    "ConsoleState",
    "ConsoleStatistics",
    "register",
]


def _visible(value: object) -> object:
    """Jinja's `finalize`: text anyone chose shows its control characters escaped; markup the
    console made itself (`Markup`) and other values pass as they are."""
    return visible_text(value) if type(value) is str else value
