"""`nexa sim` put together: the cluster started, the campaign run (recorded as a `sim` job on the
sim's own controller, and on the operator's with `--report-to`), the summary and public answers
written, everything stopped."""

from __future__ import annotations

import contextlib
import random
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

import trio

from nexa.contracts import codec
from nexa.contracts.evidence import JobCreate, JobKind, JobState, JobUpdate, SimStep, SimSummary, StepVerdict
from nexa.errors import NexaError
from nexa.sim import cluster as parts
from nexa.sim.campaign import run_campaign
from nexa.sim.load import Api
from nexa.sim.steps import STEPS, Campaign

#: The longest the last job updates may take when the campaign is interrupted or breaks.
REPORT_TIMEOUT_S: Final = 5.0


async def _job(api: Api, seed: int, *, say: Callable[[str], None] | None = None) -> str | None:
    """A `sim` job on the controller, or None where it has no jobs API (it is optional; `say`
    tells the operator why, for the controller they asked to report to)."""
    body = codec.api.unstructure(JobCreate(kind=JobKind.SIM, title=f"sim seed {seed}"))
    try:
        job = await api.post("/api/v1/jobs", body)
    except NexaError as exc:
        if say is not None:
            say(f"not reporting to {api.url}: {exc.message}")
        return None
    return str(job["id"]) if isinstance(job, dict) and "id" in job else None


async def _update(jobs: Sequence[tuple[Api, str | None]], update: JobUpdate) -> None:
    for api, job in jobs:
        if job is None:
            continue
        try:
            await api.post(f"/api/v1/jobs/{job}", codec.api.unstructure(update))
        except NexaError:
            continue  # the job record is a convenience; the campaign's verdict does not depend on it


def interrupted(exc: BaseException) -> bool:
    """Whether `exc` is Ctrl-C (SIGINT), alone or as every leaf of the nurseries' group."""
    if isinstance(exc, BaseExceptionGroup):
        return exc.split(KeyboardInterrupt)[1] is None
    return isinstance(exc, KeyboardInterrupt)


async def campaign(
    state_dir: Path,
    picked: Sequence[str],
    *,
    seed: int,
    say: Callable[[str], None],
    public_answers: Path | None = None,
    report_to: tuple[str, str] | None = None,
) -> SimSummary:
    """Start the cluster in `state_dir`, run the picked steps, stop everything (also on failure).
    `report_to` (url, operator key): a controller that records the campaign as a `sim` job too."""
    say(f"starting the sim cluster in {state_dir} (registry, S3, nexa control, {parts.NODES} nodes)…")
    cluster = await parts.start(state_dir)
    reporting = contextlib.AsyncExitStack()
    jobs: list[tuple[Api, str | None]] = []
    try:
        api = cluster.the_api()
        jobs.append((api, await _job(api, seed)))
        if report_to is not None:
            operator = Api(*report_to)
            reporting.push_async_callback(operator.aclose)
            jobs.append((operator, await _job(operator, seed, say=say)))
        context = Campaign(
            cluster=cluster,
            rng=random.Random(seed),  # noqa: S311 - reproducible load, not secrets
            canary=f"nexa-canary-{secrets.token_hex(12)}",
        )

        async def progress(done: int, total: int, step: SimStep) -> None:
            await _update(jobs, JobUpdate(progress=done / total, summary=f"{step.name}: {step.verdict.value}"))

        summary = await run_campaign(STEPS, picked, context, seed=seed, say=say, progress=progress)
        failed = [s.name for s in summary.steps if s.verdict is StepVerdict.FAIL]
        await _update(
            jobs,
            JobUpdate(
                state=JobState.SUCCEEDED if summary.passed else JobState.FAILED,
                progress=1.0,
                summary="all steps passed" if summary.passed else "failed: " + ", ".join(failed),
            ),
        )
        if public_answers is not None:
            await trio.to_thread.run_sync(cluster.answers.write, public_answers)
    except BaseException as exc:
        # Interrupted (Ctrl-C) or broken: the jobs say so before the cluster goes.
        state = JobState.CANCELLED if interrupted(exc) else JobState.FAILED
        with trio.CancelScope(shield=True), trio.move_on_after(REPORT_TIMEOUT_S):
            await _update(jobs, JobUpdate(state=state, summary="interrupted" if interrupted(exc) else "the sim broke"))
        raise
    else:
        return summary
    finally:
        with trio.CancelScope(shield=True):
            await reporting.aclose()
        await parts.stop_cluster(cluster)
