"""One `nexa bench` run: the deployment looked up, a `benchmark` job opened, the kind's steps sent
through the gateway while the nodes' memory is sampled, and the run posted for the controller to judge.

The management calls (deployments, nodes, jobs, benchmarks) go through `nexa.client` with the
operator key, each in a worker thread (the client is synchronous); the load goes through
`bench.gateway` with the inference keys. SIGINT stops the load, marks the job `cancelled` and
raises `Interrupted`; any other failure marks it `failed` before it propagates.
"""

from __future__ import annotations

import functools
import random
import signal
import time
from collections.abc import Callable
from typing import Final, TypeVar

import attrs
import trio

from nexa import __version__
from nexa.bench import stats
from nexa.bench.gateway import Gateway
from nexa.bench.load import Call, Tally, closed_loop, open_loop
from nexa.bench.progress import Progress, step_line, step_name
from nexa.client import ApiClient
from nexa.contracts import codec
from nexa.contracts.api import NodeList
from nexa.contracts.deployments import Deployment, DeploymentCreate, DeploymentList, DeploymentView
from nexa.contracts.evidence import (
    BenchKind,
    BenchPoint,
    BenchRun,
    BenchRunCreate,
    Job,
    JobCreate,
    JobKind,
    JobState,
    JobUpdate,
)
from nexa.errors import NexaError, NotFound, RemoteError, Unavailable

T = TypeVar("T")

#: How often the nodes' memory is read during a run.
MEMORY_SAMPLE_S: Final = 1.0
#: How often a cold start's copy is polled for Ready.
READY_POLL_S: Final = 0.2
#: The default steps of each kind (concurrency, or requests per second for `saturation`).
DEFAULT_STEPS: Final = {
    BenchKind.CONCURRENCY: "1,2,4,8,16",
    BenchKind.SATURATION: "5,10,20,40,80",
    BenchKind.LONG_STREAM: "1,2",
    BenchKind.MIXED: "2,4,8",
    BenchKind.COLD_START: "1",
}
#: The default `max_tokens` of a chat request; a long stream asks for many.
DEFAULT_MAX_TOKENS: Final = 64
LONG_STREAM_MAX_TOKENS: Final = 1024

#: The prompts the load picks from (with `--seed`, in a reproducible order). Never logged.
PROMPTS: Final = (
    "Summarise the plot of a short story about a lighthouse keeper in three sentences.",
    "Explain what a hash chain is to a new operator.",
    "List five things to check before putting a GPU node into service.",
    "Write a haiku about queueing theory.",
    "What is the difference between latency and throughput?",
    "Translate 'the cluster is healthy' into French and German.",
    "Describe a rolling upgrade in plain words.",
    "Give three reasons a request might be retried.",
)


class Interrupted(Exception):
    """The run was stopped by SIGINT (Ctrl-C): the load stopped, its job is marked `cancelled`."""


@attrs.frozen(kw_only=True)
class Plan:
    """What to run, from the command line."""

    kind: BenchKind
    deployment: str
    steps: list[float]
    duration_s: float
    max_tokens: int
    #: The inference keys; `mixed` spreads its requests over them (one tenant each).
    inference_keys: list[str]
    gateway_url: str
    model: str | None = None
    seed: int | None = None
    record: bool = True
    #: A cold start's limit on create → Ready.
    ready_timeout_s: float = 600.0


@attrs.frozen(kw_only=True)
class Result:
    """What the run posted (`create`) and, unless `--no-record`, what the controller stored."""

    create: BenchRunCreate
    stored: BenchRun | None


class Runner:
    def __init__(self, plan: Plan, connect: Callable[[], ApiClient], progress: Progress) -> None:
        self._plan = plan
        self._api = connect()
        self._sampler_api = connect()
        self._progress = progress
        self._random = random.Random(plan.seed)  # noqa: S311 (which prompt, not a secret)
        self._memory_low: int | None = None
        self._nodes: set[str] = set()
        self._job: str | None = None
        self._interrupted = False

    def close(self) -> None:
        self._api.__exit__()
        self._sampler_api.__exit__()

    async def _call(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        return await trio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))

    async def run(self) -> Result:
        """The run, posted; `Interrupted` after SIGINT (its job marked `cancelled`)."""
        try:
            outcome = await self._run_until_signal()
        except BaseExceptionGroup as group:
            raise _sole(group) from None
        if outcome is None:
            raise Interrupted
        return outcome

    async def _run_until_signal(self) -> Result | None:
        outcome: Result | None = None
        with trio.open_signal_receiver(signal.SIGINT) as signals:
            async with trio.open_nursery() as nursery:

                async def on_signal() -> None:
                    async for _ in signals:
                        self._interrupted = True
                        nursery.cancel_scope.cancel()

                nursery.start_soon(on_signal)
                try:
                    outcome = await self._run()
                except BaseException as exc:  # Cancelled too: that is the SIGINT
                    with trio.CancelScope(shield=True):
                        if self._interrupted:
                            await self._finish_job(JobState.CANCELLED, "stopped by the operator (Ctrl-C)")
                        else:
                            await self._finish_job(JobState.FAILED, _failure(exc))
                    raise
                nursery.cancel_scope.cancel()
        return outcome

    async def _run(self) -> Result:
        plan = self._plan
        view = await self._deployment(plan.deployment)
        dep = view.deployment
        model = plan.model or dep.alias or dep.model.model
        if plan.kind is not BenchKind.COLD_START and view.ready < 1:
            raise Unavailable(
                f"deployment {plan.deployment!r} is not Ready ({view.ready} of {dep.replicas} replicas Ready): "
                f"wait until `nexa deployments show {plan.deployment}` shows a Ready replica, then run it again"
            )
        self._nodes = {n for r in dep.placed for n in r.node_ids}
        if plan.record:
            title = f"bench {plan.kind.value} {plan.deployment} {_steps_text(plan.steps)}"
            created = JobCreate(kind=JobKind.BENCHMARK, title=title)
            self._job = (await self._call(self._api.post, "/api/v1/jobs", Job, body=_body(created))).id
        started = time.time()
        t0 = time.monotonic()
        ready_s: float | None = None
        first_s: float | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._sample_memory)
            if plan.kind is BenchKind.COLD_START:
                points, ready_s, first_s = await self._cold_start(dep, model)
            else:
                points = await self._steps(model, view)
            nursery.cancel_scope.cancel()
        create = BenchRunCreate(
            deployment=plan.deployment,
            model=model,
            kind=plan.kind,
            started_at=started,
            duration_s=time.monotonic() - t0,
            points=points,
            seed=plan.seed,
            cold_start_ready_s=ready_s,
            cold_start_first_token_s=first_s,
            memory_headroom_bytes=self._memory_low,
            job=self._job,
            client_version=__version__,
        )
        if not plan.record:
            return Result(create=create, stored=None)
        stored = await self._call(self._api.post, "/api/v1/benchmarks", BenchRun, body=_body(create))
        self._job = None  # the post finished it
        return Result(create=create, stored=stored)

    # ---- the steps ---------------------------------------------------------------------------

    async def _steps(self, model: str, view: DeploymentView) -> list[BenchPoint]:
        plan = self._plan
        objectives = view.deployment.objectives
        gateways = [Gateway(plan.gateway_url, key, connections=_connections(plan)) for key in plan.inference_keys]
        points: list[BenchPoint] = []
        try:
            for i, step in enumerate(plan.steps):
                tally = Tally()
                call = self._call_for(gateways, model)
                label = f"rate {step:g}/s" if plan.kind is BenchKind.SATURATION else f"c={int(step)}"
                async with trio.open_nursery() as bar:
                    bar.start_soon(self._progress.show, label, plan.duration_s, tally)
                    if plan.kind is BenchKind.SATURATION:
                        seconds = await open_loop(call, step, plan.duration_s, tally)
                        p = stats.point(tally.samples, seconds, rate_rps=step)
                    else:
                        seconds = await closed_loop(call, int(step), plan.duration_s, tally)
                        p = stats.point(tally.samples, seconds, concurrency=int(step))
                    bar.cancel_scope.cancel()
                points.append(p)
                self._progress.step_done(p)
                await self._update_job((i + 1) / len(plan.steps), step_line(p))
                if plan.kind is BenchKind.SATURATION and (why := stats.broken(objectives, p)):
                    self._progress.note(f"stopped at {step_name(p)}: {'; '.join(why)}")
                    break
        finally:
            with trio.CancelScope(shield=True):
                for g in gateways:
                    await g.aclose()
        return points

    def _call_for(self, gateways: list[Gateway], model: str) -> Call:
        """The request of number `i`: its tenant (key) and, for `mixed`, its kind of call."""
        plan = self._plan
        # Drawn here, in request order, so that a seed gives the same prompts in the same order.
        pick = self._random

        async def call(i: int) -> stats.Sample:
            gateway = gateways[i % len(gateways)]
            prompt = pick.choice(PROMPTS)
            if plan.kind is BenchKind.MIXED:
                if i % 3 == 2:
                    return await gateway.embed(model, [prompt])
                return await gateway.chat(model, _messages(prompt), max_tokens=plan.max_tokens, stream=i % 3 == 0)
            return await gateway.chat(model, _messages(prompt), max_tokens=plan.max_tokens, stream=True)

        return call

    async def _cold_start(self, source: Deployment, model: str) -> tuple[list[BenchPoint], float, float]:
        """A one-replica copy of the deployment, timed create → Ready → first token, then deleted."""
        copy = await self._copy_name(source.name)
        body = DeploymentCreate(
            name=copy,
            runtime=source.runtime,
            alias=source.alias,
            model=None if source.alias else source.model,
            replicas=1,
            resources=source.resources,
            options=source.options,
            placement=source.placement,
            routing=source.routing,
            objectives=source.objectives,
            nodes_per_replica=source.nodes_per_replica,
        )
        self._progress.note(f"cold start: creating {copy} (one replica of {source.name}); it is deleted after")
        t0 = time.monotonic()
        await self._call(self._api.post, "/api/v1/deployments", DeploymentView, body=_body(body))
        try:
            with trio.move_on_after(self._plan.ready_timeout_s) as waited:
                while True:
                    copied = await self._deployment(copy)
                    self._nodes |= {n for r in copied.deployment.placed for n in r.node_ids}
                    if copied.ready >= 1:
                        break
                    await trio.sleep(READY_POLL_S)
            if waited.cancelled_caught:
                raise Unavailable(
                    f"{copy} was not Ready within {self._plan.ready_timeout_s:g} s: see "
                    f"`nexa deployments show {copy}` (it is deleted now), or raise --ready-timeout-s"
                )
            ready_s = time.monotonic() - t0
            self._progress.note(f"cold start: {copy} Ready after {ready_s:.2f} s")
            gateway = Gateway(self._plan.gateway_url, self._plan.inference_keys[0], connections=1)
            try:
                sent = time.monotonic()
                sample = await gateway.chat(
                    model, _messages(self._random.choice(PROMPTS)), max_tokens=self._plan.max_tokens, stream=True
                )
            finally:
                with trio.CancelScope(shield=True):
                    await gateway.aclose()
            if sample.error is not None or sample.ttft_ms is None:
                raise Unavailable(f"the first request after {copy} was Ready failed ({sample.error or 'no token'})")
            first_s = sent - t0 + sample.ttft_ms / 1000.0
            p = stats.point([sample], sample.e2e_ms / 1000.0, concurrency=1)
            self._progress.step_done(p)
            self._progress.note(f"cold start: first token {first_s:.2f} s after the create")
            await self._update_job(1.0, f"ready {ready_s:.2f} s, first token {first_s:.2f} s")
        finally:
            with trio.CancelScope(shield=True):
                await self._call(self._api.delete, f"/api/v1/deployments/{copy}", DeploymentView)
                self._progress.note(f"cold start: deleted {copy}")
        return [p], ready_s, first_s

    async def _copy_name(self, name: str) -> str:
        taken: set[str] = set()
        cursor: str | None = None
        while True:
            page = await self._call(
                self._api.get, "/api/v1/deployments", DeploymentList, params={"cursor": cursor, "limit": None}
            )
            taken |= {v.deployment.name for v in page.deployments}
            if (cursor := page.next_cursor) is None:
                break
        n = 1
        while f"{name}-bench-cold-{n}" in taken:
            n += 1
        return f"{name}-bench-cold-{n}"

    # ---- the controller ----------------------------------------------------------------------

    async def _deployment(self, name: str) -> DeploymentView:
        try:
            return await self._call(self._api.get, f"/api/v1/deployments/{name}", DeploymentView)
        except RemoteError as exc:
            if exc.status == 404:
                raise NotFound(f"no deployment {name!r}: `nexa deployments list` shows them") from None
            raise

    async def _sample_memory(self) -> None:
        """The least `memory available` of the deployment's nodes, read each second until cancelled."""
        while True:
            cursor: str | None = None
            while True:
                try:
                    page = await self._call(
                        self._sampler_api.get, "/api/v1/nodes", NodeList, params={"cursor": cursor, "limit": None}
                    )
                except NexaError:
                    break  # a missed sample: the next one may answer
                for n in page.nodes:
                    if n.id in self._nodes and n.inventory is not None:
                        free = n.inventory.memory_available_bytes
                        self._memory_low = free if self._memory_low is None else min(self._memory_low, free)
                if (cursor := page.next_cursor) is None:
                    break
            await trio.sleep(MEMORY_SAMPLE_S)

    async def _update_job(self, progress: float, summary: str) -> None:
        if self._job is not None:
            update = JobUpdate(progress=min(1.0, progress), summary=summary[:500])
            await self._call(self._api.post, f"/api/v1/jobs/{self._job}", Job, body=_body(update))

    async def _finish_job(self, state: JobState, summary: str) -> None:
        """Mark the job finished; a controller that cannot be told now is not an error of its own."""
        if self._job is None:
            return
        try:
            update = JobUpdate(state=state, summary=summary[:500])
            await self._call(self._api.post, f"/api/v1/jobs/{self._job}", Job, body=_body(update))
        except NexaError:
            pass  # the job shows failed after its staleness limit


def _sole(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """The one error inside nested nurseries' groups (what the CLI prints), or the group when there are more."""
    leaves: list[BaseException] = []
    todo: list[BaseException] = [group]
    while todo:
        exc = todo.pop()
        if isinstance(exc, BaseExceptionGroup):
            todo.extend(exc.exceptions)
        else:
            leaves.append(exc)
    return leaves[0] if len(leaves) == 1 else group


def _body(value: object) -> object:
    return codec.api.unstructure(value)


def _messages(prompt: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": prompt}]


def _connections(plan: Plan) -> int:
    if plan.kind is BenchKind.SATURATION:
        return 1024
    return max(1, int(max(plan.steps)))


def _steps_text(steps: list[float]) -> str:
    return ",".join(f"{s:g}" for s in steps)


def _failure(exc: BaseException) -> str:
    if isinstance(exc, NexaError):
        return exc.message
    return f"stopped: {type(exc).__name__}"
