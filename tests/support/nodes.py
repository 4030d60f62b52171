"""A node agent in this trio run (`serve_node`) against `FakeController`, a controller reduced to its
channel: real CurveZMQ on 127.0.0.1, real keys, an enrolment table and one Link at a time. Also the
node's config (a GB10 behind a fake nvidia-smi), assignment sets, and a `sim` runtime spec."""

from __future__ import annotations

import json
import os
import stat
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

import attrs
import trio

from nexa import security
from nexa.channel import links
from nexa.config import ContainerConfig, NodeConfig, Seconds
from nexa.contracts import wire
from nexa.contracts.api import EnrollResponse
from nexa.contracts.node import RuntimeKind
from nexa.contracts.runtime import HealthProbe, RuntimeSpec
from nexa.node import identity
from nexa.node.agent import Agent, NodeStarted, serve_node
from tests.conftest import FIXTURES, sample_runtime

M = TypeVar("M", bound=wire.NodeMessage)

GB10_SMI = FIXTURES / "nvidia-smi" / "gb10_dgx_spark.csv"
LOOPBACK = "tcp://127.0.0.1:*"
#: The heartbeat interval `node_config` gives the node; by default it sends its state with every beat
#: (`state_interval_s`), as agents did before liveness was split from state.
BEAT_S = 0.05


def write_inventory(path: Path, data: object) -> None:
    """Replace the file the way editors do: new inode, atomic rename."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(data if isinstance(data, str) else json.dumps(data))
    os.replace(tmp, path)


def assignment(aid: str = "a1") -> wire.Assignment:
    return wire.Assignment(id=aid, deployment="d1", runtime=sample_runtime())


def aset(
    epoch: int,
    generation: int,
    *,
    node_id: str = "n1",
    lease_s: float = 30.0,
    assignments: list[wire.Assignment] | None = None,
) -> wire.AssignmentSet:
    return wire.AssignmentSet(
        node_id=node_id,
        epoch=epoch,
        generation=generation,
        lease_expires_at=time.time() + lease_s,
        assignments=[assignment()] if assignments is None else assignments,
    )


async def _serve_link(
    link: links.Link, *, task_status: trio.TaskStatus[tuple[trio.CancelScope, str, trio.Event]]
) -> None:
    # Hands back its own cancel scope (STYLE §2.1) and an event set once the socket is closed.
    closed = trio.Event()
    try:
        with trio.CancelScope() as scope:
            async with trio.open_nursery() as nursery:
                endpoint = await nursery.start(link.run)
                task_status.started((scope, endpoint, closed))
    finally:
        closed.set()


@attrs.define
class FakeController:
    """A controller reduced to its channel: real keys, an enrolment table and one Link at a time."""

    nursery: trio.Nursery
    curve: links.CurveKeyPair = attrs.field(factory=links.generate_curve_keypair)
    key: security.SigningKey = attrs.field(factory=security.generate_signing_key)
    by_curve: dict[str, str] = attrs.field(factory=dict)
    node_keys: dict[str, security.PublicKey] = attrs.field(factory=dict)
    endpoint: str = LOOPBACK
    link: links.Link | None = None
    _running: tuple[trio.CancelScope, trio.Event] | None = None

    async def start(self, *, signing_key: security.SigningKey | None = None) -> None:
        """Bind (the same port again after the first time), signing with `signing_key` if given."""
        link = links.Link(
            self.endpoint,
            curve=self.curve,
            signing_key=signing_key or self.key,
            authorize=self.by_curve.get,
            node_key=self.node_keys.get,
        )
        scope, self.endpoint, closed = await self.nursery.start(_serve_link, link)
        self.link, self._running = link, (scope, closed)

    async def stop(self) -> None:
        assert self._running is not None
        scope, closed = self._running
        scope.cancel()
        await closed.wait()
        self.link = self._running = None

    def enroll(self, state_dir: Path, node_id: str = "n1") -> None:
        """What the enrollment API does, through the node's own identity functions."""
        req = identity.enroll_request(state_dir, "nxb_test-token", "spark-1", "test")
        self.by_curve[req.curve_public_key] = node_id
        self.node_keys[node_id] = security.PublicKey.from_b64(req.signing_public_key)
        identity.save_enrollment(
            state_dir,
            EnrollResponse(
                node_id=node_id,
                controller_signing_public_key=self.key.public.b64,
                controller_curve_public_key=self.curve.public,
                channel_endpoint=self.endpoint,
                labels={},
            ),
        )

    async def next(self, cls: type[M], where: Callable[[M], bool] = lambda _: True) -> M:
        """The next message of that kind (and matching `where`), skipping the others."""
        assert self.link is not None
        while True:
            inbound = await self.link.receive()
            assert inbound.node_id == "n1"
            if isinstance(inbound, links.Inbound) and isinstance(inbound.message, cls) and where(inbound.message):
                return inbound.message

    async def push(self, msg: wire.ControllerMessage) -> None:
        assert self.link is not None
        await self.link.send("n1", msg)

    async def answer(self, msg: wire.AssignmentSet) -> wire.Ack:
        await self.push(msg)
        return await self.next(wire.Ack)


@attrs.define
class RunningNode:
    started: NodeStarted
    stopping: trio.Event
    stopped: trio.Event

    @property
    def agent(self) -> Agent:
        return self.started.agent

    async def stop(self) -> None:
        self.stopping.set()
        await self.stopped.wait()


async def _serve_node(cfg: NodeConfig, stopping: trio.Event, stopped: trio.Event, *, task_status) -> None:  # type: ignore[no-untyped-def]
    try:
        await serve_node(cfg, stopping=stopping, task_status=task_status)
    finally:
        stopped.set()


async def start_node(nursery: trio.Nursery, cfg: NodeConfig) -> RunningNode:
    stopping, stopped = trio.Event(), trio.Event()
    started = await nursery.start(_serve_node, cfg, stopping, stopped)
    return RunningNode(started, stopping, stopped)


def fake_gb10_smi(directory: Path) -> Path:
    """An executable `nvidia-smi` in `directory` that prints a DGX Spark's (GB10) recorded answer."""
    smi = directory / "nvidia-smi"
    smi.write_text(f'#!/bin/sh\nexec cat "{GB10_SMI}"\n')
    smi.chmod(smi.stat().st_mode | stat.S_IXUSR)
    return smi


def node_config(tmp_path: Path, state_dir: Path, inventory: dict[str, Any], **over: Any) -> NodeConfig:
    """A fast-beating node on a GB10 (fake nvidia-smi) with `inventory` as its inventory.json and no
    podman behind its socket; `over` replaces any field."""
    smi = fake_gb10_smi(tmp_path)
    inventory_path = tmp_path / "inventory.json"
    write_inventory(inventory_path, inventory)
    base = NodeConfig(
        state_dir=str(state_dir),
        inventory_path=str(inventory_path),
        inventory_poll_interval_s=Seconds(0.02),
        nvidia_smi=str(smi),
        heartbeat_interval_s=Seconds(BEAT_S),
        state_interval_s=Seconds(BEAT_S),
        reconnect_max_s=Seconds(0.2),
        container=ContainerConfig(socket=str(tmp_path / "no-podman.sock")),
    )
    return attrs.evolve(base, **over)


SIM_IMAGE = "registry.example/nexa/sim@sha256:" + "5" * 64


def sim_runtime(port: int, *flags: str) -> RuntimeSpec:
    """A `sim` runtime spec as the controller would sign it (no artifact, no GPUs)."""
    return RuntimeSpec(
        kind=RuntimeKind.SIM,
        image=SIM_IMAGE,
        command=["--ttft-ms", "1", "--tokens-per-s", "1000", *flags],
        port=port,
        memory_bytes=256 << 20,
        cpus=1.0,
        health=HealthProbe(command=["true"], interval_s=0.1, timeout_s=1.0),
        stop_timeout_s=5.0,
    )
