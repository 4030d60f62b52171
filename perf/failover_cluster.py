"""The parts and the scenario of perf/failover.py, which tests/e2e/test_failover.py runs too (smaller).

`start`: PostgreSQL (`nexa.localparts.LocalPostgres`, one database), the OCI registry and the S3
store `nexa demo` starts, three `nexa control --config` processes on the one database (`[cluster]`
lease_s/renew_s given; the first one's keys directory copied to the others before they first start),
nginx in front of their HTTP ports (`perf.upstream.Ingress`), four `nexa node` agents from
127.0.0.11 to .14 with a channel to every controller (node.toml `controllers`, through
`nexa.demo.enroll_node`), and, through the ingress only, the demo's tenant, inference key, `sim`
runtime and model with a `chat` deployment of one `sim` replica per node (and, for the gateway
figure, `fast`: nginx's fixed answer standing in for the runtime on each node's address).

`run_failover`: clients (the openai SDK) ask `chat` back to back through the ingress and a writer
creates tenants through it, recording each one acknowledged; the leader is SIGKILLed and the next
one awaited on every controller's /readyz. `check_after`: the acknowledged writes on every other
controller, the nodes' acknowledged epoch, `nexa audit verify` (the CLI) through the ingress, and
the old leader restarted. `stop_cluster` stops every part, by PID.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections import Counter
from pathlib import Path
from typing import Any, Final

import attrs
import httpx
import openai
import trio

from nexa.demo import (
    Node,
    Plan,
    add_model,
    empty_dir,
    enroll_node,
    register_model,
    sim_plan,
    stop_all,
    stop_nodes,
    upload_model,
    wait_nodes,
)
from nexa.errors import Unavailable
from nexa.localparts import LocalPostgres, LocalRegistry, LocalS3, free_ports, stop
from nexa.node.processes import default_argv
from nexa.s3.credentials import write_s3_credentials
from nexa.sigv4 import S3Credentials
from perf.upstream import Ingress, Nginx, unary_body

Json = dict[str, Any]
CONTROLLERS: Final = 3
NODES: Final = 4
#: The nodes' loopback addresses (`nexa.demo.enroll_node` gives node i 127.0.0.1i).
NODE_HOSTS: Final = tuple(f"127.0.0.1{i}" for i in range(1, NODES + 1))
#: The failover's sim runtimes: 20 ms to the first token, then 16 tokens at 400 tokens/s (~60 ms an answer).
SIM_ARGS: Final = ["--ttft-ms", "20", "--tokens-per-s", "400", "--output-tokens", "16"]
START_TIMEOUT_S: Final = 60.0
CONTROL_STOP_S: Final = 20.0
#: How often a controller's /readyz is asked while a new leader is awaited.
POLL_S: Final = 0.02
#: The writer's pause between two writes.
WRITE_GAP_S: Final = 0.02
#: Until every acknowledged write shows on a controller (followers refresh every `[cluster] refresh_s`).
SETTLE_TIMEOUT_S: Final = 20.0
PROMPT: Final = "say something short about the weather"
#: The statuses nginx answers itself when the controller it had sent the request to failed.
NGINX_SENT_STATUSES: Final = (502, 504)


@attrs.define(eq=False)
class ControlProcess:
    """One `nexa control --config` of the cluster: its ports, its files under `root`, its process."""

    name: str
    root: Path
    http_port: int
    channel: str
    rotation: str
    proc: subprocess.Popen[bytes] | None = None
    starts: int = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def upstream(self) -> str:
        """As nginx names it (`$upstream_addr`)."""
        return f"127.0.0.1:{self.http_port}"

    @property
    def state_dir(self) -> Path:
        return self.root / self.name

    @property
    def config(self) -> Path:
        return self.root / f"{self.name}.toml"

    @property
    def log(self) -> Path:
        return self.root / f"{self.name}-{self.starts}.log"

    @property
    def pid(self) -> int:
        assert self.proc is not None, f"{self.name} is not running"
        return self.proc.pid

    def write_config(self, *, store_url: str, lease_s: float, renew_s: float, s3: LocalS3, creds: Path) -> None:
        self.config.write_text(
            f'state_dir = "{self.state_dir}"\n'
            f'[http]\nlisten = "{self.upstream}"\n'
            f'[channel]\nlisten = "{self.channel}"\nrotation_listen = "{self.rotation}"\n'
            f'[store]\nurl = "{store_url}"\n'
            f'[cluster]\nlease_s = {lease_s}\nrenew_s = {renew_s}\ncontroller_id = "{self.name}"\n'
            # The demo's registry is plain HTTP on loopback.
            "[oci]\ntls_verify = false\n"
            f'[artifacts]\ns3_endpoint = "{s3.endpoint}"\ns3_credentials_file = "{creds}"\ns3_tls_verify = false\n'
            f'[bootstrap]\nadmin_key_file = "{self.root / "admin.key"}"\n'
        )

    def start(self) -> None:
        self.starts += 1
        env = {**os.environ, "NEXA_LOG_LEVEL": "info"}
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [*default_argv(), "control", "--config", str(self.config)],
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
            )

    async def kill_and_wait(self) -> float:
        """SIGKILL (no lease released, no connection closed cleanly), then wait until the process is
        gone (its pidfd readable: its sockets are closed, a connection to its port is refused);
        `time.monotonic()` of that."""
        proc = self.proc
        if proc is None or proc.poll() is not None:
            raise Unavailable(f"{self.name} is not running")
        pidfd = os.pidfd_open(proc.pid)
        try:
            proc.send_signal(signal.SIGKILL)
            await trio.lowlevel.wait_readable(pidfd)
            gone = time.monotonic()
        finally:
            os.close(pidfd)
        await trio.to_thread.run_sync(proc.wait)
        return gone

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc, grace_s=CONTROL_STOP_S)


@attrs.define(eq=False)
class FailoverCluster:
    """The running parts; `stop_cluster` stops every one of them."""

    root: Path
    postgres: LocalPostgres
    registry: LocalRegistry
    s3: LocalS3
    controllers: list[ControlProcess]
    ingress: Ingress
    plan: Plan | None = None
    admin_key: str = ""
    inference_key: str = ""
    nodes: list[Node] = attrs.Factory(list)
    #: nginx standing in for the `fast` deployment's runtime on each node's address.
    upstream: Nginx | None = None
    #: More ingresses (the gateway figure's): stopped first.
    extra: list[Ingress] = attrs.Factory(list)

    def admin(self, url: str | None = None) -> httpx.AsyncClient:
        """An admin client of the ingress, or of one controller's `url`."""
        headers = {"Authorization": f"Bearer {self.admin_key}"}
        return httpx.AsyncClient(base_url=url or self.ingress.url, headers=headers, timeout=30, trust_env=False)

    def running(self) -> list[ControlProcess]:
        return [c for c in self.controllers if c.proc is not None and c.proc.poll() is None]


# --- the cluster ------------------------------------------------------------------------------------


def free_on_all(hosts: tuple[str, ...]) -> int:
    """A port free on every one of `hosts` right now (a deployment's port is the same on each node)."""
    for _ in range(100):
        port = free_ports(1, hosts[0])[0]
        try:
            for host in hosts[1:]:
                with socket.socket() as s:
                    s.bind((host, port))
        except OSError:
            continue
        return port
    raise Unavailable(f"no port is free on all of {', '.join(hosts)}")


def copy_keys(source: ControlProcess, target: ControlProcess) -> None:
    """The controller keys, shared: `source`'s `<state_dir>/keys` (0700, files 0600) into `target`'s."""
    from nexa.control.service import KEYS_DIR

    target.state_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    shutil.copytree(source.state_dir / KEYS_DIR, target.state_dir / KEYS_DIR)  # copy2 keeps the modes


async def readiness(http: httpx.AsyncClient, c: ControlProcess) -> Json | None:
    """`c`'s /readyz when it answers 200 (`status`, `role`, `epoch`); None while it does not."""
    try:
        r = await http.get(f"{c.url}/readyz", timeout=2)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    try:
        body: Json = r.json()
    except ValueError:
        return None  # not its answer (yet): waited on until START_TIMEOUT_S, which names its log
    return body


async def wait_ready_controller(http: httpx.AsyncClient, c: ControlProcess) -> Json:
    with trio.move_on_after(START_TIMEOUT_S):
        while True:
            if c.proc is not None and c.proc.poll() is not None:
                raise Unavailable(f"nexa control {c.name} exited with {c.proc.returncode}: see {c.log}")
            if (ready := await readiness(http, c)) is not None:
                return ready
            await trio.sleep(0.1)
    raise Unavailable(f"nexa control {c.name} was not ready within {START_TIMEOUT_S:g} s: see {c.log}")


async def wait_leader(
    cluster: FailoverCluster, *, above: int = 0, timeout_s: float = START_TIMEOUT_S
) -> tuple[ControlProcess, int]:
    """The running controller whose /readyz says leader at an epoch above `above`, and that epoch."""
    async with httpx.AsyncClient(trust_env=False) as http:
        with trio.move_on_after(timeout_s):
            while True:
                for c in cluster.running():
                    ready = await readiness(http, c)
                    if ready is not None and ready["role"] == "leader" and ready["epoch"] > above:
                        return c, int(ready["epoch"])
                await trio.sleep(POLL_S)
    raise Unavailable(f"no controller led at an epoch above {above} within {timeout_s:g} s")


async def start(root: Path, *, lease_s: float = 2.0, renew_s: float = 0.5, fast_tokens: int = 0) -> FailoverCluster:
    """Every part started in a fresh `root`, `chat` deployed and Ready; with `fast_tokens`, also the
    `fast` deployment (nginx's fixed answer of that many tokens). On failure what started is stopped."""
    root = await trio.to_thread.run_sync(root.absolute)
    await trio.to_thread.run_sync(empty_dir, root)
    ports = free_ports(3 * CONTROLLERS + 1)
    controllers = [
        ControlProcess(
            name=f"c{i + 1}",
            root=root,
            http_port=ports[3 * i],
            channel=f"tcp://127.0.0.1:{ports[3 * i + 1]}",
            rotation=f"tcp://127.0.0.1:{ports[3 * i + 2]}",
        )
        for i in range(CONTROLLERS)
    ]
    cluster = FailoverCluster(
        root=root,
        postgres=LocalPostgres(),
        registry=LocalRegistry(root / "registry"),
        s3=LocalS3(
            root / "s3",
            bucket="nexa-failover",
            credentials=S3Credentials(access_key_id="nexa-failover", secret_access_key=os.urandom(16).hex()),
        ),
        controllers=controllers,
        ingress=Ingress(root / "ingress", "127.0.0.1", ports[-1], [c.upstream for c in controllers]),
    )
    try:
        await _start_parts(cluster, lease_s=lease_s, renew_s=renew_s)
        await _deploy(cluster, fast_tokens)
    except BaseException:
        with trio.CancelScope(shield=True):
            await stop_cluster(cluster)
        raise
    return cluster


async def _start_parts(cluster: FailoverCluster, *, lease_s: float, renew_s: float) -> None:
    root, first = cluster.root, cluster.controllers[0]
    await trio.to_thread.run_sync(cluster.postgres.start)
    store_url = await trio.to_thread.run_sync(cluster.postgres.createdb, "nexa")
    await trio.to_thread.run_sync(cluster.registry.start)
    await trio.to_thread.run_sync(cluster.s3.start)
    creds = write_s3_credentials(root / "s3-credentials.json", cluster.s3.credentials)
    keygen = await trio.to_thread.run_sync(
        lambda: subprocess.run(
            [*default_argv(), "keygen", "--out", str(root / "admin.key")], capture_output=True, check=False, timeout=60
        )
    )
    if keygen.returncode != 0:
        raise Unavailable(f"nexa keygen failed: {keygen.stderr.decode(errors='replace').strip()}")
    cluster.admin_key = (root / "admin.key").read_text().strip()
    for c in cluster.controllers:
        c.write_config(store_url=store_url, lease_s=lease_s, renew_s=renew_s, s3=cluster.s3, creds=creds)
    async with httpx.AsyncClient(trust_env=False) as http:
        # The first makes the schema, the keys and the admin key; the others get its keys first.
        first.start()
        await wait_ready_controller(http, first)
        for c in cluster.controllers[1:]:
            await trio.to_thread.run_sync(copy_keys, first, c)
            c.start()
        for c in cluster.controllers[1:]:
            await wait_ready_controller(http, c)
    await trio.to_thread.run_sync(cluster.ingress.start)


async def _deploy(cluster: FailoverCluster, fast_tokens: int) -> None:
    """Through the ingress: the demo's tenant, key, runtime and model; the nodes; `chat` (and `fast`)."""
    plan = cluster.plan = await trio.to_thread.run_sync(sim_plan, cluster.registry)
    artifact_uri = await upload_model(cluster.s3, plan)
    creds = cluster.root / "s3-credentials.json"
    endpoints = tuple(c.channel for c in cluster.controllers)
    async with cluster.admin() as http:
        cluster.inference_key = await register_model(http, plan, artifact_uri)
        for i in range(1, NODES + 1):
            node = await enroll_node(
                http, cluster.root, i, cluster.s3, creds, plan=plan, prefix="fo", controllers=endpoints
            )
            cluster.nodes.append(node)
        await wait_nodes(http, NODES)
        options = {**plan.deployment["options"], "port": free_on_all(NODE_HOSTS), "command": SIM_ARGS}
        chat = {"name": "chat", "alias": "chat", "replicas": NODES, **plan.deployment, "options": options}
        await _post(http, "/api/v1/deployments", chat)
        if fast_tokens:
            await add_model(http, plan, artifact_uri, name="fast-chat", alias="fast")
            port = free_on_all(NODE_HOSTS)
            upstream = cluster.upstream = Nginx(cluster.root / "upstream")
            for host in NODE_HOSTS:
                upstream.serve(host, port, unary_body("fast", fast_tokens), "application/json")
            await trio.to_thread.run_sync(upstream.start)
            # The sim runtime is a stand-in the agent supervises: `--port` (the later flag wins) moves
            # it aside, so the agent's probe and every relayed request reach nginx on the node's port.
            stand_in = ["--port", str(free_on_all(NODE_HOSTS))]
            fast = {"name": "fast", "alias": "fast", "replicas": NODES, **plan.deployment}
            fast["options"] = {**plan.deployment["options"], "port": port, "command": stand_in}
            await _post(http, "/api/v1/deployments", fast)
        for name in ("chat", "fast") if fast_tokens else ("chat",):
            await _wait_deployed(http, name, plan.ready_timeout_s)


async def _wait_deployed(http: httpx.AsyncClient, name: str, timeout_s: float) -> None:
    """Until deployment `name` has a Ready replica on every node. Through the ingress a read may
    reach a controller that has not yet refreshed from the write it follows (within `[cluster]
    refresh_s`): a 404 is "not yet"."""
    with trio.fail_after(timeout_s):
        while True:
            r = await http.get(f"/api/v1/deployments/{name}")
            if r.status_code == 200 and r.json()["ready"] >= NODES:
                return
            if r.status_code not in (200, 404):
                raise Unavailable(f"GET /api/v1/deployments/{name}: {r.status_code} {r.text[:300]}")
            await trio.sleep(0.2)


async def _post(http: httpx.AsyncClient, path: str, body: Json) -> Json:
    r = await http.post(path, json=body)
    if not r.is_success:
        raise Unavailable(f"POST {path}: {r.status_code} {r.text[:500]}")
    answer: Json = r.json()
    return answer


async def stop_cluster(cluster: FailoverCluster) -> None:
    """Stop every part it started, by PID, even when one fails to stop; shielded."""
    with trio.CancelScope(shield=True):
        parts = [
            *(x.stop for x in cluster.extra),
            cluster.ingress.stop,
            *([cluster.upstream.stop] if cluster.upstream is not None else []),
            lambda: stop_nodes(cluster.nodes),
            *(c.stop for c in cluster.controllers),
            cluster.s3.stop,
            cluster.registry.stop,
            cluster.postgres.stop,
        ]
        await trio.to_thread.run_sync(stop_all, parts)


# --- the failover -----------------------------------------------------------------------------------


@attrs.frozen
class Call:
    """One inference request through the ingress (times from `time.monotonic`)."""

    started: float
    ended: float
    ok: bool
    #: nginx's `X-Nexa-Upstream`: the controllers tried, in order ("" when no answer came).
    upstream: str
    error: str = ""


@attrs.define
class Writes:
    """The writer's tenants: acknowledged (201), unknown (no answer: nginx's 502/504, a transport
    error; it may or may not have been made), refused (by status: 503 while no controller led)."""

    acked: list[str] = attrs.Factory(list)
    unknown: list[str] = attrs.Factory(list)
    refused: Counter[int] = attrs.Factory(Counter)


@attrs.frozen
class Failover:
    killed: ControlProcess
    old_epoch: int
    leader: ControlProcess
    epoch: int
    #: The SIGKILL, and the moment the process was gone (`time.monotonic`): until then the kernel
    #: still queued connections on its port, which nginx sent requests on that then failed.
    killed_at: float
    gone_at: float
    #: The kill → the new leader's /readyz.
    took_s: float
    calls: list[Call]
    writes: Writes

    @property
    def failed(self) -> list[Call]:
        return [c for c in self.calls if not c.ok]

    @property
    def in_flight(self) -> list[Call]:
        """The failed requests that were in flight at the kill (sent before the process was gone)."""
        return [c for c in self.failed if c.started <= self.gone_at and c.ended >= self.killed_at]

    @property
    def on_killed(self) -> list[Call]:
        """Those of them nginx had sent to the killed controller."""
        return [c for c in self.in_flight if self.killed.upstream in c.upstream]

    @property
    def ok_after(self) -> int:
        return sum(1 for c in self.calls if c.ok and c.started > self.gone_at)


async def _ask(client: openai.AsyncOpenAI, model: str) -> Call:
    started = time.monotonic()
    messages: Any = [{"role": "user", "content": PROMPT}]
    try:
        raw = await client.chat.completions.with_raw_response.create(model=model, messages=messages, max_tokens=16)
        completion = raw.parse()
        ok = bool(completion.choices and completion.choices[0].message.content)
        return Call(started, time.monotonic(), ok, raw.headers.get("x-nexa-upstream", ""), "" if ok else "empty")
    except openai.APIStatusError as exc:
        upstream = exc.response.headers.get("x-nexa-upstream", "")
        return Call(started, time.monotonic(), False, upstream, f"HTTP {exc.status_code}")
    except openai.APIError as exc:
        return Call(started, time.monotonic(), False, "", type(exc).__name__)


async def inference_load(url: str, key: str, concurrency: int, done: trio.Event, calls: list[Call]) -> None:
    """`concurrency` clients asking `chat` back to back until `done`."""
    async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key=key, max_retries=0, timeout=30) as client:

        async def client_loop() -> None:
            while not done.is_set():
                calls.append(await _ask(client, "chat"))

        async with trio.open_nursery() as nursery:
            for _ in range(concurrency):
                nursery.start_soon(client_loop)


async def write_load(cluster: FailoverCluster, done: trio.Event, writes: Writes, prefix: str) -> None:
    """Tenants `{prefix}-1`, `-2`, … created one after another through the ingress until `done`."""
    async with cluster.admin() as http:
        i = 0
        while not done.is_set():
            i += 1
            tenant = f"{prefix}-{i}"
            try:
                r = await http.post("/api/v1/tenants", json={"id": tenant})
            except httpx.HTTPError:
                writes.unknown.append(tenant)
                continue
            if r.status_code == 201:
                writes.acked.append(tenant)
            elif r.status_code in NGINX_SENT_STATUSES:
                writes.unknown.append(tenant)
            else:
                writes.refused[r.status_code] += 1
            await trio.sleep(WRITE_GAP_S)


async def run_failover(
    cluster: FailoverCluster, *, concurrency: int, warmup_s: float, after_s: float, prefix: str = "fo"
) -> Failover:
    """Load through the ingress, SIGKILL the leader after `warmup_s`, the new leader awaited, `after_s`
    more of load."""
    killed, old_epoch = await wait_leader(cluster)
    calls: list[Call] = []
    writes = Writes()
    done = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(inference_load, cluster.ingress.url, cluster.inference_key, concurrency, done, calls)
        nursery.start_soon(write_load, cluster, done, writes, prefix)
        await trio.sleep(warmup_s)
        killed_at = time.monotonic()
        gone_at = await killed.kill_and_wait()
        try:
            leader, epoch = await wait_leader(cluster, above=old_epoch)
            took_s = time.monotonic() - killed_at
            await trio.sleep(after_s)
        finally:
            done.set()
    return Failover(killed, old_epoch, leader, epoch, killed_at, gone_at, took_s, calls, writes)


@attrs.frozen
class After:
    """What holds once the load stopped."""

    #: Controller → the acknowledged writes it does not show (SETTLE_TIMEOUT_S after the load).
    missing: dict[str, list[str]]
    #: Of the writes without an answer, those made all the same.
    unknown_made: int
    #: Node → (its acknowledged epoch before the kill, after), as the new leader lists them.
    node_epochs: dict[str, tuple[int, int]]
    audit_rc: int
    audit_out: str
    #: The old leader restarted: its /readyz role and the seconds from its start to it.
    rejoined_role: str
    rejoin_s: float
    #: Then, asked directly: the seconds until it answered a completion, and the answers before
    #: that (503 `no_ready_replica` while the nodes' channels to it reconnect and report).
    serving_s: float
    refused_while_ready: int


async def tenants_on(http: httpx.AsyncClient, url: str) -> set[str]:
    """Every tenant id one controller lists (all pages)."""
    found: set[str] = set()
    cursor: str | None = None
    while True:
        params = {"limit": "1000", **({"cursor": cursor} if cursor else {})}
        r = await http.get(f"{url}/api/v1/tenants", params=params)
        if r.status_code != 200:
            raise Unavailable(f"GET {url}/api/v1/tenants: {r.status_code} {r.text[:300]}")
        page = r.json()
        found |= {t["id"] for t in page["tenants"]}
        if not (cursor := page.get("next_cursor")):
            return found


async def node_epochs(http: httpx.AsyncClient, url: str) -> dict[str, int]:
    r = await http.get(f"{url}/api/v1/nodes")
    if r.status_code != 200:
        raise Unavailable(f"GET {url}/api/v1/nodes: {r.status_code}")
    return {n["id"]: int(n["acked_epoch"]) for n in r.json()["nodes"]}


async def check_after(cluster: FailoverCluster, failover: Failover, epochs_before: dict[str, int]) -> After:
    """Acknowledged writes on every other controller, the nodes' epoch, the audit chain through the
    ingress, and the old leader restarted."""
    others = [c for c in cluster.running() if c is not failover.killed]
    missing: dict[str, list[str]] = {}
    found: set[str] = set()
    async with cluster.admin() as http:
        for c in others:
            with trio.move_on_after(SETTLE_TIMEOUT_S):
                while True:
                    found = await tenants_on(http, c.url)
                    if all(t in found for t in failover.writes.acked):
                        break
                    await trio.sleep(0.2)
            missing[c.name] = [t for t in failover.writes.acked if t not in found]
        unknown_made = sum(1 for t in failover.writes.unknown if t in found)
        epochs: dict[str, int] = {}
        with trio.move_on_after(SETTLE_TIMEOUT_S):
            while True:
                epochs = await node_epochs(http, failover.leader.url)
                if len(epochs) == NODES and all(e >= failover.epoch for e in epochs.values()):
                    break
                await trio.sleep(0.2)
        audit = await trio.to_thread.run_sync(_audit_verify, cluster)
        started = time.monotonic()
        failover.killed.start()
        ready = await wait_ready_controller(http, failover.killed)
        rejoin_s = time.monotonic() - started
        refused = await _wait_serving(cluster, failover.killed)
    return After(
        missing=missing,
        unknown_made=unknown_made,
        node_epochs={n: (epochs_before.get(n, 0), e) for n, e in epochs.items()},
        audit_rc=audit.returncode,
        audit_out=(audit.stdout + audit.stderr).strip(),
        rejoined_role=str(ready["role"]),
        rejoin_s=rejoin_s,
        serving_s=time.monotonic() - started - rejoin_s,
        refused_while_ready=refused,
    )


async def _wait_serving(cluster: FailoverCluster, c: ControlProcess) -> int:
    """Ask `c` itself for completions until one is answered; the answers refused before it."""
    refused = 0
    async with openai.AsyncOpenAI(
        base_url=f"{c.url}/v1", api_key=cluster.inference_key, max_retries=0, timeout=30
    ) as client:
        with trio.fail_after(START_TIMEOUT_S):
            while not (await _ask(client, "chat")).ok:
                refused += 1
                await trio.sleep(POLL_S)
    return refused


def _audit_verify(cluster: FailoverCluster) -> subprocess.CompletedProcess[str]:
    """`nexa audit verify`, the CLI, against the ingress (the key in the environment, not argv)."""
    env = {**os.environ, "NEXA_URL": cluster.ingress.url, "NEXA_TOKEN": cluster.admin_key}
    argv = [*default_argv(), "audit", "verify"]
    return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False, env=env)


async def epochs_now(cluster: FailoverCluster) -> dict[str, int]:
    """The nodes' acknowledged epochs once all of them acknowledged the current leader's."""
    leader, epoch = await wait_leader(cluster)
    async with cluster.admin() as http:
        with trio.fail_after(SETTLE_TIMEOUT_S):
            while True:
                epochs = await node_epochs(http, leader.url)
                if len(epochs) == NODES and all(e >= epoch for e in epochs.values()):
                    return epochs
                await trio.sleep(0.2)
