"""One model over two nodes: a replica group of llama.cpp over RPC, real, on CPU (issue 33's first
required test).

Two enrolled `nexa node` agents (cpu-1 on 127.0.0.11, cpu-2 on .12, the run's loopback network),
given a `fabric` label and their `fabric-address` label (their own loopback address: a node whose
fabric is only the admin's label takes its address from there) through their enrollment tokens.
The runtime is llama.cpp's own C++ server image (`llama_server_image`, which also carries
`/app/ggml-rpc-server`, built with GGML_RPC on), registered with `--fabric tcp` so the group's
containers are in the nodes' network namespace. A deployment of the tiny generated GGUF with
`nodes_per_replica` 2: rank 1 (cpu-2) runs the RPC server bound to its fabric address only, rank 0
(cpu-1) `llama-server --rpc` over it, started once the worker is Ready. The official `openai`
SDK gets a chat completion through the controller. Then the worker's container is killed: the
group fails, every member is withdrawn and the group is started again together (the head's
container is a new one), and it serves again. Then the worker's agent is killed: the group is
withdrawn while its node is lost, and starts again whole when the agent is back.
"""

from __future__ import annotations

import ipaddress
import json
import socket
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import openai
import pytest
import trio

from nexa.container_spec import container_name
from nexa.contracts.deployments import Replica
from nexa.control.deployments.grouprun import GROUP_PORT_OFFSET, member_id
from tests.conftest import Controller
from tests.realparts import PodmanService, S3Store
from tests.support.api import Json, in_thread, ok
from tests.support.realmodel import MIB, Node, cli, real_cluster, register_model, runtime_logs, wait_for

pytestmark = pytest.mark.slow
RUNTIME = "llama-server"
PORT = 18900


@pytest.fixture
async def group_cluster(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, podman_service: PodmanService
) -> AsyncIterator[tuple[Controller, list[Node]]]:
    def labels(node: Node) -> str:
        return f"fabric=loopback,fabric-address={node.host}"

    async with real_cluster(nursery, tmp_path, s3_store, podman_service, labels=labels, firewalled=("cpu-2",)) as c:
        yield c


def nft_rules(table: str) -> list[str]:
    """The rules of an agent's nftables table, as `nft list` prints them (none: no table)."""
    done = subprocess.run(["nft", "list", "table", "inet", table], capture_output=True, text=True, check=False)
    return [line.strip() for line in done.stdout.splitlines()]


def reached_through_firewall(address: str, port: int) -> bool:
    """Whether a connection to a listener of ours on `address`:`port` gets through."""
    with socket.socket() as listener, socket.socket() as client:
        listener.bind((address, port))
        listener.listen(1)
        client.settimeout(5)
        try:
            client.connect((address, port))
        except ConnectionRefusedError:
            return False
        return True


def listening(port: int) -> list[str]:
    """The local addresses that listen on TCP `port` in this network namespace (the kernel's table)."""
    out = []
    for table, family in (("/proc/net/tcp", 4), ("/proc/net/tcp6", 6)):
        try:
            lines = Path(table).read_text(encoding="ascii").splitlines()[1:]
        except FileNotFoundError:
            continue
        for line in lines:
            fields = line.split()
            local, state = fields[1], fields[3]
            address, _, hex_port = local.partition(":")
            if state != "0A" or int(hex_port, 16) != port:
                continue
            raw = bytes.fromhex(address)
            if family == 4:
                out.append(str(ipaddress.IPv4Address(raw[::-1])))
            else:
                words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))
                out.append(str(ipaddress.IPv6Address(words)))
    return out


async def groups_of(controller: Controller) -> list[Json]:
    async with controller.client() as http:
        view = await ok(http.get("/api/v1/deployments/chat"))
    return list(view["groups"])


async def group_of(controller: Controller) -> Json:
    [group] = await groups_of(controller)
    return group


def container_id(podman: PodmanService, assignment_id: str) -> str:
    found = podman.cli("inspect", "--format", "{{.Id}}", container_name(assignment_id), check=False)
    return found.stdout.strip() if found.returncode == 0 else ""


async def deploy_chat(controller: Controller, s3: S3Store, image: str, gguf: Path) -> tuple[str, Replica]:
    """The llama.cpp runtime (`--fabric tcp`), the tiny model and deployment `chat`: one group of
    two nodes, placed on cpu-1 (the head) and cpu-2. (An inference key of tenant acme, the replica.)"""
    argv = ["runtimes", "register", RUNTIME, "--kind", "llamacpp", "--version", "0.3.36", "--fabric", "tcp"]
    await trio.to_thread.run_sync(cli, controller, *argv, "--image", image)
    await register_model(controller, s3, "tiny", gguf)
    chat = {
        "name": "chat",
        "runtime": RUNTIME,
        "alias": "tiny",
        "replicas": 1,
        "nodes_per_replica": 2,
        "resources": {"accelerators": 0, "memory_bytes": 1024 * MIB, "cpus": 1.0},
        "options": {"port": PORT, "settings": {"ctx_size": 512, "parallel": 1, "flash_attn": "off"}},
    }
    async with controller.client() as http:
        await ok(http.post("/api/v1/tenants", json={"id": "acme"}), 201)
        key = (await ok(http.post("/api/v1/keys", json={"role": "inference", "tenant": "acme"}), 201))["key"]
        created = await ok(http.post("/api/v1/deployments", json=chat), 201)
    [placed] = created["deployment"]["placed"]
    assert [(m["rank"], m["node_id"]) for m in placed["members"]] == [(0, "cpu-1"), (1, "cpu-2")]
    return str(key), Replica(id=placed["id"], node_id=placed["node_id"])


async def wait_ready(controller: Controller, podman: PodmanService) -> None:
    async def ready() -> bool:
        return (await group_of(controller))["state"] == "ready"

    try:
        await wait_for(ready, "the group Ready")
    except BaseException:
        print(runtime_logs(podman), await group_of(controller))
        raise


async def test_a_llama_cpp_rpc_group_of_two_nodes_serves_and_is_restarted_together_when_its_worker_or_its_agent_dies(
    group_cluster: tuple[Controller, list[Node]],
    s3_store: S3Store,
    llama_server_image: str,
    tiny_gguf: Path,
    podman_service: PodmanService,
    tmp_path: Path,
) -> None:
    controller, nodes = group_cluster
    key, replica = await deploy_chat(controller, s3_store, llama_server_image, tiny_gguf)
    head, worker = member_id(replica, 0), member_id(replica, 1)

    async def ready() -> bool:
        return (await group_of(controller))["state"] == "ready"

    await wait_ready(controller, podman_service)
    group = await group_of(controller)
    assert [(m["rank"], m["node_id"], m["state"]) for m in group["members"]] == [
        (0, "cpu-1", "Ready"),
        (1, "cpu-2", "Ready"),
    ]
    shown = await trio.to_thread.run_sync(cli, controller, "deployments", "show", "chat")
    assert f"group    {replica.id}, 2 nodes: ready" in shown, shown
    assert "  rank 1: cpu-2, GPUs -, Ready" in shown, shown

    # What each rank runs: the worker the RPC server on its fabric address; the head llama-server over it.
    worker_port = PORT + GROUP_PORT_OFFSET
    inspected = json.loads(podman_service.cli("inspect", container_name(worker)).stdout)[0]
    process = [inspected["Path"], *inspected["Args"]]
    assert process == ["/app/ggml-rpc-server", "-H", nodes[1].host, "-p", str(worker_port)], process
    assert inspected["HostConfig"]["NetworkMode"] == "host"
    head_process = json.loads(podman_service.cli("inspect", container_name(head)).stdout)[0]["Args"]
    assert head_process[head_process.index("--rpc") + 1] == f"{nodes[1].host}:{worker_port}", head_process
    # The worker's port (no authentication of its own) listens on its fabric address only.
    assert listening(worker_port) == [nodes[1].host]
    # And closed, by the worker's agent (its fabric firewall on) in its own nftables table, to every
    # address but its fabric address: a listener of that port on another address (as torch's store
    # on every address would be) is reset; the head (firewall off here) writes no table.
    rules = nft_rules(nodes[1].firewall_table)
    assert f"tcp dport {worker_port} ip daddr {nodes[1].host} accept" in rules, rules
    assert f"tcp dport {worker_port} reject with tcp reset" in rules, rules
    assert nft_rules(nodes[0].firewall_table) == []
    assert reached_through_firewall("127.0.0.1", worker_port) is False

    client = openai.OpenAI(base_url=controller.url + "/v1", api_key=key, max_retries=0, timeout=120)

    def chat_completion(count: int = 1) -> None:
        """`count` completions one after another, each of which must succeed."""
        for _ in range(count):
            got = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hello world"}], max_tokens=8, temperature=0
            )
            assert got.usage is not None and 1 <= got.usage.completion_tokens <= 8
            assert got.choices[0].finish_reason in {"length", "stop"}

    try:
        try:
            await in_thread(chat_completion)
        except openai.OpenAIError:
            pytest.fail(runtime_logs(podman_service))

        # The worker's container dies: the whole group is withdrawn and started again together.
        head_before = container_id(podman_service, head)
        assert head_before
        podman_service.cli("kill", container_name(worker))

        async def restarted() -> bool:
            group = await group_of(controller)
            now = container_id(podman_service, head)
            return group["state"] == "ready" and bool(now) and now != head_before

        await wait_for(restarted, "the group restarted together")
        async with controller.client() as http:
            events = (await ok(http.get("/api/v1/audit")))["events"]
        details = [e["detail"] for e in events if e["action"] == "deployment.group"]
        assert any("every member withdrawn" in d and "rank 1" in d for d in details), details
        assert any("every worker Ready; head started" in d for d in details), details
        assert listening(worker_port) == [nodes[1].host]
        try:  # no request started after the restart fails
            await in_thread(lambda: chat_completion(4))
        except openai.OpenAIError:
            pytest.fail(runtime_logs(podman_service))

        # The worker's agent dies (its container keeps running): once its node is Unreachable the
        # group is withdrawn (the head stops on cpu-1), and no half group is left when the agent is
        # back: it gets a set without its member, then the whole group starts again and serves.
        worker_agent = nodes[1].proc
        assert worker_agent is not None
        worker_agent.kill()
        worker_agent.wait(timeout=30)

        async def withdrawn() -> bool:
            group = await group_of(controller)
            return group["state"] == "restarting" and not container_id(podman_service, head)

        await wait_for(withdrawn, "the group withdrawn while its worker's node is lost", 60)
        assert "rank 1's node cpu-2 is Unreachable" in (await group_of(controller))["detail"]
        nodes[1].start(tmp_path / "cpu-2-again.log")
        await wait_for(ready, "the group Ready again after the worker's agent came back")
        assert listening(worker_port) == [nodes[1].host]
        # The new agent closed the port again before the worker's new container started.
        assert f"tcp dport {worker_port} ip daddr {nodes[1].host} accept" in nft_rules(nodes[1].firewall_table)
        try:  # no request started after the restart fails
            await in_thread(lambda: chat_completion(4))
        except openai.OpenAIError:
            pytest.fail(runtime_logs(podman_service))
    finally:
        client.close()


@pytest.fixture
async def two_pairs(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, podman_service: PodmanService
) -> AsyncIterator[tuple[Controller, list[Node]]]:
    """Four agents: cpu-1 and cpu-2 on fabric `pair-a`, cpu-3 and cpu-4 on `pair-b`."""

    def labels(node: Node) -> str:
        pair = "pair-a" if node.name in ("cpu-1", "cpu-2") else "pair-b"
        return f"fabric={pair},fabric-address={node.host}"

    async with real_cluster(nursery, tmp_path, s3_store, podman_service, labels=labels, count=4) as c:
        yield c


async def test_draining_one_member_moves_the_whole_group_to_another_fabric_pair_while_requests_are_answered(
    two_pairs: tuple[Controller, list[Node]],
    s3_store: S3Store,
    llama_server_image: str,
    tiny_gguf: Path,
    podman_service: PodmanService,
) -> None:
    controller, nodes = two_pairs
    key, replica = await deploy_chat(controller, s3_store, llama_server_image, tiny_gguf)
    old = [member_id(replica, 0), member_id(replica, 1)]
    await wait_ready(controller, podman_service)
    client = openai.OpenAI(base_url=controller.url + "/v1", api_key=key, max_retries=0, timeout=120)
    answered: list[int] = []
    failed: list[Exception] = []
    stop = trio.Event()

    def one() -> None:
        try:
            got = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "hello world"}], max_tokens=4, temperature=0
            )
        except openai.OpenAIError as exc:
            failed.append(exc)
        else:
            answered.append(got.usage.completion_tokens if got.usage else 0)

    async def keep_asking() -> None:
        while not stop.is_set():
            await in_thread(one)

    async def moved() -> bool:
        groups = await groups_of(controller)
        on = [([m["node_id"] for m in g["members"]], g["state"]) for g in groups]
        gone = not any(container_id(podman_service, aid) for aid in old)
        return on == [(["cpu-3", "cpu-4"], "ready")] and gone

    try:
        async with trio.open_nursery() as asking:
            asking.start_soon(keep_asking)
            await wait_for(lambda: _some(answered), "a first answer")
            async with controller.client() as http:
                await ok(http.post("/api/v1/nodes/cpu-2/drain"))
            try:
                await wait_for(moved, "the group moved whole to cpu-3 and cpu-4", 120)
            except BaseException:
                print(runtime_logs(podman_service), await groups_of(controller))
                raise
            before = len(answered)
            await wait_for(lambda: _some(answered[before:]), "an answer from the moved group")
            stop.set()
        # Make before break: the old group served until the new one was Ready, so every request
        # was answered; a failure would have been a typed API error, never a dropped connection.
        assert all(isinstance(e, openai.APIStatusError) for e in failed), failed
        assert failed == [], [(type(e).__name__, str(e)[:200]) for e in failed]
        # Both old members left their nodes' sets in one change (never half a group).
        async with controller.client() as http:
            events = (await ok(http.get("/api/v1/audit")))["events"]
        dropped = [e["detail"] for e in events if e["action"] == "deployment.replace"]
        assert any("cpu-1 generation" in d and "cpu-2 generation" in d for d in dropped), dropped
        worker_port = PORT + GROUP_PORT_OFFSET
        assert listening(worker_port) == [nodes[3].host]  # the new worker's RPC server, on its fabric address
    finally:
        client.close()


async def _some(items: list[int]) -> bool:
    return bool(items)
