"""The steps of a runtime qualification once its replica is assigned (`control.operations.qualification`
runs them, in `contracts.qualification.STEPS` order): `Steps.assign` puts the replica into its
node's signed set; `process`, `ready`, `answer`, `metrics`, `cache`, `memory` and `stop` each answer
(outcome, what was seen, figures) or raise `StepFailed` with what was seen and what to do.

What the node reports is all a step reads: the replica's status in its heartbeats (state, restarts,
the runtime's load figures, the memory it was measured to hold) and the node's runtime caches
(`unknown` from agents that do not report them).
"""

from __future__ import annotations

import json
import time
from typing import Any, Final

import attrs
import trio

from nexa import adapters
from nexa.contracts.deployments import ServingReplica
from nexa.contracts.domain import Actor
from nexa.contracts.gateway import Capability
from nexa.contracts.models import ModelRecord, ModelRef, RuntimeRecord
from nexa.contracts.qualification import QualificationStep, QualifyRequest, StepOutcome, memory_text
from nexa.contracts.wire import Assignment, AssignmentStatus, EndStatus, RuntimeState
from nexa.control.datapath.gateway import Gateway
from nexa.control.deployments.desired import Desired
from nexa.control.fleet.nodes import Fleet
from nexa.errors import NexaError, NotFound

#: What a step answers: its outcome, what was seen, and its figures.
StepResult = tuple[StepOutcome, str, dict[str, float | int | str]]

#: The assignments of qualifications name this "deployment" (a colon: never a deployment's name).
DEPLOYMENT_PREFIX: Final = "qualify:"
#: The first loopback port a qualification replica tries on its node.
FIRST_PORT: Final = 18900
#: How often the node's reports are looked at.
POLL_S: Final = 0.25
#: How long the answer may take, and how long the node may take to report the metrics it scraped.
ANSWER_TIMEOUT_S: Final = 120.0
#: The image an image runtime's qualification asks for (`WxH`).
IMAGE_PROBE_SIZE: Final = "256x256"
METRICS_WAIT_S: Final = 20.0
#: How long the node may take to drop the replica after its removal was pushed.
STOP_TIMEOUT_S: Final = 60.0
#: How long the node may take to report the replica's measured memory (its agent measures every
#: `[node] discovery_interval_s`, 5 s by default).
MEASURE_WAIT_S: Final = 15.0


@attrs.define(kw_only=True, eq=False)
class QualifyRun:
    """One qualification while it runs."""

    id: str
    runtime: RuntimeRecord
    node_id: str
    arch: str
    gpu_model: str
    model: ModelRecord
    request: QualifyRequest
    actor: Actor
    job_id: str
    assignment: Assignment
    started_at: float
    steps: list[QualificationStep] = attrs.Factory(list)
    #: trio clock when the set carrying the replica was pushed, and when it was Ready.
    pushed_at: float = 0.0
    ready_at: float | None = None
    status: AssignmentStatus | None = None

    @property
    def failed(self) -> str | None:
        return next((s.name for s in self.steps if s.outcome is StepOutcome.FAIL), None)


class StepFailed(Exception):
    """A step failed: what was seen and what to do (caught by the runner, recorded in the step)."""

    def __init__(self, detail: str, fix: str, **figures: float | int | str) -> None:
        super().__init__(detail)
        self.detail = detail
        self.fix = fix
        self.figures = figures


class Steps:
    """The steps that run once the replica is assigned (`STEPS` after `placement`), each answering
    (outcome, what was seen, figures) or raising StepFailed; `assign` puts the replica in place."""

    def __init__(self, fleet: Fleet, desired: Desired, gateway: Gateway) -> None:
        self._fleet = fleet
        self._desired = desired
        self._gateway = gateway

    async def assign(self, run: QualifyRun) -> None:
        """Put the replica into the node's set (a free loopback port from `FIRST_PORT`) and push it."""

        def add(current: list[Assignment]) -> list[Assignment]:
            used = {a.runtime.port for a in current}
            port = FIRST_PORT
            while port in used:
                port += 1
            run.assignment = attrs.evolve(run.assignment, runtime=attrs.evolve(run.assignment.runtime, port=port))
            return [*current, run.assignment]

        await self._desired.change_node_set(
            run.actor,
            "runtime.qualify.start",
            f"runtime/{run.runtime.name}",
            run.node_id,
            add,
            detail=f"qualification {run.id}: replica {run.assignment.id} of {run.model.key}",
        )
        run.pushed_at = trio.current_time()

    def assigned(self, run: QualifyRun) -> bool:
        """Whether the replica is in its node's desired set now."""
        try:
            live = self._fleet.get(run.node_id)
        except NotFound:
            return False
        return any(a.id == run.assignment.id for a in live.desired.assignments)

    async def remove(self, run: QualifyRun) -> None:
        """Take the replica out of its node's set, if it is there (without waiting for the node)."""
        if self.assigned(run):
            await self._desired.change_node_set(
                run.actor,
                "runtime.qualify.stop",
                f"runtime/{run.runtime.name}",
                run.node_id,
                lambda current: [a for a in current if a.id != run.assignment.id],
                detail=f"qualification {run.id} cut short: replica {run.assignment.id} removed",
            )

    def status(self, run: QualifyRun) -> AssignmentStatus | None:
        try:
            live = self._fleet.get(run.node_id)
        except NotFound:
            return None
        return next((s for s in live.statuses if s.assignment_id == run.assignment.id), None)

    async def process(self, run: QualifyRun) -> StepResult:
        """Until the replica is Ready (its process answers its probe), failed, or exited; at the
        deadline, a replica still Starting without a failure counts as a process that runs."""
        program = _program(run)
        spec = run.assignment.runtime
        command = " ".join([*spec.entrypoint, *spec.command])  # the process, as the node runs it
        deadline = run.pushed_at + run.request.timeout_s
        fix = (
            f"check that image {run.runtime.image} runs the {run.runtime.kind} adapter's program "
            f"`{program}` (`nexa runtimes show {run.runtime.name}` shows the command), or register the "
            "runtime's own image; `podman logs` on the node shows the process's output"
        )
        while trio.current_time() < deadline:
            status = run.status = self.status(run)
            if status is not None:
                if status.state is RuntimeState.FAILED:
                    raise StepFailed(
                        f"program {program}: the replica failed ({status.reason or 'no reason'}): {status.detail}",
                        fix,
                        reason=status.reason or "",
                        restarts=status.restarts,
                    )
                if status.restarts:
                    raise StepFailed(
                        f"program {program}: the runtime's process exited {status.restarts} time(s) before it "
                        f"was Ready ({status.detail or 'no detail'})",
                        fix,
                        restarts=status.restarts,
                    )
                if status.state is RuntimeState.READY:
                    run.ready_at = trio.current_time()
                    return StepOutcome.PASS, f"ran: {command}", {"program": program}
            await trio.sleep(POLL_S)
        if run.status is not None and run.status.state in {RuntimeState.STARTING, RuntimeState.UNHEALTHY}:
            return StepOutcome.PASS, f"runs (not Ready yet): {command}", {"program": program}
        state = "not reported" if run.status is None else f"{run.status.state}: {run.status.detail}"
        raise StepFailed(
            f"program {program}: the replica did not start within {run.request.timeout_s:g} s ({state})",
            "check that the node can pull the image and fetch the model (`nexa nodes show NODE`), "
            "or give more time with --timeout",
        )

    async def ready(self, run: QualifyRun) -> StepResult:
        if run.ready_at is not None:
            took = round(run.ready_at - run.pushed_at, 3)
            return StepOutcome.PASS, f"Ready {took:g} s after its set was pushed", {"time_to_ready_s": took}
        state = "not reported" if run.status is None else f"{run.status.state}: {run.status.detail}"
        raise StepFailed(
            f"the replica was not Ready within {run.request.timeout_s:g} s ({state})",
            "give more time with --timeout (a large model loads slowly), or check the runtime's log "
            "and its readiness endpoint",
        )

    async def answer(self, run: QualifyRun) -> StepResult:
        capability, body = _probe_request(run)
        replica = ServingReplica(
            replica_id=run.assignment.id,
            node_id=run.node_id,
            deployment=run.assignment.deployment,
            model=ModelRef(model=run.model.name, version=run.model.version),
        )
        started = trio.current_time()
        try:
            raw, end = await self._gateway.probe(replica, capability, body, deadline_at=time.time() + ANSWER_TIMEOUT_S)
        except NexaError as exc:
            raise StepFailed(
                f"the {capability} request through the gateway failed: {exc.code}: {exc.message}",
                "check the runtime's log on the node; the adapter's request path is " + capability.path,
                code=exc.code,
            ) from None
        took_ms = round((trio.current_time() - started) * 1000.0, 1)
        problem, figures = _answer_problem(capability, raw)
        figures["latency_ms"] = took_ms
        if end is not None and end.status is not EndStatus.OK:
            problem = problem or f"the node ended the answer with {end.code or end.status.value}"
        if problem:
            raise StepFailed(
                f"{capability.path}: {problem}", "the runtime does not answer in OpenAI's shape", **figures
            )
        return StepOutcome.PASS, f"{capability.path} answered in {took_ms:g} ms", figures

    async def metrics(self, run: QualifyRun) -> StepResult:
        spec = adapters.metrics_for(run.runtime.kind, run.assignment.runtime.command)
        if spec.path is None:
            return (
                StepOutcome.UNKNOWN,
                "the runtime exposes no metrics endpoint: routing uses the controller's own in-flight counts",
                {},
            )
        deadline = trio.current_time() + METRICS_WAIT_S
        status = None
        while trio.current_time() < deadline:
            status = self.status(run)
            if status is not None and status.load is not None:
                break
            await trio.sleep(POLL_S)
        if status is None or status.load is None:
            return (
                StepOutcome.UNKNOWN,
                f"the node reported no scrape of {spec.path} within {METRICS_WAIT_S:g} s "
                "(its runtime_metrics_interval_s may be 0)",
                {},
            )
        load = status.load
        if not load.ok:
            raise StepFailed(
                f"the node could not read {spec.path}: {load.error}",
                "check the runtime serves Prometheus text at that path (the adapter's `fixed` flags enable it)",
            )
        series = {
            "waiting": (spec.waiting, load.queue_depth),
            "running": (spec.running, load.running),
            "kv_cache": (" or ".join(spec.kv_cache) or None, load.kv_cache_ratio),
        }
        named = {k: v for k, v in series.items() if v[0] is not None}
        found = [f"{k} ({name})" for k, (name, figure) in named.items() if figure is not None]
        missing = [f"{k} ({name})" for k, (name, figure) in named.items() if figure is None]
        figures: dict[str, float | int | str] = {"found": ", ".join(found), "missing": ", ".join(missing)}
        if not named:
            return StepOutcome.UNKNOWN, f"{spec.path} was read; the adapter names no series the router reads", figures
        if not found:
            raise StepFailed(
                f"{spec.path} holds none of the series the router reads ({', '.join(missing)})",
                "check the runtime's version exports them (the adapter names them), or routing falls "
                "back to the controller's own counts",
                **figures,
            )
        if missing:
            return (
                StepOutcome.UNKNOWN,
                f"{spec.path}: found {', '.join(found)}; missing {', '.join(missing)} "
                "(routing falls back to the controller's own counts for those)",
                figures,
            )
        return StepOutcome.PASS, f"{spec.path}: found {', '.join(found)}", figures

    async def cache(self, run: QualifyRun) -> StepResult:
        """The replica holds a writable cache on the node (`node.runtime_cache`): the node's caches as
        its last heartbeat reported them."""
        disk = self._fleet.get(run.node_id).runtime_cache
        if disk is None:
            return StepOutcome.UNKNOWN, "the node does not report its runtime caches", {}
        figures: dict[str, float | int | str] = {
            "cache_bytes": disk.used_bytes,
            "cache_directories": disk.directories,
            "cache_in_use": disk.in_use,
            "cache_free_bytes": disk.free_bytes,
        }
        if disk.in_use == 0:
            return StepOutcome.UNKNOWN, "no runtime cache is held on the node (a runtime run as a process)", figures
        return (
            StepOutcome.PASS,
            f"the replica's cache is mounted; the node's caches hold {memory_text(disk.used_bytes)} in "
            f"{disk.directories} directories ({disk.in_use} in use), {memory_text(disk.free_bytes)} free",
            figures,
        )

    async def memory(self, run: QualifyRun) -> StepResult:
        reserved = run.assignment.runtime.memory_bytes
        deadline = trio.current_time() + MEASURE_WAIT_S
        while True:  # polled: the figure arrives in a heartbeat, which signals nothing of its own
            measured = _measured(self.status(run))
            if measured is not None or trio.current_time() >= deadline:
                break
            await trio.sleep(POLL_S)
        if measured is None:
            return (
                StepOutcome.UNKNOWN,
                f"the node does not measure the replica's memory; {memory_text(reserved)} reserved",
                {"reserved_bytes": reserved},
            )
        figures: dict[str, float | int | str] = {"reserved_bytes": reserved, "measured_bytes": measured}
        if measured > reserved:
            raise StepFailed(
                f"measured {memory_text(measured)}, above the {memory_text(reserved)} reserved",
                f"reserve at least {measured} bytes (the deployment's resources.memory_bytes, or the "
                "model's memory_bytes), or lower the runtime's context and batch settings",
                **figures,
            )
        return StepOutcome.PASS, f"measured {memory_text(measured)} of {memory_text(reserved)} reserved", figures

    async def stop(self, run: QualifyRun) -> StepResult:
        started = trio.current_time()
        after = await self._desired.change_node_set(
            run.actor,
            "runtime.qualify.stop",
            f"runtime/{run.runtime.name}",
            run.node_id,
            lambda current: [a for a in current if a.id != run.assignment.id],
            detail=f"qualification {run.id}: replica {run.assignment.id} removed",
        )
        deadline = started + STOP_TIMEOUT_S
        while trio.current_time() < deadline:
            live = self._fleet.get(run.node_id)
            if live.desired.acked_generation >= after.generation and self.status(run) is None:
                took = round(trio.current_time() - started, 3)
                return (
                    StepOutcome.PASS,
                    f"removed: the node accepted generation {after.generation} and dropped the replica in {took:g} s",
                    {"stop_s": took},
                )
            await trio.sleep(POLL_S)
        raise StepFailed(
            f"the node did not drop the replica within {STOP_TIMEOUT_S:g} s",
            "check the node is connected (`nexa nodes show NODE`); its agent removes the container at its next set",
        )


def _program(run: QualifyRun) -> str:
    """The program the adapter runs (`python3 -m llama_cpp.server`, `/app/llama-server`), as words."""
    if adapters.has_adapter(run.runtime.kind):
        return " ".join(adapters.adapter_for(run.runtime.kind, run.request.settings).program)
    return run.assignment.runtime.command[0] if run.assignment.runtime.command else "(the image's own)"


def _measured(status: AssignmentStatus | None) -> int | None:
    """What the node measured the replica to hold (None: not yet, or an agent that does not measure)."""
    return None if status is None or status.memory is None else status.memory.measured_bytes


def _probe_request(run: QualifyRun) -> tuple[Capability, dict[str, Any]]:
    """A chat request where the replica serves chat, else an embedding one, else (an image runtime,
    stable-diffusion.cpp's) one small image."""
    settings = run.request.settings
    if adapters.has_adapter(run.runtime.kind):
        adapter = adapters.adapter_for(run.runtime.kind, settings)
        if not adapter.serves(Capability.CHAT, settings) and adapter.serves(Capability.IMAGE, settings):
            # Small, so that a CPU build answers well inside ANSWER_TIMEOUT_S; a multiple of 64 every
            # diffusion family takes.
            return Capability.IMAGE, {"prompt": "nexa qualification", "n": 1, "size": IMAGE_PROBE_SIZE}
        if not adapter.serves(Capability.CHAT, settings) and adapter.serves(Capability.EMBEDDING, settings):
            return Capability.EMBEDDING, {"input": "nexa qualification"}
    return Capability.CHAT, {
        "messages": [{"role": "user", "content": "Say hello."}],
        "max_tokens": 8,
        "temperature": 0,
    }


def _image_problem(answer: dict[str, Any]) -> str:
    """What is wrong with an image answer ("" when nothing is): its first image must be base64, as
    stable-diffusion.cpp's sd-server always answers (`data[0].b64_json`)."""
    data = answer.get("data")
    first = data[0] if isinstance(data, list) and data and isinstance(data[0], dict) else None
    encoded = first.get("b64_json") if first is not None else None
    return "" if isinstance(encoded, str) and encoded else "no image in `data[0].b64_json`"


def _answer_problem(capability: Capability, raw: bytes) -> tuple[str, dict[str, float | int | str]]:
    """What is wrong with an answer's shape ("" when nothing is), and its figures."""
    try:
        answer = json.loads(raw)
    except ValueError:
        return f"the answer is not JSON ({len(raw)} bytes)", {"bytes": len(raw)}
    if not isinstance(answer, dict) or capability is Capability.IMAGE:
        # An image answer has no usage: its shape is all there is to check.
        return ("the answer is not a JSON object" if not isinstance(answer, dict) else _image_problem(answer)), {}
    usage = answer.get("usage")
    figures: dict[str, float | int | str] = {}
    if isinstance(usage, dict):
        figures = {k: v for k, v in usage.items() if k in {"prompt_tokens", "completion_tokens"} and isinstance(v, int)}
    if capability is Capability.EMBEDDING:
        data = answer.get("data")
        vector = data[0].get("embedding") if isinstance(data, list) and data and isinstance(data[0], dict) else None
        if not isinstance(vector, list) or not vector:
            return "no embedding in `data[0].embedding`", figures
        figures["dimensions"] = len(vector)
        return "", figures
    choices = answer.get("choices")
    first = choices[0] if isinstance(choices, list) and choices else None
    message = first.get("message") if isinstance(first, dict) else None
    if not isinstance(message, dict) or not isinstance(message.get("content"), str | None):
        return "no message in `choices[0].message`", figures
    figures["content_chars"] = len(message.get("content") or "")
    return "", figures
