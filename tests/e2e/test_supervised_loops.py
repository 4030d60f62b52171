"""Supervised loops, for real: a controller and a `serve_node` agent in this trio run, a `sim` runtime.

One loop at a time is made to fail once (a method it calls raises ValueError, as outside data did in
issue 12). Each time the failure is counted (`nexa_loop_failures_total{loop}` on the controller, the
node's supervision statistics), and afterwards the controller still answers `/healthz`, the
management API and inference, and the node still heartbeats and serves.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable
from functools import partial, wraps
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from nexa import config
from nexa.channel.endpoints import NodeChannel
from nexa.channel.links import Link, Uplink
from nexa.control.datapath.metering import Meter
from nexa.control.deployments import Deployments
from nexa.control.deployments.rollout import RolloutWatcher
from nexa.control.fleet.nodes import Fleet
from nexa.node import agent as agent_module
from nexa.node import identity, inventory
from nexa.node.agent import Agent, NodeStarted, serve_node
from nexa.node.relay import NodeRelay
from nexa.node.supervisor import Supervisor
from tests.conftest import Controller, start_controller
from tests.realparts import BuiltImages, S3Store
from tests.support.api import ok
from tests.support.cluster import SIM_ARGS, sim_node_config
from tests.support.models import bring_to, registry_config

pytestmark = pytest.mark.slow

TIMEOUT_S = 40
Json = dict[str, Any]


class Once:
    """Replaces a callable with one that raises ValueError on its first call, then delegates."""

    def __init__(self) -> None:
        # A plain flag: the patched function may run in a worker thread (inventory's stat).
        self.fired = False

    def wrap(self, fn: Callable[..., Any]) -> Callable[..., Any]:
        if not callable(fn):
            raise TypeError(fn)

        if _is_async(fn):

            @wraps(fn)
            async def async_once(*args: Any, **kwargs: Any) -> Any:
                if not self.fired:
                    self.fired = True
                    raise ValueError("injected fault")
                return await fn(*args, **kwargs)

            return async_once

        @wraps(fn)
        def once(*args: Any, **kwargs: Any) -> Any:
            if not self.fired:
                self.fired = True
                raise ValueError("injected fault")
            return fn(*args, **kwargs)

        return once


def _is_async(fn: Callable[..., Any]) -> bool:
    import inspect

    return inspect.iscoroutinefunction(fn)


async def _metric(http: httpx.AsyncClient, loop: str) -> float:
    text = (await http.get("/metrics")).text
    m = re.search(rf'^nexa_loop_failures_total\{{loop="{re.escape(loop)}"\}} (\S+)$', text, re.M)
    return float(m.group(1)) if m else 0.0


async def _serves(controller: Controller, inference_key: str, node: NodeStarted) -> None:
    """The controller answers /healthz, the management API and inference; the node heartbeats."""
    beats = node.agent.statistics().heartbeats_sent
    async with controller.client() as http:
        assert (await http.get("/healthz")).status_code == 200
        listed = await ok(http.get("/api/v1/nodes"))
        assert [n["state"] for n in listed["nodes"]] == ["Ready"]
    async with controller.client(inference_key) as http:
        body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
        with trio.fail_after(TIMEOUT_S):
            while True:
                resp = await http.post("/v1/chat/completions", json=body, timeout=30)
                if resp.status_code == 200:
                    break
                # A replica may be briefly unready after its node's loop restarted.
                assert resp.status_code in (429, 503), resp.text
                await trio.sleep(0.2)
        assert resp.json()["choices"][0]["message"]["content"]
    with trio.fail_after(TIMEOUT_S):
        while node.agent.statistics().heartbeats_sent < beats + 2:  # noqa: ASYNC110 - a counter, no event
            await trio.sleep(0.1)


def _enroll(controller: Controller, token: str, state_dir: Path) -> None:
    argv = ["node", "enroll", "--controller", controller.url, "--token", token, "--name", "sim-1"]
    done = subprocess.run(
        [sys.executable, "-m", "nexa", *argv, "--state-dir", str(state_dir)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr


# (loop name, the class or module whose function that loop calls, the function's name)
CONTROLLER_FAULTS = [
    ("southbound.receive", Link, "receive_unverified"),
    ("southbound.control", Link, "verify"),  # at the node's next heartbeat
    ("southbound.liveness", Fleet, "overdue"),
    ("deployments", Deployments, "reconcile"),
    ("rollout", RolloutWatcher, "check"),
    ("metering", Meter, "flush"),
]
NODE_FAULTS = [
    ("agent.beat", Agent, "_beat_once"),  # every beat, liveness or state
    ("agent.receive", Uplink, "receive_unverified"),
    ("agent.control", NodeChannel, "verify"),  # at the controller's next lease renewal (lease / 3)
    ("inventory", inventory, "_stat_signature"),
    ("supervisor", Supervisor, "_remove_orphans"),
    ("relay", NodeRelay, "_serve"),
]


async def _cluster(
    nursery: trio.Nursery,
    tmp_path: Path,
    s3_store: S3Store,
    test_images: BuiltImages,
    monkeypatch: pytest.MonkeyPatch,
    *,
    assignment_lease_s: float | None = None,
    sim_args: list[str] = SIM_ARGS,
) -> tuple[Controller, str, NodeStarted, trio.Event]:
    """A controller and one `serve_node` agent in this trio run, serving alias `chat` (one `sim` replica);
    the event stops the agent."""
    monkeypatch.setenv("NEXA_SIMULATION_ONLY", "1")
    cfg = registry_config(tmp_path, s3_store)
    if assignment_lease_s is not None:
        cfg = attrs.evolve(cfg, nodes=attrs.evolve(cfg.nodes, assignment_lease_s=config.Seconds(assignment_lease_s)))
    controller = await start_controller(nursery, cfg)
    async with controller.client() as http:
        await ok(http.post("/api/v1/tenants", json={"id": "acme"}), 201)
        created = await ok(http.post("/api/v1/keys", json={"role": "inference", "tenant": "acme"}), 201)
        runtime = {"name": "sim", "kind": "sim", "version": "1", "image": test_images.busybox}
        await ok(http.post("/api/v1/runtimes", json=runtime), 201)
        await bring_to(http, s3_store, "tiny", "v1", "Approved")
        await ok(http.post("/api/v1/aliases/chat/promote", json={"model": "tiny", "version": "v1"}))
        token = await ok(http.post("/api/v1/enrollment-tokens", json={"ttl_s": 600}), 201)
    inference_key: str = created["key"]

    creds = tmp_path / "node-s3.json"
    creds.write_text(
        json.dumps(
            {
                "access_key_id": s3_store.credentials.access_key_id,
                "secret_access_key": s3_store.credentials.secret_access_key,
            }
        )
    )
    creds.chmod(0o600)
    node_dir = tmp_path / "sim-1"
    await trio.to_thread.run_sync(_enroll, controller, token["token"], node_dir)
    node_cfg = config.load(str(sim_node_config(node_dir, 1, s3_store, creds)), config.NodeConfig)
    node_stopping = trio.Event()
    with trio.fail_after(TIMEOUT_S):
        node: NodeStarted = await nursery.start(partial(serve_node, node_cfg, stopping=node_stopping))

    deployment = {
        "name": "chat-a",
        "runtime": "sim",
        "alias": "chat",
        "replicas": 1,
        "resources": {"accelerators": 0, "memory_bytes": 64 * 2**20, "cpus": 0.5},
        "options": {"port": 18600, "command": sim_args},
    }
    async with controller.client() as http:
        with trio.fail_after(TIMEOUT_S):
            # Placeable once the node's first heartbeat (its inventory) has arrived.
            while (await http.post("/api/v1/deployments", json=deployment)).status_code != 201:  # noqa: ASYNC110
                await trio.sleep(0.2)
    await _serves(controller, inference_key, node)
    return controller, inference_key, node, node_stopping


async def test_each_loop_fails_once_and_everything_still_serves(
    nursery: trio.Nursery,
    tmp_path: Path,
    s3_store: S3Store,
    test_images: BuiltImages,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    controller, inference_key, node, node_stopping = await _cluster(
        nursery, tmp_path, s3_store, test_images, monkeypatch
    )
    assert node.supervision is not None

    fired: list[Once] = []
    for loop, owner, attr in CONTROLLER_FAULTS:
        once = Once()
        fired.append(once)
        async with controller.client() as http:
            before = await _metric(http, loop)
            with monkeypatch.context() as patch:
                patch.setattr(owner, attr, once.wrap(getattr(owner, attr)))
                with trio.fail_after(TIMEOUT_S):
                    while await _metric(http, loop) < before + 1:  # noqa: ASYNC110 - polling /metrics
                        await trio.sleep(0.05)
        await _serves(controller, inference_key, node)

    for loop, owner, attr in NODE_FAULTS:
        once = Once()
        fired.append(once)
        before = node.supervision.statistics().failures.get(loop, 0)
        with monkeypatch.context() as patch:
            patch.setattr(owner, attr, once.wrap(getattr(owner, attr)))
            with trio.fail_after(TIMEOUT_S):
                if loop in ("relay", "agent.receive"):
                    # These run on inference traffic: this request meets the fault (and may fail).
                    async with controller.client(inference_key) as http:
                        body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
                        with contextlib.suppress(httpx.TimeoutException):
                            await http.post("/v1/chat/completions", json=body, timeout=5)
                while node.supervision.statistics().failures.get(loop, 0) < before + 1:  # noqa: ASYNC110
                    await trio.sleep(0.05)
        await _serves(controller, inference_key, node)

    # Nothing else failed along the way: only the loops that were made to fail are counted.
    counted = {name for name, count in node.supervision.statistics().failures.items() if count}
    assert counted <= {loop for loop, _, _ in NODE_FAULTS}
    assert all(once.fired for once in fired)
    node_stopping.set()
    controller.stopping.set()


#: How slow the fault makes the node's fence save and the controller's store writes (s).
SLOW_S = 2.0
#: A stream of 400 tokens at 100 per second: far more chunks than the relay's credit window.
STREAM_ARGS = ["--ttft-ms", "5", "--tokens-per-s", "100", "--output-tokens", "400"]


async def test_a_stream_keeps_flowing_while_control_work_is_slow(
    nursery: trio.Nursery,
    tmp_path: Path,
    s3_store: S3Store,
    test_images: BuiltImages,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Control never blocks data (issue 16): while every fence save on the node and every store write
    the controller makes for a node message (inventory, acknowledgement) take SLOW_S, a stream's
    chunks still arrive at the runtime's pace. Before, one receive loop per side awaited that work,
    and the chunks (and the credits that let them flow) waited behind it for as long."""
    # A 6 s lease: the controller renews it every 2 s, so the node saves its fence during the stream.
    controller, inference_key, node, node_stopping = await _cluster(
        nursery, tmp_path, s3_store, test_images, monkeypatch, assignment_lease_s=6.0, sim_args=STREAM_ARGS
    )
    slowed = {"fence": 0, "store": 0}
    save_fence = identity.save_fence
    write_deferred = Fleet._write_deferred

    def slow_save_fence(*args: Any) -> None:
        slowed["fence"] += 1
        time.sleep(SLOW_S)  # in the agent's worker thread, as the fsync is
        save_fence(*args)

    async def slow_write_deferred(self: Fleet, live: Any) -> None:
        slowed["store"] += 1
        await trio.sleep(SLOW_S)
        await write_deferred(self, live)

    renewed = node.agent.statistics().leases_renewed
    arrivals: list[float] = []
    body = {"model": "chat", "messages": [{"role": "user", "content": "hi"}], "stream": True}
    with monkeypatch.context() as patch, trio.fail_after(TIMEOUT_S):
        patch.setattr(agent_module, "save_fence", slow_save_fence)
        patch.setattr(Fleet, "_write_deferred", slow_write_deferred)
        async with (
            controller.client(inference_key) as http,
            http.stream("POST", "/v1/chat/completions", json=body, timeout=30) as resp,
        ):
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    arrivals.append(trio.current_time())
    assert len(arrivals) >= 400
    # The faults were met while the stream ran: fence saves (lease renewals) and store writes.
    assert slowed["fence"] >= 1 and slowed["store"] >= 1, slowed
    gaps = [b - a for a, b in itertools.pairwise(arrivals)]
    assert max(gaps) < SLOW_S / 2, f"a chunk waited {max(gaps):.2f} s behind control work"
    # Control work went on too, only slower: the node still renews its lease.
    with trio.fail_after(TIMEOUT_S):
        while node.agent.statistics().leases_renewed <= renewed:  # noqa: ASYNC110 - a counter, no event
            await trio.sleep(0.1)
    node_stopping.set()
    controller.stopping.set()
