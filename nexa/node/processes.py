"""Simulated runtimes as local processes, behind the container engines' interface (`ContainerDriver`). Simulation only.

`ProcessDriver` runs one `nexa sim-runtime` child per `sim` "container" on the node's loopback, with
a journal and a faults file under `<state_dir>/sim/`; `DriverRouter` sends `sim` specs and ids there
and everything else to podman. Children never outlive the driver: `aclose()` stops them all, and
each child also stops by itself when its parent (the agent) goes away. CPU, memory and GPU limits of
the spec do not apply to a process; its health probe is an HTTP GET of `/health`.
"""

from __future__ import annotations

import builtins
import contextlib
import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from types import TracebackType
from typing import Final

import attrs
import trio

from nexa import container_spec
from nexa.contracts.node import RuntimeKind
from nexa.contracts.runtime import ContainerDriver, ContainerSpec, ContainerState
from nexa.errors import (
    ContainerNotFound,
    ContractError,
    EngineError,
    EngineUnavailable,
    SimulationDisabled,
)
from nexa.node.http1 import RuntimeClient, RuntimeHTTPError

log = logging.getLogger(__name__)

#: Ids of simulated runtimes start with this (podman's are hex): the router routes by it.
SIM_ID_PREFIX: Final = "sim-"
#: The driver's files (journals, faults, children's output) live in this folder of the state dir.
SIM_DIR: Final = "sim"
#: The faults file every child re-reads (`nexa sim-runtime --faults`): one place to inject faults node-wide.
FAULTS_FILE: Final = "faults.json"
#: When the driver closes, each child gets this long after SIGTERM before SIGKILL.
CLOSE_TIMEOUT_S: Final = 5.0
#: The whole of closing the driver, shielded: the children's SIGTERM wait (in parallel), then
#: reaping the SIGKILLed ones and closing the HTTP client, which take moments.
ACLOSE_TIMEOUT_S: Final = CLOSE_TIMEOUT_S + 5.0
#: One `/health` request; the supervisor's probe timeout bounds it too.
HEALTH_TIMEOUT_S: Final = 2.0
#: A `/health` answer longer than this is not a healthy one.
HEALTH_MAX_BYTES: Final = 64 * 1024
#: The only variables of the agent's environment a child inherits (then the spec's env, then the switch).
PASSED_ENV: Final = ("PATH", "HOME", "LANG", "LC_ALL", "TMPDIR", "PYTHONPATH")


def default_argv() -> list[str]:
    """How to run this nexa: the frozen binary itself, or this interpreter with `-m nexa`."""
    if getattr(sys, "frozen", False):
        return [sys.executable]
    return [sys.executable, "-m", "nexa"]


def _exit_code(returncode: int) -> int:
    # trio reports death by signal N as -N; podman (and shells) as 128 + N.
    return 128 - returncode if returncode < 0 else returncode


def _open_output(path: Path) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)


@attrs.define(eq=False)
class _Child:
    id: str
    spec: ContainerSpec
    port: int
    process: trio.Process | None = None
    started_at: float | None = None
    exit_code: int | None = None

    @property
    def running(self) -> bool:
        if self.process is None:
            return False
        returncode = self.process.poll()  # reaps it when it has exited
        if returncode is None:
            return True
        self.exit_code = _exit_code(returncode)
        return False

    def state(self) -> ContainerState:
        running = self.running
        status = "running" if running else "created" if self.process is None else "exited"
        return ContainerState(
            id=self.id,
            name=self.spec.name,
            image_name=self.spec.image,
            # Nothing is pulled: the process runs "the image" it was created with, by definition.
            image_digest=container_spec.image_digest(self.spec.image),
            labels=dict(self.spec.labels),
            running=running,
            status=status,
            exit_code=None if running else self.exit_code,
            started_at=self.started_at,
            pid=self.process.pid if running and self.process is not None else None,
        )


class ProcessDriver:
    """`nexa sim-runtime` children with the container engines' interface (see `ContainerDriver`).

    `argv` is how to run nexa (default: `default_argv()`). Use as an async context manager, or call
    `aclose()`: it stops every child.
    """

    def __init__(self, state_dir: Path, argv: list[str] | None = None, *, host: str = "127.0.0.1") -> None:
        self._dir = state_dir / SIM_DIR
        self._host = host
        self._argv = list(argv) if argv is not None else default_argv()
        self._children: dict[str, _Child] = {}
        # The relay's own HTTP/1.1 client (h11, loaded anyway): a probe never loads httpx into the agent.
        self._http = RuntimeClient(connect_timeout_s=HEALTH_TIMEOUT_S, max_idle=1)
        self._closed = False

    @property
    def faults_path(self) -> Path:
        """The faults file every child re-reads when it changes (`nexa sim-runtime --faults`)."""
        return self._dir / FAULTS_FILE

    def journal_path(self, name: str) -> Path:
        """The journal of the child created under `name`: its requests and cancellations."""
        return self._dir / f"{name}.jsonl"

    async def __aenter__(self) -> ProcessDriver:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        """Stop every child (SIGTERM, then SIGKILL after CLOSE_TIMEOUT_S) and forget them. Shielded,
        for at most ACLOSE_TIMEOUT_S."""
        self._closed = True
        with trio.move_on_after(ACLOSE_TIMEOUT_S, shield=True) as scope:
            async with trio.open_nursery() as nursery:
                for child in self._children.values():
                    nursery.start_soon(self._terminate, child, CLOSE_TIMEOUT_S)
            self._children.clear()
            await self._http.aclose()
        if scope.cancelled_caught:
            log.warning("closing the process driver took over %g s; some children may not be reaped", ACLOSE_TIMEOUT_S)

    # --- the container engines' interface

    async def pull(self, image: str) -> None:
        """Nothing to pull: a simulated runtime is this nexa."""

    async def image_exists(self, image: str) -> bool:
        return True

    async def create(self, spec: ContainerSpec) -> str:
        if self._closed:
            raise EngineError("the process driver is closed")
        if spec.labels.get(container_spec.LABEL_KIND) != RuntimeKind.SIM:
            raise ContractError(f"{spec.name}: the process driver runs sim runtimes only")
        try:
            port = int(spec.labels[container_spec.LABEL_PORT])
        except (KeyError, ValueError):
            raise ContractError(
                f"{spec.name}: a sim runtime needs its port in the {container_spec.LABEL_PORT} label"
            ) from None
        if any(c.spec.name == spec.name for c in self._children.values()):
            raise EngineError(f"the name {spec.name} is already in use")
        child = _Child(id=SIM_ID_PREFIX + secrets.token_hex(16), spec=spec, port=port)
        self._children[child.id] = child
        log.info("created simulated runtime %s (%s)", spec.name, child.id)
        return child.id

    async def start(self, container_id: str) -> None:
        """Run the child (again, after it exited); starting a running one does nothing."""
        child = self._child(container_id)
        if child.running:
            return
        spec = child.spec
        argv = [
            *self._argv,
            "sim-runtime",
            *spec.command,
            # Last, so the spec's command cannot move them.
            "--journal",
            str(self.journal_path(spec.name)),
            "--faults",
            str(self.faults_path),
            "--exit-with-parent",
        ]
        env = {name: os.environ[name] for name in PASSED_ENV if name in os.environ}
        env.update(spec.env)
        env[container_spec.SIMULATION_ENV] = "1"
        env[container_spec.SIM_IMAGE_ENV] = spec.image
        output = await trio.to_thread.run_sync(_open_output, self._dir / f"{spec.name}.log")
        try:
            child.process = await trio.lowlevel.open_process(
                argv,
                env=env,
                cwd=self._dir,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=output,
                # Its own process group: stop() signals the group, and a terminal's ^C is the agent's.
                start_new_session=True,
            )
        except OSError as exc:
            raise EngineError(f"could not start simulated runtime {spec.name}: {exc.strerror}") from exc
        finally:
            os.close(output)
        child.started_at = time.time()
        child.exit_code = None
        log.info("started simulated runtime %s on port %d (pid %d)", spec.name, child.port, child.process.pid)

    async def inspect(self, container_id: str) -> ContainerState:
        return self._child(container_id).state()

    async def healthcheck(self, container_id: str) -> bool:
        """GET http://<host>:<port>/health once: True on 200. False when not running or not answering."""
        child = self._child(container_id)
        if not child.running:
            return False
        try:
            status, _ = await self._http.get(
                self._host, child.port, "/health", timeout_s=HEALTH_TIMEOUT_S, max_bytes=HEALTH_MAX_BYTES
            )
        except RuntimeHTTPError:
            return False
        return status == 200

    async def stop(self, container_id: str, *, timeout_s: float) -> None:
        """SIGTERM to its process group, then SIGKILL after `timeout_s`; returns once it has exited."""
        if timeout_s < 0:
            raise ContractError("timeout_s must not be negative")
        await self._terminate(self._child(container_id), timeout_s)

    async def remove(self, container_id: str, *, force: bool = False) -> None:
        """Forget a stopped child; `force` kills a running one first (a running one is refused otherwise)."""
        child = self._child(container_id)
        if child.running:
            if not force:
                raise EngineError(f"simulated runtime {child.spec.name} is running; stop it first")
            await self._terminate(child, 0.0)
        del self._children[container_id]
        log.info("removed simulated runtime %s", child.spec.name)

    async def list(self, labels: Mapping[str, str] | None = None) -> builtins.list[ContainerState]:
        want = dict(labels or {})
        return [
            c.state()
            for c in self._children.values()
            if all(c.spec.labels.get(key) == value for key, value in want.items())
        ]

    # --- internals

    def _child(self, container_id: str) -> _Child:
        try:
            return self._children[container_id]
        except KeyError:
            raise ContainerNotFound(f"no simulated runtime {container_id}") from None

    async def _terminate(self, child: _Child, timeout_s: float) -> None:
        process = child.process
        if process is None or not child.running:
            return
        # Not reaped yet (poll() said so): its pid, and so its process group, cannot have been reused.
        if timeout_s > 0:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGTERM)
            with trio.move_on_after(timeout_s):
                await process.wait()
            if process.returncode is None:
                log.warning("simulated runtime %s did not stop within %g s; killing it", child.spec.name, timeout_s)
        if process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        child.exit_code = _exit_code(await process.wait())
        log.info("simulated runtime %s exited with code %d", child.spec.name, child.exit_code)


@contextlib.asynccontextmanager
async def open_process_driver(
    state_dir: Path, *, enabled: bool, host: str = "127.0.0.1"
) -> AsyncIterator[ProcessDriver | None]:
    """A `ProcessDriver` for a node with `simulation = true`, stopped with every child on exit; None otherwise."""
    if not enabled:
        yield None
        return
    async with ProcessDriver(state_dir, host=host) as driver:
        yield driver


class DriverRouter:
    """The supervisor's one driver: `sim` specs (by their kind label) and `sim-` ids go to the process
    driver, everything else to podman.

    Without a process driver (a node without `simulation = true`) a sim spec is refused with
    SimulationDisabled, which the supervisor reports as `Failed(simulation_disabled)`. With one,
    `list` still answers when podman does not (a demo machine without podman): it reports the
    simulated runtimes alone. That is safe for the supervisor: a podman container left out of a
    listing is neither adopted nor removed (creating one fails while podman is down), and it shows
    again once podman answers.
    """

    def __init__(self, podman: ContainerDriver, processes: ProcessDriver | None) -> None:
        self._podman = podman
        self._processes = processes
        self._podman_down = False

    def _sims(self) -> ProcessDriver:
        if self._processes is None:
            raise SimulationDisabled(
                "this node does not run simulated runtimes; set simulation = true and NEXA_SIMULATION_ONLY=1"
            )
        return self._processes

    def _for_id(self, container_id: str) -> ContainerDriver:
        if not container_id.startswith(SIM_ID_PREFIX):
            return self._podman
        if self._processes is None:
            raise ContainerNotFound(f"no simulated runtime {container_id}")
        return self._processes

    async def pull(self, image: str) -> None:
        await self._podman.pull(image)

    async def image_exists(self, image: str) -> bool:
        return await self._podman.image_exists(image)

    async def create(self, spec: ContainerSpec) -> str:
        if spec.labels.get(container_spec.LABEL_KIND) == RuntimeKind.SIM:
            return await self._sims().create(spec)
        return await self._podman.create(spec)

    async def start(self, container_id: str) -> None:
        await self._for_id(container_id).start(container_id)

    async def inspect(self, container_id: str) -> ContainerState:
        return await self._for_id(container_id).inspect(container_id)

    async def healthcheck(self, container_id: str) -> bool:
        return await self._for_id(container_id).healthcheck(container_id)

    async def stop(self, container_id: str, *, timeout_s: float) -> None:
        await self._for_id(container_id).stop(container_id, timeout_s=timeout_s)

    async def remove(self, container_id: str, *, force: bool = False) -> None:
        await self._for_id(container_id).remove(container_id, force=force)

    async def list(self, labels: Mapping[str, str] | None = None) -> builtins.list[ContainerState]:
        if self._processes is None:
            return await self._podman.list(labels)
        sims = await self._processes.list(labels)
        try:
            containers = await self._podman.list(labels)
        except EngineUnavailable as exc:
            if not self._podman_down:
                log.warning("podman does not answer (%s); listing the simulated runtimes alone", exc)
            self._podman_down = True
            return sims
        if self._podman_down:
            log.info("podman answers again")
        self._podman_down = False
        return [*containers, *sims]
