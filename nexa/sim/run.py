"""`nexa sim` put together: the cluster started, the campaign run (recorded as a `sim` job where the
controller has `POST /api/v1/jobs`), the summary and public answers written, everything stopped."""

from __future__ import annotations

import random
import secrets
from collections.abc import Callable, Sequence
from pathlib import Path

import trio

from nexa.contracts import codec
from nexa.contracts.evidence import JobCreate, JobKind, JobState, JobUpdate, SimStep, SimSummary, StepVerdict
from nexa.errors import NexaError
from nexa.sim import cluster as parts
from nexa.sim.campaign import run_campaign
from nexa.sim.load import Api
from nexa.sim.steps import STEPS, Campaign


async def _job(api: Api, seed: int) -> str | None:
    """A `sim` job on the controller, or None where it has no jobs API (it is optional)."""
    body = codec.api.unstructure(JobCreate(kind=JobKind.SIM, title=f"sim seed {seed}"))
    try:
        job = await api.post("/api/v1/jobs", body)
    except NexaError:
        return None
    return str(job["id"]) if isinstance(job, dict) and "id" in job else None


async def _update(api: Api, job: str | None, update: JobUpdate) -> None:
    if job is None:
        return
    try:
        await api.post(f"/api/v1/jobs/{job}", codec.api.unstructure(update))
    except NexaError:
        return  # the job record is a convenience; the campaign's verdict does not depend on it


async def campaign(
    state_dir: Path,
    picked: Sequence[str],
    *,
    seed: int,
    say: Callable[[str], None],
    public_answers: Path | None = None,
) -> SimSummary:
    """Start the cluster in `state_dir`, run the picked steps, stop everything (also on failure)."""
    say(f"starting the sim cluster in {state_dir} (registry, S3, nexa control, {parts.NODES} nodes)…")
    cluster = await parts.start(state_dir)
    try:
        api = cluster.the_api()
        job = await _job(api, seed)
        context = Campaign(
            cluster=cluster,
            rng=random.Random(seed),  # noqa: S311 - reproducible load, not secrets
            canary=f"nexa-canary-{secrets.token_hex(12)}",
        )

        async def progress(done: int, total: int, step: SimStep) -> None:
            await _update(api, job, JobUpdate(progress=done / total, summary=f"{step.name}: {step.verdict.value}"))

        summary = await run_campaign(STEPS, picked, context, seed=seed, say=say, progress=progress)
        failed = [s.name for s in summary.steps if s.verdict is StepVerdict.FAIL]
        await _update(
            api,
            job,
            JobUpdate(
                state=JobState.SUCCEEDED if summary.passed else JobState.FAILED,
                progress=1.0,
                summary="all steps passed" if summary.passed else "failed: " + ", ".join(failed),
            ),
        )
        if public_answers is not None:
            await trio.to_thread.run_sync(cluster.answers.write, public_answers)
        return summary
    finally:
        await parts.stop_cluster(cluster)
