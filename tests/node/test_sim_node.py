"""A real node agent (`serve_node`) running a signed `sim` assignment as a local process.

Policy: loopback only; the fake controller (real CurveZMQ, a real controller signing key) binds
port 0; the runtime gets a free port of 127.0.0.1; every wait is bounded by `trio.fail_after`.
The simulation node has no podman at all (a demo machine); the node without simulation uses the
run's real podman service, so the only thing it refuses is the simulation.
"""

from __future__ import annotations

import json
import socket
import time
from pathlib import Path

import attrs
import httpx
import pytest
import trio

from nexa.config import ContainerConfig, NodeConfig, Seconds, SupervisorConfig
from nexa.contracts import wire
from nexa.errors import ConfigError
from nexa.node.agent import serve_node
from nexa.node.processes import SIM_DIR
from tests.conftest import free_port
from tests.support.api import wait_for
from tests.support.nodes import FakeController, node_config, sim_runtime, start_node

TIMEOUT_S = 30
BEAT_S = 0.05
State = wire.RuntimeState


@pytest.fixture
def state_dir(tmp_path: Path) -> Path:
    return tmp_path / "state"


@pytest.fixture
def cfg(tmp_path: Path, state_dir: Path) -> NodeConfig:
    # No podman behind its socket: a simulation node needs none.
    return node_config(
        tmp_path,
        state_dir,
        {"runtimes": ["sim"]},
        inventory_poll_interval_s=Seconds(0.05),
        heartbeat_interval_s=Seconds(BEAT_S),
        supervisor=SupervisorConfig(restart_backoff_initial_s=Seconds(0.1), reconcile_interval_s=Seconds(0.2)),
        simulation=True,
    )


@pytest.fixture
async def ctl(nursery: trio.Nursery, state_dir: Path) -> FakeController:
    controller = FakeController(nursery)
    with trio.fail_after(TIMEOUT_S):
        await controller.start()
    controller.enroll(state_dir)
    return controller


def sim_set(generation: int, assignments: list[wire.Assignment]) -> wire.AssignmentSet:
    return wire.AssignmentSet(
        node_id="n1", epoch=1, generation=generation, lease_expires_at=time.time() + 60, assignments=assignments
    )


def answers(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def reported(beat: wire.Heartbeat, aid: str) -> wire.AssignmentStatus | None:
    return next((s for s in beat.assignments if s.assignment_id == aid), None)


async def test_a_signed_sim_assignment_becomes_ready_answers_and_stops_with_an_empty_set(
    nursery: trio.Nursery, ctl: FakeController, cfg: NodeConfig, state_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NEXA_SIMULATION_ONLY", "1")
    port = free_port()
    assignment = wire.Assignment(id="a1", deployment="chat-small", runtime=sim_runtime(port))
    with trio.fail_after(TIMEOUT_S):
        node = await start_node(nursery, cfg)
        await ctl.next(wire.Hello)
        ack = await ctl.answer(sim_set(1, [assignment]))
        assert ack.accepted
        beat = await ctl.next(wire.Heartbeat, lambda b: getattr(reported(b, "a1"), "state", None) is State.READY)
        assert beat.generation == 1

        # The runtime answers on its assigned loopback port, serving the deployment as its model.
        async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
            models = (await http.get("/v1/models")).json()
            body = {"model": "chat-small", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 3}
            answer = await http.post("/v1/chat/completions", json=body, headers={"X-Nexa-Request-Id": "w1"})
        assert [m["id"] for m in models["data"]] == ["chat-small"]
        assert answer.json()["usage"]["completion_tokens"] == 3
        journal = state_dir / SIM_DIR / "nexa-a1.jsonl"

        # The sim writes "completed" once the answer is sent: the client may read it first.
        async def both_written() -> bool:
            return len(journal.read_text().splitlines()) >= 2

        await wait_for(both_written)
        assert [json.loads(line)["event"] for line in journal.read_text().splitlines()] == ["request", "completed"]

        # An empty set stops the process; the report drops the assignment once it is gone.
        assert (await ctl.answer(sim_set(2, []))).accepted
        await ctl.next(wire.Heartbeat, lambda b: b.generation == 2 and b.assignments == [])
        assert not answers(port)
        await node.stop()


async def test_the_agent_stops_its_sim_runtimes_when_it_stops(
    nursery: trio.Nursery, ctl: FakeController, cfg: NodeConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("NEXA_SIMULATION_ONLY", "1")
    port = free_port()
    with trio.fail_after(TIMEOUT_S):
        node = await start_node(nursery, cfg)  # leave_running_on_exit is true: containers would stay
        await ctl.next(wire.Hello)
        assignment = wire.Assignment(id="a1", deployment="d1", runtime=sim_runtime(port))
        assert (await ctl.answer(sim_set(1, [assignment]))).accepted
        await ctl.next(wire.Heartbeat, lambda b: getattr(reported(b, "a1"), "state", None) is State.READY)
        assert answers(port)
        await node.stop()
    assert not answers(port)  # a process cannot be adopted by the next agent: it goes with this one


async def test_simulation_needs_the_environment_switch(cfg: NodeConfig, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NEXA_SIMULATION_ONLY", raising=False)
    with pytest.raises(ConfigError, match="NEXA_SIMULATION_ONLY=1"):
        await serve_node(cfg, stopping=trio.Event())


async def test_a_node_without_simulation_reports_a_sim_assignment_failed(
    nursery: trio.Nursery, ctl: FakeController, cfg: NodeConfig, podman_socket: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The switch alone does not make a node run simulations: its config must say so too.
    monkeypatch.setenv("NEXA_SIMULATION_ONLY", "1")
    cfg = attrs.evolve(cfg, simulation=False, container=ContainerConfig(socket=podman_socket))
    port = free_port()
    assignment = wire.Assignment(id="a1", deployment="d1", runtime=sim_runtime(port))
    with trio.fail_after(TIMEOUT_S):
        node = await start_node(nursery, cfg)
        await ctl.next(wire.Hello)
        assert (await ctl.answer(sim_set(1, [assignment]))).accepted
        beat = await ctl.next(wire.Heartbeat, lambda b: getattr(reported(b, "a1"), "state", None) is State.FAILED)
        status = reported(beat, "a1")
        assert status is not None
        assert status.reason == "simulation_disabled"
        assert "simulation = true" in status.detail
        await node.stop()
    assert not answers(port)
    assert not (Path(cfg.state_dir) / SIM_DIR).exists()
