"""The campaign runner: steps run one after another, each timed and judged, with a live line per
step, then a table and a `SimSummary` (`nexa.contracts.evidence`).

A step is an async function of the campaign's context that returns its figures, or raises
`StepFailed` (what was expected and what was seen, with the figures so far). Any other error of a
step fails that step too, named by its type and message; the campaign goes on with the next one.
Steps not picked are `skipped`. The runner knows nothing of clusters: the unit tests run it with
fake steps.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Final, Generic, TypeVar

import attrs
import trio

from nexa import __version__
from nexa.contracts.evidence import SimStep, SimSummary, StepVerdict
from nexa.errors import NexaError

C = TypeVar("C")
Figures = dict[str, float | int | str]
#: The longest detail kept of a failed step.
MAX_DETAIL_CHARS: Final = 400


class StepFailed(Exception):
    """A step's assertion did not hold: `detail` says what was expected and what was seen."""

    def __init__(self, detail: str, figures: Figures | None = None) -> None:
        super().__init__(detail)
        self.detail = detail
        self.figures = figures or {}


def check(condition: bool, detail: str, figures: Figures | None = None) -> None:
    """Raise `StepFailed(detail)` unless `condition`."""
    if not condition:
        raise StepFailed(detail, figures)


@attrs.frozen
class Step(Generic[C]):
    name: str
    run: Callable[[C], Awaitable[Figures]]


class UnknownSteps(ValueError):
    """`--steps` named steps the campaign does not have."""

    def __init__(self, unknown: list[str], known: Sequence[str]) -> None:
        super().__init__(f"unknown step(s): {', '.join(unknown)}; the steps are: {', '.join(known)}")
        self.unknown = unknown


def pick(names: Sequence[str], wanted: str | None) -> list[str]:
    """The names `--steps a,b` picks, in campaign order (all when `wanted` is None or empty)."""
    if not wanted:
        return list(names)
    asked = [w.strip() for w in wanted.split(",") if w.strip()]
    unknown = [w for w in asked if w not in names]
    if unknown:
        raise UnknownSteps(unknown, names)
    return [n for n in names if n in asked]


def live_line(index: int, total: int, step: SimStep) -> str:
    """`[3/9] ready-routing … pass (2.1 s)`, with why when it failed."""
    line = f"[{index}/{total}] {step.name} … {step.verdict.value} ({step.duration_s:.1f} s)"
    return f"{line}: {step.detail}" if step.detail else line


async def run_campaign(
    steps: Sequence[Step[C]],
    picked: Sequence[str],
    context: C,
    *,
    seed: int,
    say: Callable[[str], None] = lambda _: None,
    progress: Callable[[int, int, SimStep], Awaitable[None]] | None = None,
) -> SimSummary:
    """Run the picked steps in campaign order; `say` gets each live line, `progress` each step's
    result (done, total, step) as it ends."""
    started_at, t0 = time.time(), trio.current_time()
    chosen = [s for s in steps if s.name in picked]
    results: dict[str, SimStep] = {}
    for index, step in enumerate(chosen, start=1):
        result = await _run_step(step, context)
        results[step.name] = result
        say(live_line(index, len(chosen), result))
        if progress is not None:
            await progress(index, len(chosen), result)
    ordered = [results.get(s.name) or SimStep(name=s.name, verdict=StepVerdict.SKIPPED, duration_s=0.0) for s in steps]
    return SimSummary(
        passed=bool(chosen) and all(r.verdict is StepVerdict.PASS for r in results.values()),
        nexa_version=__version__,
        seed=seed,
        started_at=started_at,
        duration_s=trio.current_time() - t0,
        steps=ordered,
    )


async def _run_step(step: Step[C], context: C) -> SimStep:
    t0 = trio.current_time()
    verdict, figures, detail = StepVerdict.PASS, {}, ""
    try:
        figures = await step.run(context)
    except Exception as exc:  # any error of a step fails that step, and the campaign goes on
        leaf = _leaf(exc)
        if isinstance(leaf, StepFailed):
            verdict, figures, detail = StepVerdict.FAIL, leaf.figures, leaf.detail
        else:
            message = leaf.message if isinstance(leaf, NexaError) else str(leaf)
            verdict, detail = StepVerdict.FAIL, f"{type(leaf).__name__}: {message}"
    return SimStep(
        name=step.name,
        verdict=verdict,
        duration_s=max(0.0, trio.current_time() - t0),
        figures=figures,
        detail=detail[:MAX_DETAIL_CHARS],
    )


def _leaf(exc: BaseException) -> BaseException:
    """The first error inside the nurseries' groups (a step's own nursery wraps what it raised)."""
    while isinstance(exc, BaseExceptionGroup):
        exc = exc.exceptions[0]
    return exc


def table(summary: SimSummary) -> str:
    """The steps as an aligned table: step, verdict, seconds, figures."""
    rows = [("STEP", "VERDICT", "SECONDS", "FIGURES")]
    for step in summary.steps:
        figures = " ".join(f"{k}={_figure(v)}" for k, v in step.figures.items())
        seconds = f"{step.duration_s:.1f}" if step.verdict is not StepVerdict.SKIPPED else "-"
        rows.append((step.name, step.verdict.value, seconds, figures))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    lines = [f"{r[0]:<{widths[0]}}  {r[1]:<{widths[1]}}  {r[2]:>{widths[2]}}  {r[3]}".rstrip() for r in rows]
    verdict = "passed" if summary.passed else "FAILED"
    lines.append(f"sim {verdict} in {summary.duration_s:.1f} s (seed {summary.seed}, nexa {summary.nexa_version})")
    return "\n".join(lines)


def _figure(value: float | int | str) -> str:
    return f"{value:.3g}" if isinstance(value, float) else str(value)
