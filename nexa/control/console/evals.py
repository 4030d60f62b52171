"""Evaluation runs compared: `/console/evals/compare?a=RUN&b=RUN` shows, per metric both runs measured,
B - A of the pass rate and of the mean score with their 95% intervals (what `nexa eval compare` and
`GET /api/v1/eval/compare` give), each run's own figures, and the newest runs to pick from.

Seen by the keys that may see the Models view and call the compare route. Everything in a run came
from a client (the CLI posted it): the templates escape it.
"""

from __future__ import annotations

from typing import Any, Final

from quart import Blueprint, request

from nexa.contracts.evals import EvalCompare, EvalRun
from nexa.control.console.pages import Console, Refused
from nexa.control.operations.evals import Evals

#: The newest runs listed to pick from.
RECENT: Final = 20
_COMPARE: Final = ("GET", "/api/v1/eval/compare")


def register(bp: Blueprint, console: Console) -> None:
    state = console.state

    @bp.get("/console/evals/compare")
    @console.handler
    async def compare_page() -> Any:
        session = console.signed_in()
        console.view_allowed(session, "models")
        if not console.may(session, _COMPARE):
            raise Refused(403, f"role {session.role} may not compare evaluation runs")
        evals = Evals.of(state.evals)
        a, b = (request.args.get(k, "").strip()[:64] for k in ("a", "b"))
        found: EvalCompare | None = None
        runs: tuple[EvalRun, EvalRun] | None = None
        if a or b:
            if not (a and b):
                raise Refused(400, "give both runs: A (compared against) and B")
            runs = (await evals.run(a), await evals.run(b))
            found = await evals.compare(a, b)
        recent, _ = await evals.page(None, None, RECENT)
        return await console.page(
            session,
            "models",
            "eval_compare.html",
            title="Evaluation runs compared",
            a=a,
            b=b,
            found=found,
            runs=runs,
            recent=recent,
        )
