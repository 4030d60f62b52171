"""Jobs: the long-running work the console's Jobs page follows.

Clients report their own (`benchmark`, `sim`: `create`, then `update` until a finished state);
the controller records backups (`record`/`finish`, from `control.operations.backup`) and rollouts
(`RolloutJobs`, told of every deployment change). A finished job takes no update (409). A client
job still `running` with no update for `STALE_AFTER_S` is failed ("no update for 10 min") the
next time it is read, and stored so; a backup a previous controller process left running is failed
when the controller starts (`fail_interrupted`).

Several controllers on one store: each job row names the controller that took it (`controller`;
None on the embedded store). A controller that starts fails only its own interrupted backups; the
leader fails those of a controller gone for good (`fail_orphaned`, from `follow.Orphans`).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable, Collection
from typing import Final

import attrs

from nexa.contracts import pages
from nexa.contracts.deployments import Deployment
from nexa.contracts.domain import Actor
from nexa.contracts.evidence import MAX_SUMMARY_CHARS, Job, JobCreate, JobKind, JobState, JobUpdate
from nexa.control import store as st
from nexa.control.access.accounts import audit_draft
from nexa.errors import Conflict, ContractError, NotFound
from nexa.telemetry import Metrics

log = logging.getLogger(__name__)

#: A client job `running` with no update for this long is failed.
STALE_AFTER_S: Final = 600.0
#: The kinds a client reports itself; backups and rollouts are the controller's own.
CLIENT_KINDS: Final = (JobKind.BENCHMARK, JobKind.SIM, JobKind.EVAL)
#: The longest job title, and the longest link.
MAX_TITLE_CHARS: Final = 200
MAX_LINK_CHARS: Final = 256
_LINK_PREFIX: Final = "/api/v1/"


def _text_problem(name: str, text: str, limit: int, *, empty_ok: bool) -> str | None:
    if not text.strip() and not empty_ok:
        return f"{name}: must not be empty"
    if len(text) > limit:
        return f"{name}: at most {limit} characters"
    if not text.isprintable():
        return f"{name}: printable characters only (no newlines or control characters)"
    return None


def update_problems(req: JobUpdate) -> list[str]:
    problems = [p for p in (_text_problem("summary", req.summary, MAX_SUMMARY_CHARS, empty_ok=True),) if p]
    if req.link is not None and (
        not req.link.startswith(_LINK_PREFIX)
        or len(req.link) > MAX_LINK_CHARS
        or not req.link.isprintable()
        or any(c.isspace() for c in req.link)
    ):
        problems.append(f"link: an API path under {_LINK_PREFIX} (at most {MAX_LINK_CHARS} characters, no spaces)")
    return problems


class Jobs:
    """Every job, in the store (see the module docstring)."""

    def __init__(
        self,
        store: st.Store,
        metrics: Metrics,
        *,
        clock: Callable[[], float] = time.time,
        controller: str | None = None,
    ) -> None:
        """`controller`: this controller's id on a shared store, written with each job it takes
        (None: the only controller)."""
        self._store = store
        self._metrics = metrics
        self._clock = clock
        self._controller = controller

    @classmethod
    def of(cls, jobs: Jobs | None) -> Jobs:
        if jobs is None:
            raise NotFound("this controller keeps no jobs")
        return jobs

    async def create(self, actor: Actor, req: JobCreate) -> Job:
        """A client's job (`benchmark` or `sim`), running from now; audited `job.create`."""
        problems = []
        if req.kind not in CLIENT_KINDS:
            problems.append(f"kind: benchmark, sim or eval (the controller records {req.kind.value} jobs itself)")
        if p := _text_problem("title", req.title, MAX_TITLE_CHARS, empty_ok=False):
            problems.append(p)
        if problems:
            raise ContractError("invalid job: " + "; ".join(problems), problems=tuple(problems))
        job = self._new(req.kind, req.title)
        draft = audit_draft(actor, "job.create", f"job/{job.id}", None, job, detail=f"{job.kind.value}: {job.title}")
        event = await self._store.run(st.insert_job, job, None, draft, self._controller)
        if event is not None:
            self._metrics.audit_events.labels(event.result.value).inc()
        return job

    async def update(self, actor: Actor, job_id: str, req: JobUpdate) -> Job:
        """A client's progress report; the job finishes when `state` is not `running` (409 once finished)."""
        if problems := update_problems(req):
            raise ContractError("invalid job update: " + "; ".join(problems), problems=tuple(problems))
        job = await self.get(job_id)
        if job.kind not in CLIENT_KINDS:
            raise ContractError(
                f"job {job_id} is the controller's own ({job.kind.value}); it reports it itself",
                problems=("job: not a client job",),
            )
        now = self._clock()
        after = attrs.evolve(
            job,
            state=req.state,
            progress=1.0
            if req.state is JobState.SUCCEEDED
            else (req.progress if req.progress is not None else job.progress),
            summary=req.summary or job.summary,
            link=req.link if req.link is not None else job.link,
            updated_at=now,
            finished_at=None if req.state is JobState.RUNNING else now,
        )
        await self._store.run(st.update_job, after)
        return after

    async def record(
        self,
        kind: JobKind,
        title: str,
        *,
        subject: str | None = None,
        progress: float | None = None,
        link: str | None = None,
    ) -> str:
        """A job the controller runs itself (a backup, a rollout), running from now; its id."""
        job = attrs.evolve(self._new(kind, title[:MAX_TITLE_CHARS]), progress=progress, link=link)
        await self._store.run(st.insert_job, job, subject, None, self._controller)
        return job.id

    async def progress(self, job_id: str, progress: float, summary: str = "") -> None:
        """A controller-run job moved on (never fails the work it follows: logged instead)."""
        await self._advance(job_id, JobState.RUNNING, summary, None, progress)

    async def finish(self, job_id: str, state: JobState, summary: str = "", link: str | None = None) -> None:
        """A controller-run job ended (or a client's, with the record it left: `Benchmarks.record`)."""
        await self._advance(job_id, state, summary, link, 1.0 if state is JobState.SUCCEEDED else None)

    async def running_of(self, kind: JobKind, subject: str) -> Job | None:
        return await self._store.run(st.running_job_of, kind, subject)

    async def get(self, job_id: str) -> Job:
        await self._fail_stale()
        job = await self._store.run(st.get_job, job_id)
        if job is None:
            raise NotFound(f"no job {job_id}: list them with `nexa jobs list`")
        return job

    async def page(
        self, kind: JobKind | None, state: JobState | None, after: pages.Key | None, limit: int
    ) -> tuple[list[Job], pages.Key | None]:
        """Jobs newest first (by start), filtered; the page and the key to continue after."""
        await self._fail_stale()
        key = None if after is None else (float(after[0]), str(after[1]))
        jobs = await self._store.run(st.list_jobs, kind, state, key, limit + 1)
        return pages.cut(jobs, limit, lambda j: (j.started_at, j.id))

    def _new(self, kind: JobKind, title: str) -> Job:
        now = self._clock()
        return Job(
            id="job_" + secrets.token_hex(8),
            kind=kind,
            title=title,
            state=JobState.RUNNING,
            progress=None,
            started_at=now,
            finished_at=None,
            updated_at=now,
        )

    async def _advance(
        self, job_id: str, state: JobState, summary: str, link: str | None, progress: float | None
    ) -> None:
        job = await self._store.run(st.get_job, job_id)
        if job is None or job.state is not JobState.RUNNING:
            log.warning("job %s: not running, its %s report is dropped", job_id, state.value)
            return
        now = self._clock()
        after = attrs.evolve(
            job,
            state=state,
            progress=progress if progress is not None else job.progress,
            summary=summary[:MAX_SUMMARY_CHARS] or job.summary,
            link=link if link is not None else job.link,
            updated_at=now,
            finished_at=None if state is JobState.RUNNING else now,
        )
        await self._store.run(st.update_job, after)

    async def fail_interrupted(self, *, unowned: bool = False) -> int:
        """At start: the backups a previous controller process left `running` (it stopped during
        them, so they will never finish) are failed; how many. Rollout jobs carry on: the rollout
        does, and its job is found again by its deployment. On a shared store only this
        controller's own (the others' run on), and with `unowned` (no other controller runs)
        those no controller is named on."""
        mine = None if self._controller is None else ((self._controller, None) if unowned else (self._controller,))
        return await self._fail_backups(mine, "the controller stopped during the backup: run `nexa backup` again")

    async def fail_orphaned(self, controllers: Collection[str | None]) -> int:
        """The running backups of `controllers` (gone for good: `follow.Orphans`, on the leader;
        None: no controller named) are failed; how many. Client jobs go stale by themselves;
        rollouts carry on under the leader."""
        names = tuple(controllers)
        if not names:
            return 0
        return await self._fail_backups(names, "its controller stopped during the backup: run `nexa backup` again")

    async def fail_running(self, kind: JobKind, summary: str) -> int:
        """Every running job of `kind` (controller-run work a previous leader left unfinished, such
        as a runtime qualification) is failed with `summary`; how many."""
        now = self._clock()
        left = await self._store.run(st.stale_jobs, (kind,), now, None)
        for job in left:
            await self._fail(job, summary[:MAX_SUMMARY_CHARS], now)
        return len(left)

    async def _fail_backups(self, controllers: tuple[str | None, ...] | None, summary: str) -> int:
        now = self._clock()
        interrupted = await self._store.run(st.stale_jobs, (JobKind.BACKUP,), now, controllers)
        for job in interrupted:
            await self._fail(job, summary[:MAX_SUMMARY_CHARS], now)
        return len(interrupted)

    async def _fail_stale(self) -> None:
        now = self._clock()
        for job in await self._store.run(st.stale_jobs, CLIENT_KINDS, now - STALE_AFTER_S):
            await self._fail(job, f"no update for {round(STALE_AFTER_S / 60)} min", now)

    async def _fail(self, job: Job, summary: str, now: float) -> None:
        failed = attrs.evolve(job, state=JobState.FAILED, summary=summary, updated_at=now, finished_at=now)
        try:
            await self._store.run(st.update_job, failed)
        except Conflict:  # updated meanwhile: that update stands
            log.info("job %s: updated while it was being failed", job.id)


class RolloutJobs:
    """One `rollout` job per rollout: a canary's start (or a rollback, an alias moving) records it,
    its steps move it on, its end (`deployment.rollout.done`) or a rollback finishes it.

    Told of each deployment change (`Deployments.on_commit`); a failure here is logged, never the change's.
    """

    def __init__(self, jobs: Jobs) -> None:
        self._jobs = jobs

    async def observe(self, action: str, before: Deployment | None, after: Deployment | None) -> None:
        try:
            await self._observe(action, before, after)
        except Exception:  # a job is a record of the rollout, never a reason for it to fail
            log.warning("rollout job of %s not updated", action, exc_info=True)

    async def _observe(self, action: str, before: Deployment | None, after: Deployment | None) -> None:
        dep = after or before
        assert dep is not None
        subject = f"deployment/{dep.name}"
        running = await self._jobs.running_of(JobKind.ROLLOUT, subject)
        if action == "deployment.canary.start" and after is not None and after.canary is not None:
            if running is not None:
                await self._jobs.finish(running.id, JobState.CANCELLED, "a new canary started")
            title = f"rollout {dep.name}: canary {after.canary.model.key} beside {after.model.key}"
            job_id = await self._jobs.record(
                JobKind.ROLLOUT, title, subject=subject, progress=0.0, link=f"/api/v1/deployments/{dep.name}"
            )
            await self._jobs.progress(job_id, 0.25, f"canary on {len(after.canary.placed)} replica(s)")
        elif action in {"deployment.canary.rollback", "deployment.canary.auto_rollback"} and running is not None:
            await self._jobs.finish(running.id, JobState.FAILED, "rolled back: the canary was removed")
        elif action == "deployment.delete" and running is not None:
            await self._jobs.finish(running.id, JobState.CANCELLED, "the deployment was deleted")
        elif action in {"deployment.promote", "deployment.rollback", "deployment.follow"} and after is not None:
            await self._started(action, after, running, subject)
        elif action == "deployment.rollout.step" and after is not None and after.rollout is not None:
            if running is None:
                await self._started(action, after, None, subject)
            else:
                await self._jobs.progress(running.id, _rollout_progress(after), "replacing replicas")
        elif action in _WATCHED and after is not None:
            await self._watched(action, after, running, subject)
        elif action == "deployment.rollout.done" and running is not None and after is not None:
            await self._jobs.finish(running.id, JobState.SUCCEEDED, f"{after.model.key} on {after.replicas} replica(s)")

    async def _watched(self, action: str, dep: Deployment, running: Job | None, subject: str) -> None:
        """A change rolled out under watch (`deployments.watch`): started, each step of its watch, reverted."""
        rollout = dep.rollout
        step = rollout.steps[-1] if rollout is not None and rollout.steps else None
        summary = f"{step.what}: {step.detail}" if step is not None else action
        if action == "deployment.change":
            if running is not None:
                await self._jobs.finish(running.id, JobState.CANCELLED, "a new change started")
            title = f"rollout {dep.name}: runtime {dep.runtime} ({summary})"
            running_id = await self._jobs.record(
                JobKind.ROLLOUT, title[:MAX_TITLE_CHARS], subject=subject, progress=0.0, link=_rollout_link(dep)
            )
            await self._jobs.progress(running_id, 0.0, summary[:MAX_SUMMARY_CHARS])
        elif running is None:
            return
        elif action in {"deployment.rollout.revert", "deployment.rollout.undo"}:
            await self._jobs.finish(running.id, JobState.FAILED, f"reverted: {summary}"[:MAX_SUMMARY_CHARS])
        else:
            progress = _rollout_progress(dep) if dep.rollout is not None else 0.0
            await self._jobs.progress(running.id, progress, summary[:MAX_SUMMARY_CHARS])

    async def _started(self, action: str, dep: Deployment, running: Job | None, subject: str) -> None:
        if action == "deployment.rollback" and running is not None:
            await self._jobs.finish(running.id, JobState.FAILED, f"rolled back to {dep.model.key}")
            running = None
        if dep.rollout is None:
            return
        if running is None:
            what = {"deployment.rollback": "rollback", "deployment.follow": "rollout (alias moved)"}.get(
                action, "rollout"
            )
            title = f"{what} {dep.name}: {dep.rollout.from_.key} -> {dep.rollout.to.key}"
            job_id = await self._jobs.record(
                JobKind.ROLLOUT, title, subject=subject, progress=0.0, link=f"/api/v1/deployments/{dep.name}"
            )
        else:
            job_id = running.id
        await self._jobs.progress(
            job_id, _rollout_progress(dep), f"promoted: {dep.rollout.from_.key} -> {dep.rollout.to.key}"
        )


#: The actions of a change rolled out under watch (`deployments.watch`).
_WATCHED: Final = frozenset(
    {
        "deployment.change",
        "deployment.rollout.watch",
        "deployment.rollout.pause",
        "deployment.rollout.resume",
        "deployment.rollout.revert",
        "deployment.rollout.undo",
    }
)


def _rollout_link(dep: Deployment) -> str:
    return f"/api/v1/deployments/{dep.name}/rollout"


def _rollout_progress(dep: Deployment) -> float:
    """0.5 at the promotion, then up to just under 1 as the new version's replicas replace the old
    (watched: as new replicas pass their soak)."""
    rollout = dep.rollout
    assert rollout is not None
    if rollout.policy is not None:
        new = sum(s.passed for s in rollout.soaks)
    else:
        new = sum(1 for r in dep.placed if (r.model or dep.model) == rollout.to)
    return round(0.5 + 0.49 * min(1.0, new / max(1, dep.replicas)), 3)
