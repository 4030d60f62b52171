"""Runtime qualification (`nexa runtimes qualify RUNTIME --node NODE [--model MODEL]`).

`Qualifications.start` checks the request (the runtime, the node, the model, and that the node can
take the replica: placement over that one node, which explains a refusal) and records a
`qualification` job; the qualification then runs in the controller's own nursery (`run`, a
leader loop) and the job follows it, step by step (`contracts.qualification.STEPS`):

- `placement`: the node passes every filter for the replica (checked before anything starts);
- `process`: the replica (an assignment of its own, `qualify-<runtime>-<hex>`, in the node's
  signed set, outside any deployment, so no client request ever reaches it) was pulled,
  fetched and started and its process stayed up; a runtime that exits, or a container that
  cannot start (the image lacks the adapter's program), fails here, naming the program;
- `ready`: the time from the set's push to the node reporting it Ready;
- `answer`: a chat (else embedding) request through the gateway's relay to that replica alone
  (`Gateway.probe`: the router, the node channel, the node's relay and the runtime, as a routed
  call), and the answer's shape;
- `metrics`: the series the router reads (the adapter's `Metrics`: waiting, running, KV cache)
  present in what the node scraped (a figure the node reports is a series it found);
- `cache`, `memory`: the cache the replica wrote and its measured memory against the
  reservation, from the node's reports where it makes them (else `unknown`);
- `stop`: the replica removed from the node's set, and the node no longer reporting it.

The steps themselves are `qualify_steps.Steps`.

The result is a `Qualification` signed with the controller's key and kept (audited
`runtime.qualify`); the newest one of each (image digest, arch, GPU model) decides placement
under `[placement] require_qualified` (`qualified`). A failed step says what was seen and what
to do; the job's summary starts with `qualification_failed` and the step.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Final

import attrs
import trio

from nexa import __version__, security
from nexa.contracts import pages
from nexa.contracts.deployments import (
    Deployment,
    DeploymentCreate,
    PlacementSpec,
    Replica,
    Resources,
    RuntimeOptions,
)
from nexa.contracts.domain import SYSTEM, Actor, NodeState
from nexa.contracts.evidence import JobKind, JobState
from nexa.contracts.models import ModelFormat, ModelRecord, ModelRef, ModelState, RuntimeRecord
from nexa.contracts.node import RuntimeKind
from nexa.contracts.qualification import (
    MAX_STEP_TEXT,
    STEPS,
    Qualification,
    QualificationStep,
    QualifyRequest,
    SignedQualification,
    StepOutcome,
    gpu_model,
    image_digest,
    request_problems,
)
from nexa.contracts.wire import Assignment
from nexa.control import store as st
from nexa.control.access.accounts import audit_draft
from nexa.control.datapath.gateway import Gateway
from nexa.control.deployments import Deployments, assignment_for, check_settings, explain, placement_request
from nexa.control.deployments.checks import deployable_model, runtime_of
from nexa.control.deployments.scheduler import place
from nexa.control.fleet.nodes import Fleet, NodeLive
from nexa.control.operations.jobs import Jobs
from nexa.control.operations.qualify_steps import (
    DEPLOYMENT_PREFIX,
    FIRST_PORT,
    POLL_S,
    QualifyRun,
    StepFailed,
    StepResult,
    Steps,
)
from nexa.control.registry.models import ModelRegistry
from nexa.errors import (
    Conflict,
    ContractError,
    DeployModelUnknown,
    NexaError,
    NotFound,
    QualificationFailed,
    Recovering,
    Unavailable,
    Unplaceable,
)
from nexa.oci import normalise_arch
from nexa.security import SigningKey
from nexa.telemetry import Metrics

log = logging.getLogger(__name__)

#: Queued qualifications waiting for the runner.
_QUEUE: Final = 16
#: The longest a qualification cut short (the controller stopping) spends taking its replica out.
REMOVE_TIMEOUT_S: Final = 5.0
#: The formats a runtime kind loads, where it is one (every other kind but `sim`: anything not GGUF).
_FORMATS: Final = {
    RuntimeKind.LLAMACPP: frozenset({ModelFormat.GGUF}),
    RuntimeKind.WHISPERCPP: frozenset({ModelFormat.GGML}),
    # One checkpoint file (examples/common/common.cpp `--model`): GGUF, or safetensors.
    RuntimeKind.SDCPP: frozenset({ModelFormat.GGUF, ModelFormat.SAFETENSORS}),
}


class Qualifications:
    """Runtime qualifications: started from the API, run by `run`, kept in the store (signed)."""

    def __init__(
        self,
        store: st.Store,
        metrics: Metrics,
        *,
        fleet: Fleet,
        models: ModelRegistry,
        deployments: Deployments,
        gateway: Gateway,
        jobs: Jobs,
        signing_key: Callable[[], SigningKey],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._metrics = metrics
        self._fleet = fleet
        self._models = models
        self._deployments = deployments
        self._desired = deployments.desired
        self._steps = Steps(fleet, self._desired, gateway)
        self._jobs = jobs
        self._signing_key = signing_key
        self._clock = clock
        self._send, self._receive = trio.open_memory_channel[QualifyRun](_QUEUE)
        self._running: dict[tuple[str, str], str] = {}
        #: image digest → the (arch, GPU model) pairs whose newest qualification passed.
        self._passed: dict[str, frozenset[tuple[str, str]]] = {}
        self._accepting = False
        self._desired.qualified = self.qualified

    @classmethod
    def of(cls, qualifications: Qualifications | None) -> Qualifications:
        if qualifications is None:
            raise NotFound("this controller runs no qualifications")
        return qualifications

    async def load(self) -> None:
        """The newest qualification of each (digest, arch, GPU model), for placement."""
        self._learn(await self._store.read(st.latest_qualifications))

    def qualified(self, runtime: RuntimeRecord) -> frozenset[tuple[str, str]]:
        """The (arch, GPU model) pairs `runtime`'s image (by digest) passed its newest qualification on."""
        return self._passed.get(image_digest(runtime.image), frozenset())

    def _learn(self, records: list[SignedQualification]) -> None:
        newest: dict[tuple[str, str, str], Qualification] = {}
        for signed in records:
            q = signed.qualification
            key = (q.image_digest, q.arch, q.gpu_model)
            if key not in newest or (q.finished_at, q.id) > (newest[key].finished_at, newest[key].id):
                newest[key] = q
        for (digest, arch, gpu), q in newest.items():
            pairs = set(self._passed.get(digest, frozenset()))
            if q.passed:
                pairs.add((arch, gpu))
            else:
                pairs.discard((arch, gpu))
            self._passed[digest] = frozenset(pairs)

    # ---- the API ---------------------------------------------------------------------------------

    async def start(self, actor: Actor, runtime_name: str, req: QualifyRequest) -> str:
        """Check the request and queue the qualification; the id of the job that follows it.

        Refused, changing nothing: 400 (a bad shape or settings), 404 (no such node), 422
        (`runtime_unknown`, `model_unknown`, `model_not_approved`, `unplaceable` with the node's
        explanation), 409 (the node is not Ready or Cordoned, or the runtime is being qualified
        there already), 503 (this controller does not run qualifications now)."""
        if problems := request_problems(req):
            raise ContractError("invalid qualification: " + "; ".join(problems), problems=tuple(problems))
        runtime = runtime_of(self._models, runtime_name)
        live = self._fleet.get(req.node)
        if live.state not in {NodeState.READY, NodeState.CORDONED} or live.inventory is None:
            raise Conflict(
                f"node {req.node} is {live.state}: qualify on a Ready (or Cordoned) node that reported its inventory"
            )
        if (runtime.name, req.node) in self._running:
            raise Conflict(
                f"runtime {runtime.name} is being qualified on node {req.node} already "
                f"(job {self._running[(runtime.name, req.node)]}): follow it with `nexa jobs show`"
            )
        if self._desired.recovering:
            raise Recovering()
        if not self._accepting:
            raise Unavailable("this controller does not run qualifications now (it is not leading, or stopping)")
        model = self._model(runtime, req.model)
        dep = self._deployment(runtime, model, req, live)
        check_settings(dep_create := _as_create(dep), runtime)
        self._place(live, dep_create, model, runtime)
        run_id = "qual_" + secrets.token_hex(8)
        replica = Replica(
            id=f"qualify-{runtime.name}-{secrets.token_hex(4)}",
            node_id=req.node,
            gpus=_gpus(live, dep.resources.accelerators),
            model=dep.model,
        )
        title = f"qualify {runtime.name} ({runtime.kind}) on {req.node} with {model.key}"
        job_id = await self._jobs.record(
            JobKind.QUALIFICATION, title, subject=f"runtime/{runtime.name}", progress=0.0, link=None
        )
        assert live.inventory is not None
        run = QualifyRun(
            id=run_id,
            runtime=runtime,
            node_id=req.node,
            arch=normalise_arch(live.inventory.arch),
            gpu_model=gpu_model(live.inventory.gpus),
            model=model,
            request=req,
            actor=actor,
            job_id=job_id,
            assignment=assignment_for(dep, replica, model, runtime, FIRST_PORT),
            started_at=self._clock(),
        )
        run.steps.append(
            QualificationStep(
                name="placement",
                outcome=StepOutcome.PASS,
                detail=f"node {req.node} ({run.arch}, GPU {run.gpu_model}) passes every placement filter",
            )
        )
        self._running[(runtime.name, req.node)] = job_id
        try:
            self._send.send_nowait(run)
        except trio.WouldBlock:
            del self._running[(runtime.name, req.node)]
            await self._jobs.finish(job_id, JobState.CANCELLED, "too many qualifications queued")
            raise Unavailable("too many qualifications are queued: retry once one has finished") from None
        return job_id

    async def page(
        self, runtime: str | None, after: pages.Key | None, limit: int
    ) -> tuple[list[SignedQualification], pages.Key | None]:
        key = None if after is None else (float(after[0]), str(after[1]))
        found = await self._store.read(st.list_qualifications, runtime, key, limit + 1)
        return pages.cut(found, limit, lambda q: (q.qualification.finished_at, q.qualification.id))

    async def get(self, qualification_id: str) -> SignedQualification:
        found = await self._store.read(st.get_qualification, qualification_id)
        if found is None:
            raise NotFound(f"no qualification {qualification_id}: list them with `nexa runtimes show RUNTIME`")
        return found

    # ---- the runner --------------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Run queued qualifications, each in its own task, until cancelled (a leader loop). At
        start (once the controller is not recovering), the qualified pairs are read again (another
        controller may have led meanwhile), and what a previous leader left is cleaned up: its
        replicas removed, its jobs failed."""
        task_status.started()  # at once: the controller serves (and recovers) meanwhile
        while self._desired.recovering:  # noqa: ASYNC110 - it ends by an operator command; nothing may change node sets until then
            await trio.sleep(POLL_S * 4)
        await self.load()
        await self._clean_up()
        async with trio.open_nursery() as nursery:
            self._accepting = True
            try:
                async for run in self._receive:
                    nursery.start_soon(self._qualify, run)
            finally:
                self._accepting = False

    async def _clean_up(self) -> None:
        for live in list(self._fleet):
            left = [a for a in live.desired.assignments if a.deployment.startswith(DEPLOYMENT_PREFIX)]
            if left:
                await self._desired.change_node_set(
                    SYSTEM,
                    "runtime.qualify.stop",
                    f"node/{live.node.id}",
                    live.node.id,
                    _without_qualifications,
                    detail=f"removed {len(left)} qualification replica(s) a previous controller left",
                )
        if failed := await self._jobs.fail_running(
            JobKind.QUALIFICATION, "the controller stopped during the qualification: run it again"
        ):
            log.warning("%d qualification job(s) left running by a previous controller: failed", failed)

    async def _qualify(self, run: QualifyRun) -> None:
        steps = self._steps
        try:
            try:
                await steps.assign(run)
                for name, step in (
                    ("process", steps.process),
                    ("ready", steps.ready),
                    ("answer", steps.answer),
                    ("metrics", steps.metrics),
                    ("cache", steps.cache),
                    ("memory", steps.memory),
                ):
                    if run.failed is not None:
                        run.steps.append(QualificationStep(name=name, outcome=StepOutcome.SKIPPED))
                        continue
                    await self._step(run, name, step)
            except BaseException:
                # Cancelled (the controller stops) or a bug: the replica leaves the node's set at
                # least; the job is failed below, or by the next leader (`_clean_up`).
                with trio.move_on_after(REMOVE_TIMEOUT_S, shield=True):
                    await steps.remove(run)
                raise
            if steps.assigned(run):
                await self._step(run, "stop", steps.stop)
            else:
                run.steps.append(QualificationStep(name="stop", outcome=StepOutcome.SKIPPED))
            await self._record(run)
        except Exception as exc:  # the runner must outlive any one qualification
            log.exception("qualification %s of %s on %s", run.id, run.runtime.name, run.node_id)
            summary = f"the qualification could not finish: {exc}"
            with trio.CancelScope(shield=True):
                await self._jobs.finish(run.job_id, JobState.FAILED, summary)
        finally:
            self._running.pop((run.runtime.name, run.node_id), None)

    async def _step(self, run: QualifyRun, name: str, fn: Callable[[QualifyRun], Awaitable[StepResult]]) -> None:
        started = trio.current_time()
        index = STEPS.index(name)
        await self._jobs.progress(run.job_id, round(index / len(STEPS), 3), f"step {name}")
        try:
            outcome, detail, figures = await fn(run)
            fix = ""
        except StepFailed as exc:
            outcome, detail, fix, figures = StepOutcome.FAIL, exc.detail, exc.fix, exc.figures
        run.steps.append(
            QualificationStep(
                name=name,
                outcome=outcome,
                detail=detail[:MAX_STEP_TEXT],
                fix=fix[:MAX_STEP_TEXT],
                duration_s=round(max(0.0, trio.current_time() - started), 3),
                figures=figures,
            )
        )

    async def _record(self, run: QualifyRun) -> None:
        failed = run.failed
        record = Qualification(
            id=run.id,
            runtime=run.runtime.name,
            kind=run.runtime.kind,
            image=run.runtime.image,
            image_digest=image_digest(run.runtime.image),
            node_id=run.node_id,
            arch=run.arch,
            gpu_model=run.gpu_model,
            model=ModelRef(model=run.model.name, version=run.model.version),
            settings=dict(run.request.settings),
            started_at=run.started_at,
            finished_at=max(run.started_at, self._clock()),
            passed=failed is None,
            steps=run.steps,
            failed_step=failed,
            job=run.job_id,
            requested_by=run.actor.key_id,
            nexa_version=__version__,
        )
        signed = security.sign_qualification(self._signing_key(), record)
        verdict = "passed" if record.passed else f"qualification_failed at step {failed}"
        detail = f"{record.runtime} on {record.node_id} ({record.arch}, {record.gpu_model}): {verdict}"
        draft = audit_draft(run.actor, "runtime.qualify", f"runtime/{record.runtime}", None, record, detail=detail)
        event = await self._store.run(st.insert_qualification, signed, draft)
        self._metrics.audit_events.labels(event.result.value).inc()
        self._learn([signed])
        link = f"/api/v1/qualifications/{record.id}"
        if record.passed:
            await self._jobs.finish(run.job_id, JobState.SUCCEEDED, f"qualified: {detail}", link=link)
            return
        step = next(s for s in run.steps if s.name == failed)
        summary = f"{QualificationFailed.code} at step {failed}: {step.detail}; what to do: {step.fix}"
        await self._jobs.finish(run.job_id, JobState.FAILED, summary, link=link)

    # ---- what a request resolves to ---------------------------------------------------------------

    def _model(self, runtime: RuntimeRecord, given: str | None) -> ModelRecord:
        """The model to qualify with: the one named (an alias, a name's newest Approved version, or
        NAME:VERSION; deployable), else the smallest Approved model the runtime's format serves."""
        if given is not None:
            name, sep, version = given.partition(":")
            if sep:
                return deployable_model(self._models, ModelRef(model=name, version=version))
            try:
                record = self._models.resolve(given)
            except NexaError:
                approved = self._models.models(name=given, state=ModelState.APPROVED)
                if not approved:
                    raise DeployModelUnknown(
                        f"no alias or Approved model {given}: give NAME:VERSION or an alias (`nexa models list`)"
                    ) from None
                record = max(approved, key=lambda m: m.registered_at)
            return deployable_model(self._models, ModelRef(model=record.name, version=record.version))
        wanted = _FORMATS.get(runtime.kind)
        candidates = []
        for m in self._models.models(state=ModelState.APPROVED):
            if wanted is not None and m.format not in wanted:
                continue
            if wanted is None and runtime.kind is not RuntimeKind.SIM and m.format is ModelFormat.GGUF:
                continue
            try:
                candidates.append(deployable_model(self._models, ModelRef(model=m.name, version=m.version)))
            except NexaError:
                continue
        if not candidates:
            raise DeployModelUnknown(
                f"no Approved model with a valid licence suits runtime {runtime.name} ({runtime.kind}): "
                "give one with --model"
            )
        return min(candidates, key=lambda m: (m.artifact.size_bytes, m.name, m.version))

    def _deployment(
        self, runtime: RuntimeRecord, model: ModelRecord, req: QualifyRequest, live: NodeLive
    ) -> Deployment:
        """The replica's shape as a deployment record (never stored: what `assignment_for` reads)."""
        inv = live.inventory
        accelerators = req.accelerators
        if accelerators is None:
            accelerators = 1 if inv is not None and inv.gpus and runtime.kind is not RuntimeKind.SIM else 0
        now = self._clock()
        return Deployment(
            name=DEPLOYMENT_PREFIX + runtime.name,
            runtime=runtime.name,
            alias=None,
            model=ModelRef(model=model.name, version=model.version),
            replicas=1,
            resources=Resources(accelerators=accelerators, memory_bytes=req.memory_bytes, cpus=1.0),
            options=RuntimeOptions(port=FIRST_PORT, settings=dict(req.settings)),
            placement=PlacementSpec(),
            created_at=now,
            created_by=None,
            updated_at=now,
        )

    def _place(self, live: NodeLive, dep: DeploymentCreate, model: ModelRecord, runtime: RuntimeRecord) -> None:
        """Placement over the node alone (a Cordoned node counts as Ready: cordoning keeps
        deployments off it while it is qualified); Unplaceable with its explanation."""
        snapshot = [n for n in self._desired.snapshot() if n.id == live.node.id]
        snapshot = [attrs.evolve(n, state=NodeState.READY) if n.state is NodeState.CORDONED else n for n in snapshot]
        decision = place(snapshot, placement_request(dep, model, runtime, 1))
        if not decision.feasible:
            raise Unplaceable(
                f"runtime {runtime.name} cannot be qualified on node {live.node.id}: " + explain(decision)
            )


def _as_create(dep: Deployment) -> DeploymentCreate:
    """A `DeploymentCreate` of the record (what the settings check and placement read)."""
    return DeploymentCreate(
        name="qualify",
        runtime=dep.runtime,
        model=dep.model,
        replicas=1,
        resources=dep.resources,
        options=dep.options,
        placement=dep.placement,
    )


def _without_qualifications(current: list[Assignment]) -> list[Assignment]:
    return [a for a in current if not a.deployment.startswith(DEPLOYMENT_PREFIX)]


def _gpus(live: NodeLive, count: int) -> list[str]:
    inv = live.inventory
    if inv is None or not count:
        return []
    return [g.cdi_device for g in inv.gpus][:count]
