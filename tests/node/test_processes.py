"""`ProcessDriver` with real `nexa sim-runtime` children, and `DriverRouter`'s routing.

Policy: loopback only; each child gets a free port of 127.0.0.1; every wait is bounded by
`trio.fail_after`. Podman "down" is the real client pointed at a socket nobody serves.
"""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import httpx
import pytest
import trio

from nexa import container_spec
from nexa.contracts import wire
from nexa.contracts.runtime import LABEL_ASSIGNMENT, ContainerSpec
from nexa.errors import ContainerNotFound, EngineError, EngineUnavailable, SimulationDisabled
from nexa.node.engines.libpod import LibpodEngine
from nexa.node.processes import SIM_ID_PREFIX, DriverRouter, ProcessDriver
from tests.conftest import free_port, sample_runtime
from tests.support.api import wait_for
from tests.support.nodes import sim_runtime

TIMEOUT_S = 30


def sim_spec(aid: str = "a1", *, port: int | None = None, node_id: str = "n1") -> ContainerSpec:
    assignment = wire.Assignment(id=aid, deployment="d1", runtime=sim_runtime(port or free_port()))
    return container_spec.container_spec(node_id, assignment, 1, None)


async def wait_healthy(driver: ProcessDriver | DriverRouter, container_id: str) -> None:
    while not await driver.healthcheck(container_id):  # noqa: ASYNC110 - polling is what a probe is
        await trio.sleep(0.05)


def answers(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


async def test_a_sim_runtime_is_created_started_probed_stopped_restarted_and_removed(tmp_path: Path) -> None:
    spec = sim_spec()
    port = int(spec.labels[container_spec.LABEL_PORT])
    async with ProcessDriver(tmp_path) as driver, httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
        with trio.fail_after(TIMEOUT_S):
            assert await driver.image_exists(spec.image)
            await driver.pull(spec.image)  # nothing to pull
            cid = await driver.create(spec)
            assert cid.startswith(SIM_ID_PREFIX)
            created = await driver.inspect(cid)
            assert (created.running, created.status, created.started_at) == (False, "created", None)
            assert not await driver.healthcheck(cid)
            with pytest.raises(EngineError, match="in use"):
                await driver.create(spec)  # one name, one runtime (as podman)

            await driver.start(cid)
            await driver.start(cid)  # starting a running one does nothing
            await wait_healthy(driver, cid)
            state = await driver.inspect(cid)
            assert (state.running, state.status, state.name) == (True, "running", "nexa-a1")
            assert state.started_at is not None
            # The supervisor's identity check: the "image" is the digest it was created with.
            assert container_spec.image_matches(state, spec.image)
            assert state.labels == spec.labels
            assert await driver.list({LABEL_ASSIGNMENT: "a1"}) == [state]
            assert await driver.list({LABEL_ASSIGNMENT: "other"}) == []

            # The deployment is the model; the journal and the faults file are the driver's.
            assert (await http.get("/v1/models")).json()["data"][0]["id"] == "d1"
            body = {"model": "d1", "messages": [{"role": "user", "content": "hi"}]}
            assert (await http.post("/v1/chat/completions", json=body, headers={"X-Nexa-Request-Id": "q1"})).is_success

            def journaled() -> list[tuple[str, str]]:
                lines = driver.journal_path("nexa-a1").read_text().splitlines()
                return [(e["event"], e["id"]) for e in map(json.loads, lines)]

            async def answered() -> bool:  # the runtime journals `completed` just after its last byte
                return len(journaled()) >= 2

            await wait_for(answered)
            assert journaled() == [("request", "q1"), ("completed", "q1")]
            driver.faults_path.write_text(json.dumps({"fail": "before", "status": 503}))
            assert (await http.post("/v1/chat/completions", json=body)).status_code == 503
            driver.faults_path.unlink()

            with pytest.raises(EngineError, match="running"):
                await driver.remove(cid)  # as podman: stop first, or force
            await driver.stop(cid, timeout_s=5)
            stopped = await driver.inspect(cid)
            assert (stopped.running, stopped.status, stopped.exit_code) == (False, "exited", 0)  # SIGTERM: clean exit
            assert not answers(port)
            assert not await driver.healthcheck(cid)

            await driver.start(cid)  # a restart, as after a crash
            await wait_healthy(driver, cid)
            await driver.remove(cid, force=True)
            assert not answers(port)
            with pytest.raises(ContainerNotFound):
                await driver.inspect(cid)
            assert await driver.list() == []


async def test_closing_the_driver_stops_every_child(tmp_path: Path) -> None:
    specs = [sim_spec("a1"), sim_spec("a2")]
    ports = [int(s.labels[container_spec.LABEL_PORT]) for s in specs]
    driver = ProcessDriver(tmp_path)
    try:
        with trio.fail_after(TIMEOUT_S):
            for spec in specs:
                cid = await driver.create(spec)
                await driver.start(cid)
                await wait_healthy(driver, cid)
            assert all(answers(port) for port in ports)
    finally:
        await driver.aclose()
    assert not any(answers(port) for port in ports)
    with pytest.raises(EngineError, match="closed"):
        await driver.create(sim_spec("a3"))


async def test_a_child_that_ignores_sigterm_is_killed_after_the_timeout(tmp_path: Path) -> None:
    script = tmp_path / "stubborn.py"
    script.write_text("import signal, time\nsignal.signal(signal.SIGTERM, signal.SIG_IGN)\ntime.sleep(60)\n")
    async with ProcessDriver(tmp_path, argv=[sys.executable, str(script)]) as driver:
        with trio.fail_after(TIMEOUT_S):
            cid = await driver.create(sim_spec())
            await driver.start(cid)
            await trio.sleep(0.3)  # let it install its handler
            started = trio.current_time()
            await driver.stop(cid, timeout_s=0.5)
            assert trio.current_time() - started >= 0.5
            state = await driver.inspect(cid)
    assert (state.running, state.exit_code) == (False, 128 + 9)


async def test_only_sim_specs_are_taken(tmp_path: Path) -> None:
    llama = container_spec.container_spec(
        "n1", wire.Assignment(id="a1", deployment="d1", runtime=sample_runtime()), 1, Path("/m")
    )
    async with ProcessDriver(tmp_path) as driver:
        with pytest.raises(Exception, match="sim runtimes only"):
            await driver.create(llama)
        with pytest.raises(ContainerNotFound):
            await driver.start("sim-nope")


# --- the router ----------------------------------------------------------------------------------


async def test_without_simulation_a_sim_spec_is_refused_as_simulation_disabled(tmp_path: Path) -> None:
    async with LibpodEngine(str(tmp_path / "nobody.sock")) as podman:
        router = DriverRouter(podman, None)
        with pytest.raises(SimulationDisabled) as info:
            await router.create(sim_spec())
        assert info.value.code == "simulation_disabled"
        assert "simulation = true" in info.value.message
        with pytest.raises(ContainerNotFound):
            await router.inspect("sim-0123")
        with pytest.raises(EngineUnavailable):
            await router.list()  # without simulation, podman's answer is the answer


async def test_sim_specs_and_ids_go_to_processes_the_rest_to_podman(tmp_path: Path) -> None:
    llama = container_spec.container_spec(
        "n1", wire.Assignment(id="a2", deployment="d2", runtime=sample_runtime()), 1, Path("/m")
    )
    async with LibpodEngine(str(tmp_path / "nobody.sock")) as podman, ProcessDriver(tmp_path) as processes:
        router = DriverRouter(podman, processes)
        with trio.fail_after(TIMEOUT_S):
            cid = await router.create(sim_spec("a1"))
            await router.start(cid)
            await wait_healthy(router, cid)
            assert (await router.inspect(cid)).running
            # Podman is down: its specs and ids fail as podman fails...
            with pytest.raises(EngineUnavailable):
                await router.create(llama)
            with pytest.raises(EngineUnavailable):
                await router.inspect("0" * 64)
            # ...while listing still reports the simulated runtimes (a demo machine without podman).
            assert [s.id for s in await router.list({container_spec.LABEL_NODE: "n1"})] == [cid]
            await router.stop(cid, timeout_s=5)
            await router.remove(cid)
            assert await router.list() == []
