"""The memory-pressure guard of a unified-memory node, through a real node agent (`serve_node`).

The node is a DGX Spark as far as the agent can tell: its nvidia-smi prints a GB10's recorded answer
(tests/fixtures/nvidia-smi) and its meminfo is a GB10's recorded /proc/meminfo
(tests/fixtures/meminfo), copied to a file the test rewrites (`[node] meminfo_path`: the fault
injection). Two `sim` replicas run as local processes; the fake controller (real CurveZMQ, a real
signing key) reads the heartbeats.
"""

from __future__ import annotations

import re
import socket
import time
from pathlib import Path

import attrs
import pytest
import trio

from nexa.config import MemoryConfig, NodeConfig, Seconds, SupervisorConfig
from nexa.contracts import wire
from tests.conftest import FIXTURES, free_port
from tests.support.nodes import FakeController, node_config, sim_runtime, start_node

TIMEOUT_S = 30
GIB = 1024**3
FLOOR = 8 * GIB
State = wire.RuntimeState
GB10_MEMINFO = (FIXTURES / "meminfo" / "gb10_dgx_spark.meminfo").read_text()


def meminfo_with(available_bytes: int) -> str:
    """The GB10's recorded meminfo with MemAvailable replaced (what the host would show under load)."""
    line = f"MemAvailable:   {available_bytes // 1024} kB"
    return re.sub(r"^MemAvailable:\s+\d+ kB$", line, GB10_MEMINFO, flags=re.M)


def write_meminfo(path: Path, available_bytes: int) -> None:
    staging = path.with_suffix(".new")
    staging.write_text(meminfo_with(available_bytes))
    staging.replace(path)


@pytest.fixture
def meminfo(tmp_path: Path) -> Path:
    path = tmp_path / "meminfo"
    write_meminfo(path, 100 * GIB)
    return path


@pytest.fixture
def cfg(tmp_path: Path, meminfo: Path) -> NodeConfig:
    return node_config(
        tmp_path,
        tmp_path / "state",
        {"runtimes": ["sim"]},
        inventory_poll_interval_s=Seconds(0.05),
        supervisor=SupervisorConfig(restart_backoff_initial_s=Seconds(0.1), reconcile_interval_s=Seconds(0.2)),
        simulation=True,
        discovery_interval_s=Seconds(0.1),
        meminfo_path=str(meminfo),
        memory=MemoryConfig(pressure_floor_bytes=FLOOR),
    )


@pytest.fixture
async def ctl(nursery: trio.Nursery, tmp_path: Path) -> FakeController:
    controller = FakeController(nursery)
    with trio.fail_after(TIMEOUT_S):
        await controller.start()
    controller.enroll(tmp_path / "state")
    return controller


def assignment_set(generation: int, assignments: list[wire.Assignment]) -> wire.AssignmentSet:
    return wire.AssignmentSet(
        node_id="n1", epoch=1, generation=generation, lease_expires_at=time.time() + 60, assignments=assignments
    )


def status(beat: wire.Heartbeat, aid: str) -> wire.AssignmentStatus | None:
    return next((s for s in beat.assignments if s.assignment_id == aid), None)


def answers(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def is_ready(aid: str) -> object:
    return lambda b: (s := status(b, aid)) is not None and s.state is State.READY


@pytest.mark.slow
async def test_the_guard_stops_the_newest_replica_when_memavailable_falls_under_the_floor(
    nursery: trio.Nursery, ctl: FakeController, cfg: NodeConfig, meminfo: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NEXA_SIMULATION_ONLY", "1")
    node = await start_node(nursery, cfg)
    try:
        older_port, newer_port = free_port(), free_port()
        older = wire.Assignment(id="older", deployment="d", runtime=sim_runtime(older_port))
        newer = wire.Assignment(id="newer", deployment="d", runtime=sim_runtime(newer_port))
        with trio.fail_after(TIMEOUT_S):
            await ctl.next(wire.Hello)
            assert (await ctl.answer(assignment_set(1, [older]))).accepted
            await ctl.next(wire.Heartbeat, is_ready("older"))
            assert (await ctl.answer(assignment_set(2, [older, newer]))).accepted
            beat = await ctl.next(wire.Heartbeat, lambda b: is_ready("older")(b) and is_ready("newer")(b))
            assert beat.memory_pressure is None and beat.memory_pressure_stops == 0

            # The host's MemAvailable falls to 3 GiB, under the 8 GiB floor.
            write_meminfo(meminfo, 3 * GIB)
            beat = await ctl.next(wire.Heartbeat, lambda b: b.memory_pressure_stops == 1)
        stopped, kept = status(beat, "newer"), status(beat, "older")
        assert stopped is not None and kept is not None
        assert (stopped.state, stopped.reason) == (State.FAILED, "memory_pressure")
        assert "MemAvailable 3.00 GiB" in stopped.detail and "floor of 8.00 GiB" in stopped.detail
        assert kept.state is State.READY
        assert beat.memory_pressure == wire.MemoryPressure(available_bytes=3 * GIB, floor_bytes=FLOOR)
        assert not answers(newer_port) and answers(older_port)

        # Back above the floor: the condition clears; the stopped replica stays stopped (Failed).
        write_meminfo(meminfo, 50 * GIB)
        with trio.fail_after(TIMEOUT_S):
            beat = await ctl.next(wire.Heartbeat, lambda b: b.memory_pressure is None)
        stopped = status(beat, "newer")
        assert stopped is not None and (stopped.state, stopped.reason) == (State.FAILED, "memory_pressure")
        assert beat.memory_pressure_stops == 1
        assert (kept := status(beat, "older")) is not None and kept.state is State.READY
        # Each running replica is measured: a sim runtime (a child of the agent) by its resident set.
        assert kept.memory is not None and 10 << 20 < kept.memory.measured_bytes < 1 << 30
    finally:
        node.stopping.set()
        with trio.fail_after(TIMEOUT_S):
            await node.stopped.wait()


async def test_no_guard_on_a_node_with_discrete_gpus(
    nursery: trio.Nursery,
    ctl: FakeController,
    cfg: NodeConfig,
    meminfo: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """An H100 server's runtimes hold GPU memory, not the host's: a low MemAvailable stops nothing."""
    monkeypatch.setenv("NEXA_SIMULATION_ONLY", "1")
    smi = tmp_path / "h100-smi"
    smi.write_text(f'#!/bin/sh\nexec cat "{FIXTURES / "nvidia-smi" / "h100_80g_x8.csv"}"\n')
    smi.chmod(0o755)
    node = await start_node(nursery, attrs.evolve(cfg, nvidia_smi=str(smi)))
    try:
        port = free_port()
        only = wire.Assignment(id="only", deployment="d", runtime=sim_runtime(port))
        with trio.fail_after(TIMEOUT_S):
            await ctl.next(wire.Hello)
            assert (await ctl.answer(assignment_set(1, [only]))).accepted
            await ctl.next(wire.Heartbeat, is_ready("only"))
            write_meminfo(meminfo, 1 * GIB)
            await ctl.next(wire.Heartbeat, lambda b: b.inventory.memory_available_bytes == 1 * GIB)
            for _ in range(5):
                beat = await ctl.next(wire.Heartbeat)
        assert beat.memory_pressure is None and beat.memory_pressure_stops == 0
        assert (got := status(beat, "only")) is not None and got.state is State.READY
    finally:
        node.stopping.set()
        with trio.fail_after(TIMEOUT_S):
            await node.stopped.wait()
