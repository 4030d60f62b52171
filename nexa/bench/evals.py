"""`nexa eval run`: every case of a registered suite sent through the gateway as a client sends it
(the inference key's tenant, quotas and limits apply), scored (`nexa.evalcases`, the scorer the
controller's own suite-gate runs use too), and posted to the controller, which summarizes it and
records it as the model version's measured evaluation.

Cases run `concurrency` at a time until all have answered or the deadline passes (a case not done
by then scores 0 with the error `deadline`). A gateway that refuses the key (401/403) for a
deployment stops the run: the key may not use it (`Forbidden`, naming the deployment), and nothing
is recorded; so does a case its tenant's quota or rate limit refused (429: `Overloaded`, no result).
Answers are never logged; each case keeps the start of its answer for `nexa eval show`.
What this module adds to `evalcases` is the I/O: the gateway over HTTP (`bench.gateway`), the
controller's API for the suite, the job and the record.

With `evaluate` (`--model NAME@VERSION`) the run starts an evaluation replica of that version first
(`POST /api/v1/eval/replicas`, bound to the run's job and to the inference key's id), waits until it
is Ready, calls it by its name, and removes it afterwards, also when the run fails or is interrupted
(the controller removes it as well once the job is no longer running).

With `canary` (`--canary`) the cases go to the deployment's canary replicas alone; with `rollout`
(`--rollout`) to the new replicas of its rollout alone (what a rollout's suite gate counts).
"""

from __future__ import annotations

import contextlib
import functools
import time
from collections.abc import Callable
from typing import Any, Final, TypeVar

import attrs
import trio

from nexa import __version__, evalcases
from nexa.bench.gateway import Gateway
from nexa.client import ApiClient
from nexa.contracts import codec
from nexa.contracts import evals as ev
from nexa.contracts.deployments import CANARY_EVAL_PREFIX, ROLLOUT_EVAL_PREFIX, DeploymentView
from nexa.contracts.domain import parse_api_key
from nexa.contracts.evidence import Job, JobCreate, JobKind, JobState, JobUpdate
from nexa.contracts.models import ModelRef
from nexa.errors import ConfigError, NexaError, NotFound, RemoteError, Unavailable

T = TypeVar("T")

_REFUSED: Final = (401, 403)
#: How often an evaluation replica is looked at until it is Ready, and the time it is given
#: beyond its start and the run's deadline before the controller removes it regardless (seconds).
_READY_POLL_S: Final = 0.25
_REPLICA_SLACK_S: Final = 300.0


@attrs.frozen(kw_only=True)
class EvalPlan:
    suite: str
    deployment: str | None
    inference_key: str
    gateway_url: str
    concurrency: int = 4
    deadline_s: float = 600.0
    min_pass_rate: float = 1.0
    model: str | None = None
    #: `--model NAME@VERSION`: a new evaluation replica of that version (`deployment` is None), run
    #: like deployment `like` or on `runtime`, Ready within `ready_timeout_s`.
    evaluate: ModelRef | None = None
    like: str | None = None
    runtime: str | None = None
    ready_timeout_s: float = 600.0
    #: Run against `deployment`'s canary replicas alone (the canary version's evaluation).
    canary: bool = False
    #: Run against the new replicas of `deployment`'s rollout alone (a rollout's suite gate).
    rollout: bool = False


class EvalRunner:
    """One run (see the module docstring); `progress` is told (done, total) as cases finish."""

    def __init__(self, plan: EvalPlan, api: ApiClient, progress: Callable[[int, int], None]) -> None:
        self._plan = plan
        self._api = api
        self._progress = progress
        self._job: str | None = None
        self._served: dict[str, str] = {}
        self._gateway: Gateway | None = None
        self._deployment = plan.deployment or ""
        self._replica: str | None = None

    async def _call(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        return await trio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))

    async def run(self) -> ev.EvalRun:
        plan = self._plan
        detail = await self._call(self._api.get, f"/api/v1/eval/suites/{plan.suite}", ev.SuiteDetail)
        parsed, problems = ev.parse_suite(detail.content)
        if parsed is None:  # registered by a newer nexa with rules this one lacks
            raise Unavailable(f"suite {plan.suite} does not parse here: {'; '.join(problems[:3])}")
        if plan.evaluate is None:
            assert plan.deployment is not None
            self._deployment = plan.deployment
            if plan.canary:
                model = await self._canary_name(plan.deployment)
                on = f"{plan.deployment}'s canary"
            elif plan.rollout:
                model = await self._rollout_name(plan.deployment)
                on = f"{plan.deployment}'s new replicas"
            else:
                model = plan.model or await self._served_name(plan.deployment, ready=True)
                on = plan.deployment
        else:
            on = f"{plan.evaluate.model}@{plan.evaluate.version} (an evaluation replica)"
        title = f"eval {plan.suite} on {on} ({len(parsed.cases)} cases)"
        created = JobCreate(kind=JobKind.EVAL, title=title)
        self._job = (await self._call(self._api.post, "/api/v1/jobs", Job, body=_body(created))).id
        self._gateway = Gateway(plan.gateway_url, plan.inference_key, connections=plan.concurrency)
        try:
            if plan.evaluate is not None:
                self._deployment = model = await self._start_replica(plan.evaluate)
            started, t0 = time.time(), time.monotonic()
            results = await self._all(parsed.cases, model)
            create = ev.EvalRunCreate(
                suite=plan.suite,
                digest=parsed.digest,
                deployment=self._deployment,
                model=model,
                started_at=started,
                duration_s=round(time.monotonic() - t0, 3),
                concurrency=plan.concurrency,
                cases=results,
                min_pass_rate=plan.min_pass_rate,
                job=self._job,
                client_version=__version__,
                canary=plan.canary,
                rollout=plan.rollout,
            )
            return await self._call(self._api.post, "/api/v1/eval/runs", ev.EvalRun, body=_body(create))
        except BaseException as exc:
            with trio.CancelScope(shield=True):
                await self._finish_job(exc)
            raise
        finally:
            with trio.CancelScope(shield=True):
                await self._gateway.aclose()
                await self._stop_replica()

    async def _start_replica(self, ref: ModelRef) -> str:
        """Start the evaluation replica (`POST /api/v1/eval/replicas`) and wait until it is Ready; its name."""
        plan = self._plan
        key_id = parse_api_key(plan.inference_key)
        if key_id is None:
            raise ConfigError("the inference key is not an API key (nxk_...): give the key itself")
        assert self._job is not None
        req = ev.EvalReplicaCreate(
            model=ref,
            suite=plan.suite,
            job=self._job,
            key_id=key_id,
            like=plan.like,
            runtime=plan.runtime,
            ttl_s=min(ev.MAX_REPLICA_TTL_S, plan.ready_timeout_s + plan.deadline_s + _REPLICA_SLACK_S),
        )
        replica: ev.EvalReplica = await self._call(
            self._api.post, "/api/v1/eval/replicas", ev.EvalReplica, body=_body(req)
        )
        self._replica = replica.deployment
        await self._update_job(0.0, f"waiting for evaluation replica {replica.deployment} to be Ready")
        with trio.move_on_after(plan.ready_timeout_s):
            while True:
                try:
                    path = f"/api/v1/deployments/{replica.deployment}"
                    view: DeploymentView = await self._call(self._api.get, path, DeploymentView)
                except RemoteError as exc:
                    if exc.status == 404:
                        raise Unavailable(
                            f"evaluation replica {replica.deployment} was removed (its job ended?): run it again"
                        ) from None
                    raise
                if view.ready >= 1:
                    return replica.deployment
                await trio.sleep(_READY_POLL_S)
        raise Unavailable(
            f"evaluation replica {replica.deployment} of {ref.key} was not Ready within {plan.ready_timeout_s:g} s: "
            f"see `nexa deployments show {replica.deployment}` while it runs, or raise --ready-timeout-s"
        )

    async def _stop_replica(self) -> None:
        """Remove the evaluation replica, if one was started (the controller removes it too once the
        job is not running: this is the prompt way)."""
        if self._replica is None:
            return
        with contextlib.suppress(NexaError):  # removed already, or the controller's sweep will once the job ended
            await self._call(self._api.delete, f"/api/v1/eval/replicas/{self._replica}", ev.EvalReplica)

    async def _all(self, cases: list[ev.SuiteCase], model: str) -> list[ev.CaseResult]:
        plan = self._plan
        runner = evalcases.Cases(
            self,
            deployment=self._deployment,
            model=model,
            who="the inference key",
            remedy="use a key of a tenant that may, or leave the deployment out of the suite",
            concurrency=plan.concurrency,
            deadline_s=plan.deadline_s,
            on_case=self._progress,
        )
        return await runner.run(cases)

    # ---- evalcases.Port: the gateway over HTTP with the inference key, the job through the API ------

    async def post(self, path: str, body: dict[str, Any]) -> evalcases.Reply:
        assert self._gateway is not None
        sample, status, answer = await self._gateway.post(path, body)
        return evalcases.Reply(answer, sample.e2e_ms, sample.error, refused=status in _REFUSED)

    async def served_name(self, deployment: str) -> str:
        return await self._served_name(deployment)

    async def report(self, done: int, total: int) -> None:
        await self._update_job(done / total, f"{done}/{total} cases")

    async def _served_name(self, deployment: str, *, ready: bool = False) -> str:
        """The model name a client calls `deployment` by (its alias, or its model's name)."""
        if deployment not in self._served:
            view = await self._view(deployment)
            if ready and view.ready < 1:
                raise Unavailable(
                    f"deployment {deployment!r} has no Ready replica: wait until `nexa deployments show "
                    f"{deployment}` shows one, then run it again"
                )
            self._served[deployment] = view.deployment.alias or view.deployment.model.model
        return self._served[deployment]

    async def _canary_name(self, deployment: str) -> str:
        """The model name that reaches `deployment`'s canary replicas alone; Unavailable while none is Ready."""
        view = await self._view(deployment)
        if view.deployment.canary is None or view.canary_ready < 1:
            raise Unavailable(
                f"deployment {deployment!r} has no Ready canary replica: start one (`nexa deployments canary`) "
                "and wait until `nexa deployments show` shows it Ready"
            )
        return CANARY_EVAL_PREFIX + deployment

    async def _rollout_name(self, deployment: str) -> str:
        """The model name that reaches the new replicas of `deployment`'s rollout alone; Unavailable
        while it runs no rollout."""
        view = await self._view(deployment)
        if view.deployment.rollout is None:
            raise Unavailable(
                f"deployment {deployment!r} has no rollout in progress: `nexa deployments rollout status "
                f"{deployment}` shows it"
            )
        return ROLLOUT_EVAL_PREFIX + deployment

    async def _view(self, deployment: str) -> DeploymentView:
        try:
            view: DeploymentView = await self._call(self._api.get, f"/api/v1/deployments/{deployment}", DeploymentView)
        except RemoteError as exc:
            if exc.status == 404:
                raise NotFound(f"no deployment {deployment!r}: `nexa deployments list` shows them") from None
            raise
        return view

    async def _update_job(self, progress: float, summary: str) -> None:
        if self._job is not None:
            update = JobUpdate(progress=min(1.0, progress), summary=summary)
            await self._call(self._api.post, f"/api/v1/jobs/{self._job}", Job, body=_body(update))

    async def _finish_job(self, exc: BaseException) -> None:
        if self._job is None:
            return
        interrupted = isinstance(exc, KeyboardInterrupt | trio.Cancelled)
        summary = "interrupted" if interrupted else str(getattr(exc, "message", None) or type(exc).__name__)
        try:
            state = JobState.CANCELLED if interrupted else JobState.FAILED
            update = JobUpdate(state=state, summary=summary[:500])
            await self._call(self._api.post, f"/api/v1/jobs/{self._job}", Job, body=_body(update))
        except NexaError:
            pass  # the job shows failed after its staleness limit


def _body(value: object) -> object:
    return codec.api.unstructure(value)
