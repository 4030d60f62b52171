"""A controller in this trio run plus real `nexa node` processes running `sim` runtimes.

Everything an operator does goes through the HTTP API: tenant and keys, a `sim` runtime whose
image digest the run's registry holds, a model verified against the run's S3 store, approved and
aliased, a deployment placed on the nodes. The nodes are `python -m nexa node` processes with
`simulation = true` (and NEXA_SIMULATION_ONLY=1), each dialling from its own loopback address;
their runtimes are `nexa sim-runtime` child processes.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import attrs
import httpx
import openai
import trio

from nexa.config import ControlConfig, GatewayConfig
from nexa.node import identity
from tests.conftest import Controller, start_controller
from tests.realparts import BuiltImages, S3Store, loopback_net
from tests.support.api import ok, wait_for
from tests.support.models import bring_to, registry_config
from tests.support.nodes import fake_gb10_smi
from tests.support.s3 import write_credentials

Json = dict[str, Any]
TIMEOUT_S = 40
#: Fast, short answers: 8 tokens, 5 ms to the first.
SIM_ARGS = ["--ttft-ms", "5", "--tokens-per-s", "2000", "--output-tokens", "8"]
MESSAGES: list[Any] = [{"role": "user", "content": "hello there"}]
#: Where `free_runtime_port` looks: below the channel ports (`tests.conftest.free_channel_port`) and
#: Linux's ephemeral range, clear of 18600, the port `nexa demo` and other tests fix.
_RUNTIME_PORTS = range(18601, 20000)


@attrs.define
class SimNode:
    name: str
    state_dir: Path
    config: Path
    node_id: str = ""
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None
    #: The `nexa` command the node runs as (an emulated arm64 binary in tests/test_binary_arm64.py).
    nexa: tuple[str, ...] = (sys.executable, "-m", "nexa")

    @property
    def faults(self) -> Path:
        """The sim runtimes of this node read their fault injection from here."""
        return self.state_dir / "sim" / "faults.json"

    def set_faults(self, **faults: Any) -> None:
        self.faults.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.faults.with_suffix(".tmp")
        tmp.write_text(json.dumps(faults))
        tmp.replace(self.faults)

    def journal(self) -> list[Json]:
        """Every event the node's sim runtimes journaled (metadata only)."""
        events: list[Json] = []
        for path in sorted((self.state_dir / "sim").glob("*.jsonl")):
            events += [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
        return events

    def start(self) -> None:
        self.log = self.state_dir.parent / f"{self.name}-{time.monotonic_ns()}.log"
        env = {**os.environ, "NEXA_SIMULATION_ONLY": "1"}
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [*self.nexa, "node", "--config", str(self.config)],
                stdout=out,
                stderr=out,
                env=env,
                start_new_session=True,
            )

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """Kill the agent and its sim runtimes (its process group), as a crashed machine would."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, sig)
            self.proc.wait(timeout=30)

    async def restart_until_renewed(self, timeout_s: float) -> None:
        """Kill the agent, start it again, and wait until it accepted a set (its lease renewed)."""
        lease = identity.load_fence(self.state_dir).lease_expires_at
        self.kill()
        self.start()

        async def renewed() -> bool:
            await trio.lowlevel.checkpoint()
            return identity.load_fence(self.state_dir).lease_expires_at > lease

        await wait_for(renewed, timeout_s=timeout_s)


@attrs.define
class SimCluster:
    controller: Controller
    nodes: list[SimNode]
    tenant: str
    inference_key: str
    tmp: Path
    s3: S3Store
    #: Called when the cluster stops (clients a test opened).
    on_close: list[Callable[[], object]] = attrs.Factory(list)

    async def model(self, name: str, alias: str, version: str = "v1") -> None:
        """Register `name@version`, verify it against the S3 store, approve it and point `alias` at it."""
        async with self.client() as http:
            await bring_to(http, self.s3, name, version, "Approved")
            await ok(http.post(f"/api/v1/aliases/{alias}/promote", json={"model": name, "version": version}))

    def client(self, key: str | None = None) -> httpx.AsyncClient:
        return self.controller.client(key)

    @property
    def base_url(self) -> str:
        return self.controller.url + "/v1"

    async def cli(self, *args: str, key: str | None = None) -> subprocess.CompletedProcess[str]:
        """`python -m nexa ARGS` against the controller (the admin key unless `key`)."""
        env = {**os.environ, "NEXA_URL": self.controller.url, "NEXA_TOKEN": key or self.controller.admin_key}
        run = functools.partial(
            subprocess.run,
            [sys.executable, "-m", "nexa", *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        return await trio.to_thread.run_sync(run)

    async def node_views(self) -> dict[str, Json]:
        """node id → its `GET /api/v1/nodes` view."""
        async with self.client() as http:
            return {n["id"]: n for n in (await ok(http.get("/api/v1/nodes")))["nodes"]}

    async def ready_replicas(self, deployment: str) -> dict[str, str]:
        """replica id → node id of the deployment's replicas their node reports Ready."""
        async with self.client() as http:
            dep = await ok(http.get(f"/api/v1/deployments/{deployment}"))
            nodes = {n["id"]: n for n in (await ok(http.get("/api/v1/nodes")))["nodes"]}
        out = {}
        for r in dep["deployment"]["placed"]:
            node = nodes[r["node_id"]]
            states = {s["assignment_id"]: s["state"] for s in node["assignments"]}
            if node["state"] == "Ready" and states.get(r["id"]) == "Ready":
                out[r["id"]] = r["node_id"]
        return out

    async def wait_ready(self, deployment: str, count: int) -> dict[str, str]:
        with trio.fail_after(TIMEOUT_S):
            while len(ready := await self.ready_replicas(deployment)) < count:  # noqa: ASYNC110 - polling the API
                await trio.sleep(0.1)
        return ready

    async def deploy(
        self,
        name: str,
        *,
        replicas: int,
        alias: str = "chat",
        args: list[str] | None = None,
        wait: bool = True,
        port: int | None = None,
        env: dict[str, str] | None = None,
    ) -> None:
        """Deploy `replicas` sim runtimes of `alias` on `port` (None: one free on every node's address,
        `free_runtime_port`), with `env` in their environment; `wait`: until every replica is Ready."""
        if port is None:
            port = free_runtime_port([node_host(i) for i in range(1, len(self.nodes) + 1)])
        body = {
            "name": name,
            "runtime": "sim",
            "alias": alias,
            "replicas": replicas,
            "resources": {"accelerators": 0, "memory_bytes": 64 * 2**20, "cpus": 0.5},
            "options": {"port": port, "command": args if args is not None else SIM_ARGS, "env": env or {}},
        }
        async with self.client() as http:
            await ok(http.post("/api/v1/deployments", json=body), 201)
        if wait:
            await self.wait_ready(name, replicas)


async def chat_until(cluster: SimCluster, answers: list[int], stop: trio.Event) -> None:
    """Chat completions one after another, each status appended to `answers`, until `stop` is set.

    It stops between requests: a request cancelled mid-send leaves httpx's body iterator to the
    garbage collector, whose ResourceWarning fails whichever test runs then."""
    async with cluster.client(cluster.inference_key) as http:
        while not stop.is_set():
            resp = await http.post("/v1/chat/completions", json={"model": "chat", "messages": MESSAGES})
            answers.append(resp.status_code)


async def wait_until(what: str, check: Callable[[], Awaitable[Any]], *, timeout_s: float = TIMEOUT_S) -> Any:
    """Poll `check` until it answers something true, and return that; fail naming `what` after `timeout_s`."""
    with trio.move_on_after(timeout_s):
        while not (got := await check()):  # noqa: ASYNC110 - polling the API
            await trio.sleep(0.1)
        return got
    raise AssertionError(f"timed out waiting for {what}")


def node_host(i: int) -> str:
    """The loopback address sim node `i` dials from and runs its runtimes on: 127.0.0.1i, in a /24 of
    its own per pytest-xdist worker (`loopback_net`)."""
    return f"{loopback_net()}.1{i}"


def free_runtime_port(hosts: list[str]) -> int:
    """A port free on each of `hosts` (sim nodes' addresses) for a deployment's runtimes. A fixed
    port is not enough on a shared machine: a sim runtime of another run on the same address and
    port (`nexa demo`'s nodes run on 127.0.0.11 to .14:18600 whatever the xdist worker, and a run
    killed midway leaves them behind) answers the node's health probe for the replica, whose own
    runtime cannot bind and exits, again and again: the replica flaps between Ready and restarting."""
    for port in random.sample(_RUNTIME_PORTS, len(_RUNTIME_PORTS)):
        with contextlib.ExitStack() as held:
            try:
                for host in hosts:
                    held.enter_context(socket.socket()).bind((host, port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no port free on {', '.join(hosts)} in {_RUNTIME_PORTS}")


def sim_node_config(
    node_dir: Path, i: int, s3: S3Store, creds: Path, *, gb10: bool = False, controllers: tuple[str, ...] = ()
) -> Path:
    """The config of sim node `i`; `gb10`: its GPU inventory comes from a fake nvidia-smi (a DGX Spark);
    `controllers`: the channel endpoints it dials (node.toml `controllers`; empty: the enrolled one)."""
    inventory = node_dir.parent / f"{node_dir.name}-inventory.json"
    inventory.write_text(json.dumps({"labels": {"board": "sim"}, "runtimes": ["sim"]}))
    config = node_dir.parent / f"{node_dir.name}.toml"
    host = node_host(i)
    smi = ""
    if gb10:  # its own copy: rewriting a script another node is executing would fail (ETXTBSY)
        (bin_dir := node_dir.parent / f"{node_dir.name}-bin").mkdir(exist_ok=True)
        smi = f'nvidia_smi = "{fake_gb10_smi(bin_dir)}"\n'
    dials = f"controllers = {json.dumps(list(controllers))}\n" if controllers else ""
    config.write_text(
        f'state_dir = "{node_dir}"\ninventory_path = "{inventory}"\ninventory_poll_interval_s = 0.5\n'
        f'heartbeat_interval_s = 0.3\nsource_address = "{host}"\nruntime_host = "{host}"\n'
        f"reconnect_max_s = 1\nsimulation = true\nruntime_metrics_interval_s = 0.5\n{smi}{dials}"
        f'[artifacts]\ns3_endpoint = "{s3.endpoint}"\ns3_region = "{s3.region}"\n'
        f's3_credentials_file = "{creds}"\ns3_tls_verify = false\n'
        "[supervisor]\nreconcile_interval_s = 1\n"
    )
    return config


def _run(*argv: str, nexa: tuple[str, ...] = (sys.executable, "-m", "nexa")) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*nexa, *argv], capture_output=True, text=True, timeout=60, check=False)


@contextlib.asynccontextmanager
async def sim_cluster(
    nursery: trio.Nursery,
    tmp_path: Path,
    cfg: ControlConfig,
    s3: S3Store,
    images: BuiltImages,
    *,
    nodes: int = 2,
    nexa: tuple[str, ...] = (sys.executable, "-m", "nexa"),
    gb10: bool = False,
) -> AsyncIterator[SimCluster]:
    """Yield a cluster with `nodes` sim nodes Ready and the `chat` alias on an Approved model
    (`gb10`: each node's GPU inventory is a DGX Spark's, from a fake nvidia-smi)."""
    controller = await start_controller(nursery, cfg)
    try:
        async with sim_fleet(controller, tmp_path, s3, images, nodes=nodes, nexa=nexa, gb10=gb10) as cluster:
            yield cluster
    finally:
        controller.stopping.set()


@contextlib.asynccontextmanager
async def sim_fleet(
    controller: Controller,
    tmp_path: Path,
    s3: S3Store,
    images: BuiltImages,
    *,
    nodes: int = 2,
    nexa: tuple[str, ...] = (sys.executable, "-m", "nexa"),
    gb10: bool = False,
    controllers: tuple[str, ...] = (),
) -> AsyncIterator[SimCluster]:
    """`sim_cluster` on a controller already started (in this run or as a `nexa control` process):
    tenant, keys, runtime, model and alias, then `nodes` sim nodes enrolled and Ready; stopped after.
    `controllers`: every channel endpoint each node dials (gateway workers); empty: the enrolled one."""
    sim_nodes: list[SimNode] = []
    try:
        async with controller.client() as http:
            await ok(http.post("/api/v1/tenants", json={"id": "acme"}), 201)
            # Granted every priority class (realtime envelopes ask for interactive).
            key = {"role": "inference", "tenant": "acme", "priorities": ["interactive", "standard", "batch"]}
            created = await ok(http.post("/api/v1/keys", json=key), 201)
            await ok(
                http.post(
                    "/api/v1/runtimes", json={"name": "sim", "kind": "sim", "version": "1", "image": images.busybox}
                ),
                201,
            )
            await bring_to(http, s3, "tiny", "v1", "Approved")
            await ok(http.post("/api/v1/aliases/chat/promote", json={"model": "tiny", "version": "v1"}))
        creds = write_credentials(tmp_path / "node-s3.json", s3)
        for i in range(1, nodes + 1):
            name = f"sim-{i}"
            node_dir = tmp_path / name
            node = SimNode(
                name=name,
                state_dir=node_dir,
                config=sim_node_config(node_dir, i, s3, creds, gb10=gb10, controllers=controllers),
                nexa=nexa,
            )
            async with controller.client() as http:
                token = await ok(http.post("/api/v1/enrollment-tokens", json={"ttl_s": 600}), 201)
            argv = ["node", "enroll", "--controller", controller.url, "--token", token["token"], "--name", name]
            enroll = functools.partial(_run, *argv, "--state-dir", str(node_dir), nexa=nexa)
            enrolled = await trio.to_thread.run_sync(enroll)
            assert enrolled.returncode == 0, enrolled.stderr
            node.node_id = name
            node.start()
            sim_nodes.append(node)
        cluster = SimCluster(
            controller=controller, nodes=sim_nodes, tenant="acme", inference_key=created["key"], tmp=tmp_path, s3=s3
        )

        async def all_ready() -> bool:
            async with controller.client() as http:
                listed = (await ok(http.get("/api/v1/nodes")))["nodes"]
            # A node is Joining until its inventory arrives: no poll ever sees it Ready without one.
            assert all(n["inventory"] is not None for n in listed if n["state"] == "Ready"), listed
            return len(listed) == nodes and all(n["state"] == "Ready" for n in listed)

        with trio.fail_after(TIMEOUT_S):
            while not await all_ready():  # noqa: ASYNC110 - polling the API
                await trio.sleep(0.1)
        try:
            yield cluster
        finally:
            for close in cluster.on_close:
                close()
    finally:
        for node in sim_nodes:
            node.kill(signal.SIGTERM)


@contextlib.asynccontextmanager
async def gateway_cluster(
    nursery: trio.Nursery, tmp_path: Path, s3: S3Store, images: BuiltImages, **gateway: Any
) -> AsyncIterator[SimCluster]:
    """A `sim_cluster` on the registry controller, its gateway configured with `gateway`."""
    cfg = registry_config(tmp_path, s3)
    cfg = attrs.evolve(cfg, gateway=attrs.evolve(GatewayConfig(), **gateway))
    async with sim_cluster(nursery, tmp_path, cfg, s3, images) as cluster:
        yield cluster


async def new_key(
    cluster: SimCluster, role: str, tenant: str | None = None, *, priorities: list[str] | None = None
) -> str:
    """A new key; `priorities`: the classes it is granted (None: the default, standard and batch)."""
    body: Json = {"role": role, "tenant": tenant} | ({} if priorities is None else {"priorities": priorities})
    async with cluster.client() as http:
        if tenant is not None and tenant != cluster.tenant:
            await ok(http.post("/api/v1/tenants", json={"id": tenant}), 201)
        created = await ok(http.post("/api/v1/keys", json=body), 201)
    key: str = created["key"]
    return key


def sdk(cluster: SimCluster, key: str | None = None) -> openai.OpenAI:
    """The official SDK's synchronous client (run in worker threads: its async streams leave an
    async generator unclosed after `[DONE]`, which trio reports as a ResourceWarning). Closed
    with the cluster."""
    client = openai.OpenAI(base_url=cluster.base_url, api_key=key or cluster.inference_key, max_retries=0, timeout=30)
    cluster.on_close.append(client.close)
    return client


async def usage_rows(cluster: SimCluster, **params: str) -> list[Json]:
    async with cluster.client() as http:
        rows: list[Json] = (await ok(http.get("/api/v1/usage", params=params)))["rows"]
    return rows
