"""What each replica holds in memory, measured, and the memory-pressure guard of a unified node.

`ReplicaMemoryMeter` stands between the agent and the runtime metrics (the agent's `Runtimes`, as
`RuntimeMetrics` stands before the supervisor): `statuses` adds to each replica the memory last
measured for it; `run` measures every `[node] discovery_interval_s`:

- the container's cgroup: `memory.current` (cgroup v2) or `memory.usage_in_bytes` (v1), less its
  inactive page cache (`inactive_file`, as `docker stats` counts it), found through the cgroup of
  the container's main process (`/proc/<pid>/cgroup`, the pid podman or Docker inspect reports). A
  process that shares the agent's own cgroup (a simulated runtime) is measured by its resident set;
- the GPU memory nvidia-smi reports for the container's processes (`--query-compute-apps`), on
  discrete GPUs (a unified GPU reports none);
- on a unified-memory node, the drop in MemAvailable from just before the container started to its
  first Ready: the GPU allocations come out of the host's pool, which the cgroup does not see.

The largest is the replica's measured figure. On a unified node with `[memory]
pressure_floor_bytes` set, MemAvailable under the floor makes the guard stop the most recently
started replica (`Failed(memory_pressure)`, both figures in its detail), one per look, and the
heartbeat carries the pressure until MemAvailable is back above the floor.
"""

from __future__ import annotations

import csv
import io
import logging
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final, NoReturn, Protocol

import attrs
import trio

from nexa.contracts import wire
from nexa.contracts.bounds import MAX_BYTES
from nexa.contracts.node import NodeInventory
from nexa.errors import Unavailable
from nexa.node.inventory import NVIDIA_SMI_TIMEOUT_S, parse_meminfo, run_nvidia_smi
from nexa.node.replicas import Replica

log = logging.getLogger(__name__)

#: The query for each compute process's GPU memory (MiB), in the order `parse_compute_apps` reads.
COMPUTE_APPS_ARGS: Final = ("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")
#: Where cgroup file systems are mounted (v2 unified at the root, or v1 per controller beside it).
CGROUP_ROOT: Final = Path("/sys/fs/cgroup")
#: The most a replica is stopped for at once (its own stop timeout bounds it too).
STOP_TIMEOUT_S: Final = 60.0
#: After the guard stops a replica, the host gets this long to take its memory back before the
#: guard stops another (MemAvailable lags the exit of a large process by seconds).
STOP_SETTLE_S: Final = 5.0

_MIB: Final = 1024 * 1024
_KIB: Final = 1024


class Runtimes(Protocol):
    """The agent's view of its runtimes (`RuntimeMetrics`, or the supervisor itself)."""

    def update(self, generation: int, assignments: Sequence[wire.Assignment]) -> None: ...

    def statuses(self) -> list[wire.AssignmentStatus]: ...


class Supervised(Protocol):
    """What the meter needs of the supervisor: its replicas, and stopping one for good."""

    def replicas(self) -> list[Replica]: ...

    async def stop_held(self, assignment_id: str, reason: str, detail: str) -> bool: ...


# ---------------------------------------------------------------------------------------------
# Pure parsing


def parse_compute_apps(text: str) -> dict[int, int]:
    """`nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits`: bytes by
    pid, summed over GPUs. Rows whose memory the driver does not report ("[N/A]") are left out."""
    out: dict[int, int] = {}
    for row in csv.reader(io.StringIO(text), skipinitialspace=True):
        if len(row) != 2 or not row[0].strip().isdigit():
            continue
        try:
            mib = float(row[1])
        except ValueError:
            continue
        if 0 <= mib * _MIB <= MAX_BYTES:
            pid = int(row[0])
            out[pid] = out.get(pid, 0) + int(mib * _MIB)
    return out


def parse_memory_stat(text: str) -> dict[str, int]:
    """A cgroup's `memory.stat`: `name value` lines."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if value.strip().isdigit():
            out[name] = int(value)
    return out


def memory_cgroup(proc_cgroup: str) -> tuple[int, str] | None:
    """(cgroup version, path) of the memory controller in a `/proc/<pid>/cgroup` text: the v1
    `memory` hierarchy where there is one (a hybrid host), else the v2 unified one."""
    unified = None
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if "memory" in controllers.split(","):
            return 1, path
        if parts[0] == "0" and controllers == "":
            unified = path
    return None if unified is None else (2, unified)


def resident_bytes(status: str) -> int | None:
    """VmRSS from a `/proc/<pid>/status` text."""
    for line in status.splitlines():
        if line.startswith("VmRSS:"):
            fields = line.split()
            if len(fields) >= 2 and fields[1].isdigit():
                return int(fields[1]) * _KIB
    return None


# ---------------------------------------------------------------------------------------------
# Reading the host (blocking: run in a worker thread)


def _cgroup_dir(version: int, path: str, root: Path) -> Path | None:
    """The directory of that cgroup as this process sees it. Inside a cgroup namespace the path
    in /proc names less than the mount shows, so shorter suffixes are tried too."""
    base = root / "memory" if version == 1 else root
    if version == 2 and not (root / "cgroup.controllers").exists():
        base = root / "unified"
    parts = [p for p in path.split("/") if p]
    for start in range(len(parts) + 1):
        candidate = base.joinpath(*parts[start:])
        if (candidate / ("memory.usage_in_bytes" if version == 1 else "memory.current")).exists():
            return candidate
    return None


def cgroup_bytes(pid: int, *, root: Path = CGROUP_ROOT, proc: Path = Path("/proc")) -> int | None:
    """The memory the cgroup of `pid` holds, less its inactive page cache; None when unreadable.

    A process in the agent's own cgroup (a simulated runtime, a child of the agent) is measured
    by its resident set: the cgroup would count the agent too.
    """
    try:
        theirs = (proc / str(pid) / "cgroup").read_text()
        ours = (proc / "self" / "cgroup").read_text()
        if theirs == ours:
            return resident_bytes((proc / str(pid) / "status").read_text())
        found = memory_cgroup(theirs)
        if found is None:
            return None
        version, path = found
        directory = _cgroup_dir(version, path, root)
        if directory is None:
            return None
        usage_file = "memory.usage_in_bytes" if version == 1 else "memory.current"
        usage = int((directory / usage_file).read_text().split()[0])
        stat = parse_memory_stat((directory / "memory.stat").read_text())
    except (OSError, ValueError, IndexError):
        return None
    inactive = stat.get("total_inactive_file" if version == 1 else "inactive_file", 0)
    return max(0, min(usage - inactive, MAX_BYTES))


def cgroup_pids(pid: int, *, root: Path = CGROUP_ROOT, proc: Path = Path("/proc")) -> frozenset[int]:
    """Every process in the cgroup of `pid` (only `pid` when it shares the agent's own cgroup)."""
    try:
        theirs = (proc / str(pid) / "cgroup").read_text()
        if theirs == (proc / "self" / "cgroup").read_text():
            return frozenset({pid})
        found = memory_cgroup(theirs)
        directory = None if found is None else _cgroup_dir(found[0], found[1], root)
        if directory is None:
            return frozenset({pid})
        return frozenset(int(p) for p in (directory / "cgroup.procs").read_text().split()) | {pid}
    except (OSError, ValueError):
        return frozenset({pid})


async def query_compute_apps(nvidia_smi: str) -> dict[int, int]:
    """GPU memory by host pid; raises Unavailable when nvidia-smi cannot say (no deadline here)."""
    return parse_compute_apps(await run_nvidia_smi(nvidia_smi, COMPUTE_APPS_ARGS))


# ---------------------------------------------------------------------------------------------
# The meter and the guard


class ReplicaMemoryMeter:
    """The runtimes as the agent sees them, each with the memory measured for it; `run` measures,
    and guards a unified node's memory (module docstring)."""

    def __init__(
        self,
        runtimes: Runtimes,
        supervisor: Supervised,
        *,
        inventory: Callable[[], NodeInventory],
        interval_s: float,
        floor_bytes: int,
        meminfo_path: str,
        nvidia_smi: str | None,
    ) -> None:
        self._runtimes = runtimes
        self._supervisor = supervisor
        self._inventory = inventory
        self._interval_s = interval_s
        self._floor_bytes = floor_bytes
        self._meminfo_path = meminfo_path
        self._nvidia_smi = nvidia_smi
        #: MemAvailable just before each assignment's container started, until it is Ready.
        self._baseline: dict[str, int] = {}
        #: The drop from that baseline to its first Ready, by assignment id.
        self._drop: dict[str, int] = {}
        self._measured: dict[str, wire.ReplicaMemory] = {}
        self._pressure: wire.MemoryPressure | None = None
        self._stops = 0
        self._next_stop_at = float("-inf")

    # --- what the agent and the supervisor call

    def update(self, generation: int, assignments: Sequence[wire.Assignment]) -> None:
        self._runtimes.update(generation, assignments)

    def statuses(self) -> list[wire.AssignmentStatus]:
        out = []
        for status in self._runtimes.statuses():
            measured = self._measured.get(status.assignment_id)
            if measured is not None and status.state is not wire.RuntimeState.STOPPED:
                out.append(attrs.evolve(status, memory=measured))
            else:
                out.append(status)
        return out

    @property
    def pressure(self) -> wire.MemoryPressure | None:
        """Set while a unified node's MemAvailable is under the floor."""
        return self._pressure

    @property
    def stops(self) -> int:
        """Replicas the guard stopped since the agent started."""
        return self._stops

    def on_start(self, assignment_id: str) -> None:
        """The supervisor is about to start this assignment's container: note MemAvailable."""
        try:
            with open(self._meminfo_path, encoding="utf-8") as f:
                available = parse_meminfo(f.read()).available_bytes
        except (OSError, Unavailable):
            return
        self._baseline[assignment_id] = available
        self._drop.pop(assignment_id, None)

    # --- the loop

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> NoReturn:
        task_status.started()
        while True:
            started = trio.current_time()
            await self.measure_once()
            await trio.sleep_until(started + self._interval_s)

    async def measure_once(self) -> None:
        """One look: MemAvailable, the guard, then each running replica's figures."""
        try:
            available: int | None = parse_meminfo(
                await trio.Path(self._meminfo_path).read_text(encoding="utf-8")
            ).available_bytes
        except (OSError, Unavailable) as exc:
            log.debug("memory meter: cannot read meminfo: %s", exc)
            available = None
        unified = self._unified()
        replicas = self._supervisor.replicas()
        if unified and available is not None:
            await self._guard(available, replicas)
        running = any(r.pid is not None and not r.held for r in replicas)
        gpu = await self._gpu_by_pid() if running and not unified else {}
        live: dict[str, wire.ReplicaMemory] = {}
        for replica in replicas:
            aid = replica.assignment_id
            if replica.held or replica.pid is None:
                continue
            drop = None
            if unified and available is not None:
                drop = self._available_drop(replica, available)
            cgroup = await trio.to_thread.run_sync(cgroup_bytes, replica.pid)
            gpu_bytes = None
            if gpu:
                pids = await trio.to_thread.run_sync(cgroup_pids, replica.pid)
                gpu_bytes = sum(gpu.get(p, 0) for p in pids) or None
            figures = [f for f in (cgroup, gpu_bytes, drop) if f is not None]
            if figures:
                live[aid] = wire.ReplicaMemory(
                    measured_bytes=max(figures), cgroup_bytes=cgroup, gpu_bytes=gpu_bytes, available_drop_bytes=drop
                )
        self._measured = live
        for gone in self._baseline.keys() - {r.assignment_id for r in replicas}:
            del self._baseline[gone]
            self._drop.pop(gone, None)

    def _available_drop(self, replica: Replica, available: int) -> int | None:
        aid = replica.assignment_id
        if aid not in self._drop and replica.state is wire.RuntimeState.READY and aid in self._baseline:
            self._drop[aid] = max(0, self._baseline[aid] - available)
        return self._drop.get(aid)

    async def _guard(self, available: int, replicas: list[Replica]) -> None:
        floor = self._floor_bytes
        if floor <= 0 or available >= floor:
            if self._pressure is not None:
                log.warning("memory pressure is gone: MemAvailable %d bytes, floor %d", available, floor)
            self._pressure = None
            return
        pressure = wire.MemoryPressure(available_bytes=available, floor_bytes=floor)
        if self._pressure is None:
            log.warning("%s", pressure.describe())
        self._pressure = pressure
        running = [r for r in replicas if not r.held and r.pid is not None]
        if not running or trio.current_time() < self._next_stop_at:
            return
        newest = max(running, key=lambda r: (r.started_at, r.assignment_id))
        detail = f"stopped by the node: {pressure.describe()}; the most recently started replica goes first"
        with trio.move_on_after(STOP_TIMEOUT_S):
            if await self._supervisor.stop_held(newest.assignment_id, wire.MEMORY_PRESSURE, detail):
                self._stops += 1
                self._next_stop_at = trio.current_time() + STOP_SETTLE_S

    def _unified(self) -> bool:
        try:
            return any(g.unified_memory for g in self._inventory().gpus)
        except Unavailable:
            return False

    async def _gpu_by_pid(self) -> dict[int, int]:
        nvidia_smi = self._nvidia_smi
        if nvidia_smi is None:
            return {}
        with trio.move_on_after(NVIDIA_SMI_TIMEOUT_S):
            try:
                return await query_compute_apps(nvidia_smi)
            except Unavailable as exc:
                log.debug("memory meter: %s", exc)
        return {}


def default_nvidia_smi(configured: str) -> str | None:
    """The nvidia-smi the meter runs: the configured path, else the one on PATH, else none."""
    return configured or shutil.which("nvidia-smi")
