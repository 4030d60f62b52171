"""The sim's cluster: what `nexa demo` starts, with the controller as its own `nexa control` process
(so a step can stop and restart it), set up through the public interfaces only.

An OCI registry and an S3 store on loopback (`nexa.localparts`, as the demo starts them), a
controller config file written here and `nexa control --config` run on it (its first admin key
made with `nexa keygen --out`), then, through the HTTP API, the demo's tenant, inference key,
runtime, verified model and alias, four `nexa node` agents dialling from 127.0.0.11 to .14 and a
two-replica `chat` deployment of `sim` runtimes. `stop` ends everything it started, by PID.
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import time
from pathlib import Path
from typing import Any, Final

import attrs
import trio

from nexa.demo import (
    Node,
    Plan,
    empty_dir,
    enroll_node,
    register_model,
    sim_plan,
    start_agent,
    stop_all,
    stop_nodes,
    upload_model,
)
from nexa.errors import Unavailable
from nexa.localparts import LocalRegistry, LocalS3, free_ports, stop
from nexa.node.processes import default_argv
from nexa.s3.credentials import write_s3_credentials
from nexa.sigv4 import S3Credentials
from nexa.sim.load import Answers, Api, Gateway

log = logging.getLogger(__name__)

NODES: Final = 4
REPLICAS: Final = 2
#: Fast answers: 20 ms to the first token, 200 tokens/s, up to 64 tokens (a request asks for fewer).
SIM_ARGS: Final = ["--ttft-ms", "20", "--tokens-per-s", "200", "--output-tokens", "64"]
#: The gateway's limits in the sim: small, so that a burst queues and sheds.
QUEUE_DEPTH: Final = 16
INFLIGHT_PER_REPLICA: Final = 4
START_TIMEOUT_S: Final = 60.0
CONTROL_STOP_S: Final = 20.0
STOP_PARTS_TIMEOUT_S: Final = 120.0


@attrs.define
class Cluster:
    """The running parts and how to reach them."""

    root: Path
    registry: LocalRegistry
    store: LocalS3
    creds: Path
    plan: Plan
    control_config: Path
    admin_key: str = ""
    url: str = ""
    inference_key: str = ""
    control: subprocess.Popen[bytes] | None = None
    control_starts: int = 0
    nodes: list[Node] = attrs.Factory(list)
    #: Agents the steps started besides the four (the impostor's node), stopped with the rest.
    extra: list[Node] = attrs.Factory(list)
    answers: Answers = attrs.Factory(Answers)
    api: Api | None = None
    gateway: Gateway | None = None

    @property
    def control_dir(self) -> Path:
        return self.root / "control"

    def the_api(self) -> Api:
        assert self.api is not None, "the cluster is not started"
        return self.api

    def the_gateway(self) -> Gateway:
        assert self.gateway is not None, "the cluster is not started"
        return self.gateway

    async def start_control(self) -> None:
        """Start `nexa control` on the sim's config and wait until it answers `/readyz`."""
        self.control_starts += 1
        out = self.root / f"control-{self.control_starts}.log"
        env = {**os.environ, "NEXA_LOG_LEVEL": "info"}
        argv = [*default_argv(), "control", "--config", str(self.control_config)]
        self.control = await trio.to_thread.run_sync(_popen, argv, out, env)
        api = self.the_api()
        with trio.move_on_after(START_TIMEOUT_S):
            while await api.status("/readyz") != 200:
                if self.control.poll() is not None:
                    raise Unavailable(f"nexa control exited with {self.control.returncode}: see {out}")
                await trio.sleep(0.1)
            return
        raise Unavailable(f"nexa control did not become ready in {START_TIMEOUT_S:g} s: see {out}")

    async def stop_control(self) -> int:
        """SIGTERM the controller and wait for it (SIGKILL after CONTROL_STOP_S); its exit status."""
        proc = self.control
        assert proc is not None
        await trio.to_thread.run_sync(lambda: stop(proc, grace_s=CONTROL_STOP_S))
        self.control = None
        return proc.returncode

    def restart_agent(self, node: Node) -> None:
        """Start the agent of `node` again (after a step killed it), logging to a new file."""
        log_path = node.config.with_name(f"{node.config.stem}-{time.monotonic_ns()}.log")
        node.proc = start_agent(node.config, log_path, simulation=True)

    async def wait_nodes_ready(self, count: int = NODES) -> None:
        api = self.the_api()
        with trio.fail_after(START_TIMEOUT_S):
            while sum(n["state"] == "Ready" for n in (await api.get("/api/v1/nodes"))["nodes"]) < count:  # noqa: ASYNC110
                await trio.sleep(0.2)

    async def ready_replicas(self, deployment: str = "chat") -> dict[str, str]:
        """replica id → node id of the deployment's replicas whose node reports them Ready."""
        api = self.the_api()
        dep = await api.get(f"/api/v1/deployments/{deployment}")
        nodes = {n["id"]: n for n in (await api.get("/api/v1/nodes"))["nodes"]}
        ready = {}
        for replica in dep["deployment"]["placed"]:
            node = nodes.get(replica["node_id"])
            if node is None or node["state"] != "Ready":
                continue
            states = {s["assignment_id"]: s["state"] for s in node["assignments"]}
            if states.get(replica["id"]) == "Ready":
                ready[replica["id"]] = replica["node_id"]
        return ready

    async def wait_replicas(self, count: int = REPLICAS, *, avoid: str | None = None) -> dict[str, str]:
        """Wait until `count` replicas are Ready (none of them on node `avoid`)."""
        with trio.fail_after(START_TIMEOUT_S):
            while True:
                ready = await self.ready_replicas()
                if len(ready) >= count and avoid not in ready.values():
                    return ready
                await trio.sleep(0.2)

    def node(self, node_id: str) -> Node:
        return next(n for n in self.nodes if n.name == node_id)


def _popen(argv: list[str], out: Path, env: dict[str, str]) -> subprocess.Popen[bytes]:
    with out.open("wb") as log_file:
        return subprocess.Popen(argv, stdout=log_file, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)


def _check_keygen(done: subprocess.CompletedProcess[bytes]) -> None:
    if done.returncode != 0:
        raise Unavailable(f"nexa keygen failed: {done.stderr.decode(errors='replace').strip()}")


def _control_toml(root: Path, store: LocalS3, creds: Path, key_file: Path) -> str:
    http, channel, rotation = free_ports(3)
    return (
        f'state_dir = "{root / "control"}"\n'
        f'[http]\nlisten = "127.0.0.1:{http}"\n'
        f'[channel]\nlisten = "tcp://127.0.0.1:{channel}"\nrotation_listen = "tcp://127.0.0.1:{rotation}"\n'
        # Replicas of an unreachable node are placed again after 3 s, not the production 30 s.
        "[nodes]\nreplace_after_s = 3.0\n"
        # The sim's registry is plain HTTP on loopback.
        "[oci]\ntls_verify = false\n"
        f'[artifacts]\ns3_endpoint = "{store.endpoint}"\ns3_credentials_file = "{creds}"\ns3_tls_verify = false\n'
        f"[gateway]\nqueue_depth = {QUEUE_DEPTH}\nmax_inflight_per_replica = {INFLIGHT_PER_REPLICA}\n"
        "queue_tenant_share = 1.0\n"
        f'[bootstrap]\nadmin_key_file = "{key_file}"\n'
    )


async def start(root: Path) -> Cluster:
    """Everything started, in a fresh `root`; on failure what was started is stopped again."""
    root = await trio.to_thread.run_sync(root.absolute)
    await trio.to_thread.run_sync(empty_dir, root)
    store = LocalS3(
        root / "s3",
        bucket="nexa-sim",
        credentials=S3Credentials(access_key_id="nexa-sim", secret_access_key=secrets.token_urlsafe(24)),
    )
    registry = LocalRegistry(root / "registry")
    cluster: Cluster | None = None
    try:
        await trio.to_thread.run_sync(registry.start)
        await trio.to_thread.run_sync(store.start)
        plan = await trio.to_thread.run_sync(sim_plan, registry)
        artifact_uri = await upload_model(store, plan)
        creds = write_s3_credentials(root / "s3-credentials.json", store.credentials)
        key_file = root / "admin.key"
        keygen = await trio.to_thread.run_sync(
            lambda: subprocess.run(
                [*default_argv(), "keygen", "--out", str(key_file)], capture_output=True, check=False, timeout=60
            )
        )
        _check_keygen(keygen)
        config = root / "control.toml"
        config.write_text(_control_toml(root, store, creds, key_file))
        cluster = Cluster(root=root, registry=registry, store=store, creds=creds, plan=plan, control_config=config)
        cluster.admin_key = key_file.read_text().strip()
        listen = config.read_text().split('listen = "', 1)[1].split('"', 1)[0]
        cluster.url = f"http://{listen}"
        cluster.api = Api(cluster.url, cluster.admin_key)
        await cluster.start_control()
        cluster.inference_key = await register_model(cluster.api.http, plan, artifact_uri)
        cluster.gateway = Gateway(cluster.url, cluster.inference_key, cluster.answers)
        for i in range(1, NODES + 1):
            cluster.nodes.append(await enroll_node(cluster.api.http, root, i, store, creds, plan=plan, prefix="sim"))
        await cluster.wait_nodes_ready()
        deployment: dict[str, Any] = {
            "name": "chat",
            "alias": "chat",
            "replicas": REPLICAS,
            **plan.deployment,
            "options": {**plan.deployment["options"], "command": SIM_ARGS},
        }
        await cluster.api.post("/api/v1/deployments", deployment)
        await cluster.wait_replicas()
    except BaseException:
        with trio.CancelScope(shield=True):
            if cluster is not None:
                await stop_cluster(cluster)
            else:
                await trio.to_thread.run_sync(stop_all, [store.stop, registry.stop])
        raise
    return cluster


async def stop_cluster(cluster: Cluster) -> None:
    """Stop every part it started, by PID, even when one of them fails to stop; shielded."""
    with trio.move_on_after(STOP_PARTS_TIMEOUT_S, shield=True) as scope:
        for client in (cluster.gateway, cluster.api):
            if client is not None:
                await client.aclose()
        control = cluster.control
        parts = [
            lambda: stop_nodes([*cluster.nodes, *cluster.extra]),
            *([lambda: stop(control, grace_s=CONTROL_STOP_S)] if control is not None else []),
            cluster.store.stop,
            cluster.registry.stop,
        ]
        await trio.to_thread.run_sync(stop_all, parts)
    if scope.cancel_called:
        log.warning("stopping the sim's parts took over %g s", STOP_PARTS_TIMEOUT_S)
