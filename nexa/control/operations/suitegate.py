"""Suite gates the controller runs itself (`CanarySuite.run_by` `controller`, the default).

A rollout's new replica that soaked its time unbroken waits for its suite (`Soak.suite_wait`,
`deployments.watch`), and a canary with a suite may not be promoted until its suite passed
(`deployments.canarysuite`). Where the gate is the controller's, `GateRuns` (a leader loop) starts
that measured run itself as soon as it is wanted — a waiting replica whose gate has no run
recorded since it became Ready, a Ready canary with none since it started — against exactly those
replicas: the model names `nexa-eval-rollout.D` and `nexa-eval-canary.D` that `nexa eval run
--rollout|--canary` call. The cases are scored by the scorer the CLI uses (`nexa.evalcases`), and
the run is recorded by `Evals.record` as the CLI's is (the model version's measured evaluation:
suite digest, deployment, the `rollout` or `canary` mark, audited `eval.run.record` and
`model.evaluate` by the controller). It is an `eval` job (`nexa jobs list --kind eval`) whose
progress follows the cases; each start is audited (`eval.gate.run`). What happens next is the
gate's: the watcher passes the replica or reverts the rollout (`deployment.rollout.revert`,
alerted); `promote` lets the canary through or refuses it. An operator's run still counts: the
newest decides.

Whose run it is: the gate names a tenant (`CanarySuite.tenant`, required when the controller runs
it, refused when it does not exist), and the run is that tenant's. Each case is one call through
`Gateway.call`, in-process, as tenant `tenant` — the tenant's quotas and rate limits, admission
(standard priority) with the gateway's default deadline, routing, the relay and metering (usage
records of that tenant, under the key id `controller`) — the same pipeline a client's
`/v1/chat/completions` takes once its key is checked (its body checked as the front checks it).
In-process rather than over loopback HTTP with a short-lived key minted for the run: what that
would add is only what a key is for, authenticating a caller from outside, at the price of a
secret created, audited and revoked per run and a listener the controller may serve with TLS or
from worker processes; here there is no key, no secret is kept, and nothing listens. A tenant's
usage and limits are its own, so an operator chooses whose (a tenant for evaluations, say) rather
than a built-in tenant with no limits that nobody administers.

A run that cannot start or finish without a result — its suite gone or no longer parsing, the
tenant gone or refused by the gateway (403), no Ready replica to run against — fails its job
(the reason in its summary) and is tried again after a backoff (`RETRY_FIRST_S`, doubling to
`RETRY_MAX_S`). A run that scores is recorded whatever it scores, as `nexa eval run`'s is: a case
the gateway failed, or not done by the deadline (`RUN_DEADLINE_S`), scores 0. A run no longer
wanted (the replica passed or went, the rollout or canary ended) is cancelled, its job too. A
controller that stops leading cancels its runs; the next leader finds the gate still without a
result, fails the job left running under the gate's subject ("interrupted") and runs it again, so
exactly one run is in flight per gate and only recorded runs count.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, Final, NoReturn

import attrs
import trio

from nexa import __version__, evalcases
from nexa.contracts import codec
from nexa.contracts import evals as ev
from nexa.contracts.deployments import CANARY_EVAL_PREFIX, ROLLOUT_EVAL_PREFIX, CanarySuite
from nexa.contracts.domain import SYSTEM, KeyId, TenantId
from nexa.contracts.evidence import JobKind, JobState
from nexa.contracts.gateway import Api, Capability, body_problems
from nexa.control.datapath.calls import Work
from nexa.control.datapath.gateway import Gateway
from nexa.control.deployments import Deployments, canarysuite, rolloutsuite
from nexa.control.operations.evals import Evals
from nexa.control.operations.jobs import Jobs
from nexa.errors import Forbidden, NexaError, NotFound, Unauthenticated, Unavailable

log = logging.getLogger(__name__)

#: Cases in flight at once, and the time a run is given (seconds; a case not done by then scores 0).
CONCURRENCY: Final = 4
RUN_DEADLINE_S: Final = 600.0
#: How often the gates are looked at (seconds).
INTERVAL_S: Final = 1.0
#: A run that ended without a result is tried again after this, doubling to the most (seconds).
RETRY_FIRST_S: Final = 5.0
RETRY_MAX_S: Final = 300.0
#: The audit action of a run's start (its record is `eval.run.record`, by `Evals.record`).
RUN_STARTED: Final = "eval.gate.run"
#: The key id the controller's gateway calls are metered under (no API key has it: not 12 hex digits).
CONTROLLER_KEY: Final = KeyId("controller")
_CAPABILITY_BY_PATH: Final = {c.path: c for c in (Capability.CHAT, Capability.COMPLETION, Capability.EMBEDDING)}


@attrs.frozen(kw_only=True)
class Want:
    """A gate that needs the controller's run now."""

    deployment: str
    #: `rollout` (its new replicas) or `canary` (its canary replicas).
    against: str
    gate: CanarySuite
    #: The job's subject: one per gate and replica (or canary), so a new leader finds a run left in flight.
    subject: str
    #: What the run measures, for its job's title.
    what: str

    @property
    def model(self) -> str:
        """The model name reaching exactly the replicas the gate counts."""
        prefix = ROLLOUT_EVAL_PREFIX if self.against == "rollout" else CANARY_EVAL_PREFIX
        return prefix + self.deployment


def wanted(deployments: Deployments) -> list[Want]:
    """Every gate the controller runs that waits for a run now: a rollout's new replica that soaked
    unbroken (`Soak.suite_wait`) with no run of its suite recorded since it became Ready, a canary
    with none since it started; each while a replica the run measures is Ready (after a restart,
    once its node is heard again). Reads memory only."""
    models = deployments.desired.models
    out = []
    for name, entry in sorted(deployments.desired.entries.items()):
        dep = entry.deployment
        rollout = dep.rollout
        gate = rollout.policy.suite if rollout is not None and rollout.policy is not None else None
        if rollout is not None and gate is not None and gate.by_controller:
            try:
                runs = models.evaluations(dep.model.model, dep.model.version)
            except NotFound:
                runs = []
            placed = {r.id for r in dep.placed}
            for soak in rollout.soaks:
                if soak.suite_wait and not soak.passed and soak.replica_id in placed:
                    want = Want(
                        deployment=name,
                        against="rollout",
                        gate=gate,
                        subject=f"suite-gate/{name}/rollout/{rollout.started_at:.6f}/{soak.replica_id}",
                        what=f"{name}'s new replicas (replica {soak.replica_id})",
                    )
                    undecided = rolloutsuite.verdict(runs, name, gate, since=soak.ready_at).passed is None
                    if undecided and measured_ready(deployments, want):
                        out.append(want)
                    break  # one run measures every new replica: one at a time
        canary = dep.canary
        if canary is not None and canary.suite is not None and canary.suite.by_controller:
            try:
                newest = canarysuite.newest_run(models, name, canary)
            except NotFound:
                newest = None
            want = Want(
                deployment=name,
                against="canary",
                gate=canary.suite,
                subject=f"suite-gate/{name}/canary/{canary.started_at:.6f}",
                what=f"{name}'s canary ({canary.model.key})",
            )
            if newest is None and measured_ready(deployments, want):
                out.append(want)
    return out


def measured_ready(deployments: Deployments, want: Want) -> bool:
    """Whether a replica the gate counts is Ready now (the gateway's serving set for its model name)."""
    dep = deployments.desired.entry(want.deployment).deployment
    version = dep.canary.model if want.against == "canary" and dep.canary is not None else dep.model
    return bool(deployments.serving(version, alias=want.model).replicas)


@attrs.define
class _Backoff:
    failures: int
    next_at: float


class GateRuns:
    """Starts, retries and cancels the controller's suite-gate runs (see the module docstring)."""

    def __init__(
        self,
        deployments: Deployments,
        evals: Evals,
        jobs: Jobs,
        gateway: Gateway,
        *,
        tenant_exists: Callable[[TenantId], bool],
        audit: Callable[..., Awaitable[object]],
        deadline_s: float,
        interval_s: float = INTERVAL_S,
        run_deadline_s: float = RUN_DEADLINE_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`audit(actor, action, target, detail=)`: `Accounts.record`, which audits a run's start;
        `deadline_s`: each gateway call's (the gateway's default for a client's request); `clock`:
        what backoffs are timed by."""
        self._deployments = deployments
        self._evals = evals
        self._jobs = jobs
        self._gateway = gateway
        self._tenant_exists = tenant_exists
        self._audit = audit
        self._deadline_s = deadline_s
        self._interval_s = interval_s
        self._run_deadline_s = run_deadline_s
        self._clock = clock
        self._runs: dict[str, trio.CancelScope] = {}
        self._backoff: dict[str, _Backoff] = {}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> NoReturn:
        """Every `interval_s`, `check` (a leader loop): until cancelled, which cancels every run."""
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                self.check(nursery)
                await trio.sleep(self._interval_s)

    def check(self, nursery: trio.Nursery) -> list[str]:
        """Cancel the runs no longer wanted, start those wanted (not backing off); the subjects started."""
        if self._deployments.recovering:
            return []
        wants = {w.subject: w for w in wanted(self._deployments)}
        for subject, scope in list(self._runs.items()):
            if subject not in wants:
                scope.cancel()
        for subject in [s for s in self._backoff if s not in wants]:
            del self._backoff[subject]
        now = self._clock()
        started = []
        for subject, want in wants.items():
            backoff = self._backoff.get(subject)
            if subject in self._runs or (backoff is not None and now < backoff.next_at):
                continue
            self._runs[subject] = scope = trio.CancelScope()
            nursery.start_soon(self._attempt, want, scope)
            started.append(subject)
        return started

    def running(self) -> list[str]:
        """The subjects of the runs in flight."""
        return sorted(self._runs)

    async def _attempt(self, want: Want, scope: trio.CancelScope) -> None:
        try:
            with scope:
                await self._run_once(want)
        finally:
            self._runs.pop(want.subject, None)

    async def _run_once(self, want: Want) -> None:
        left = await self._jobs.running_of(JobKind.EVAL, want.subject)
        if left is not None:  # a previous leader's (or process's) run, cut off before its result
            summary = "interrupted: its controller stopped (or stopped leading) during the run; run again"
            await self._jobs.finish(left.id, JobState.FAILED, summary)
        gate = want.gate
        title = f"eval {gate.suite} on {want.what}, by the controller as tenant {gate.tenant}"
        job = await self._jobs.record(JobKind.EVAL, title, subject=want.subject, progress=0.0)
        await self._audit(SYSTEM, RUN_STARTED, f"deployment/{want.deployment}", detail=f"{title} (job {job})")
        try:
            run = await self._measure(want, job)
        except NexaError as exc:
            with trio.CancelScope(shield=True):
                await self._failed(want, job, exc)
            return
        except BaseException:
            with trio.CancelScope(shield=True):
                summary = "stopped: no longer wanted, or this controller stopped leading (the leader runs it again)"
                await self._jobs.finish(job, JobState.CANCELLED, summary)
            raise
        self._backoff.pop(want.subject, None)
        verdict = "passed" if run.passed else "failed"
        log.info("suite gate %s: the controller's run %s %s", want.subject, run.id, verdict)

    async def _measure(self, want: Want, job: str) -> ev.EvalRun:
        gate = want.gate
        assert gate.tenant is not None
        tenant = TenantId(gate.tenant)
        if not self._tenant_exists(tenant):
            raise NotFound(
                f"no tenant {gate.tenant} for suite {gate.suite}'s runs: create it (`nexa tenants create "
                f"{gate.tenant}`) or give the gate another (`--suite-tenant`)"
            )
        detail = await self._evals.suite(gate.suite)
        parsed, problems = ev.parse_suite(detail.content)
        if parsed is None:
            raise Unavailable(f"suite {gate.suite} does not parse here: {'; '.join(problems[:3])}")
        self._target_ready(want)
        port = _InProcess(self, tenant, job, deadline_s=self._deadline_s)
        cases = evalcases.Cases(
            port,
            deployment=want.deployment,
            model=want.model,
            who=f"tenant {gate.tenant}",
            remedy="give the gate a tenant that may (`--suite-tenant`), or leave the deployment out of the suite",
            concurrency=CONCURRENCY,
            deadline_s=self._run_deadline_s,
        )
        started, t0 = time.time(), time.monotonic()
        results = await cases.run(parsed.cases)
        create = ev.EvalRunCreate(
            suite=gate.suite,
            digest=parsed.digest,
            deployment=want.deployment,
            model=want.model,
            started_at=started,
            duration_s=round(time.monotonic() - t0, 3),
            concurrency=CONCURRENCY,
            cases=results,
            min_pass_rate=gate.min_pass_rate,
            job=job,
            client_version=__version__,
            canary=want.against == "canary",
            rollout=want.against == "rollout",
        )
        return await self._evals.record(SYSTEM, create)

    def _target_ready(self, want: Want) -> None:
        """Unavailable while no replica the gate counts is Ready (a run now would score nothing)."""
        if not measured_ready(self._deployments, want):
            raise Unavailable(
                f"deployment {want.deployment} has no Ready {want.against} replica to run suite {want.gate.suite} on"
            )

    async def _failed(self, want: Want, job: str, exc: NexaError) -> None:
        backoff = self._backoff.get(want.subject)
        failures = 1 if backoff is None else backoff.failures + 1
        delay = min(RETRY_MAX_S, RETRY_FIRST_S * 2 ** (failures - 1))
        self._backoff[want.subject] = _Backoff(failures=failures, next_at=self._clock() + delay)
        summary = f"no result: {exc.message}; tried again in {delay:g} s"
        log.warning("suite gate %s: the controller's run has no result (%s): %s", want.subject, exc.code, summary)
        await self._jobs.finish(job, JobState.FAILED, summary)

    # ---- what `_InProcess` calls ---------------------------------------------------------------------

    def served_name(self, deployment: str) -> str:
        try:
            dep = self._deployments.show(deployment).deployment
        except NotFound:
            raise NotFound(f"no deployment {deployment!r} (a scorer of the suite names it)") from None
        return dep.alias or dep.model.model

    @property
    def gateway(self) -> Gateway:
        return self._gateway

    @property
    def jobs(self) -> Jobs:
        return self._jobs


class _InProcess:
    """`evalcases.Port` for the controller: each call through `Gateway.call` as `tenant`."""

    def __init__(self, runs: GateRuns, tenant: TenantId, job: str, *, deadline_s: float) -> None:
        self._runs = runs
        self._tenant = tenant
        self._job = job
        self._deadline_s = deadline_s

    async def post(self, path: str, body: dict[str, Any]) -> evalcases.Reply:
        capability = _CAPABILITY_BY_PATH[path]
        rest = {k: v for k, v in body.items() if k != "model"}
        if problems := body_problems(capability, rest):  # as the gateway's front refuses a client's
            return evalcases.Reply(None, 0.0, f"invalid_request: {problems[0]}"[:64])
        work = Work(
            request_id="evalgate-" + uuid.uuid4().hex[:16],
            api=Api.OPENAI,
            tenant=self._tenant,
            key_id=CONTROLLER_KEY,
            capability=capability,
            model=str(body["model"]),
            body=rest,
            stream=False,
            deadline_at=time.time() + self._deadline_s,
        )
        sent = time.monotonic()
        try:
            async with self._runs.gateway.call(work) as answer:
                raw = await answer.read_all()
                if answer.error is not None:
                    raise answer.error
            parsed = codec.parse_json(raw)
        except NexaError as exc:
            ms = (time.monotonic() - sent) * 1000
            return evalcases.Reply(None, ms, exc.code, refused=isinstance(exc, Forbidden | Unauthenticated))
        return evalcases.Reply(parsed, (time.monotonic() - sent) * 1000)

    async def served_name(self, deployment: str) -> str:
        return self._runs.served_name(deployment)

    async def report(self, done: int, total: int) -> None:
        await self._runs.jobs.progress(self._job, done / total, f"{done}/{total} cases")
