"""Replica groups (`nexa.adapters.groups`): each rank's command line, pinned, for two DGX Sparks
linked by their ConnectX-7 ports (fabric 10.10.0.1 and .2), one GPU each.

What each line is checked against is in the module's docstring: vLLM's multiprocessing multi-node
flags (docs serving/parallelism_scaling.md) and its Ray style (run_cluster.sh, NVIDIA's Spark
playbook), SGLang's multi-node deployment page, llama.cpp's tools/rpc/README.md.
"""

from __future__ import annotations

import socket
import subprocess
from typing import Any

import attrs
import pytest

from nexa import adapters
from nexa.adapters import groups
from nexa.adapters.base import Launch
from nexa.adapters.llamacpp import LLAMA_CPP_PYTHON_ADAPTER, LLAMA_SERVER_ADAPTER
from nexa.adapters.sglang import SGLANG
from nexa.adapters.trtllm import TRTLLM
from nexa.adapters.vllm import VLLM
from nexa.contracts.groups import FabricAccess, GroupMember, GroupRole
from nexa.contracts.node import RuntimeKind
from nexa.contracts.runtime import RUNTIME_HOST
from nexa.errors import NotDeployable
from tests.support.adapters import LLAMA_ENV, PORT, SGLANG_ENV, VLLM_ENV

GPU = ["nvidia.com/gpu=0"]
MODEL = "/models/llama-3-70b"
HEAD, WORKER = "10.10.0.1", "10.10.0.2"
#: vLLM's default master port (vllm/config/parallel.py), SGLang's documented one, llama.cpp's RPC port.
VLLM_PORT, SGLANG_PORT, RPC_PORT = 29501, 20000, 50052
API = ["--host", RUNTIME_HOST, "--port", str(PORT)]


def role(rank: int, port: int, *, size: int = 2) -> GroupRole:
    members = [
        GroupMember(rank=r, node_id=f"spark-{r + 1}", address=f"10.10.0.{r + 1}", port=port) for r in range(size)
    ]
    return GroupRole(group="chat-g0", rank=rank, members=members, fabric=FabricAccess.RDMA)


def launch(adapter: Any, rank: int, port: int, settings: dict[str, object] | None = None, **kw: Any) -> Launch:
    return groups.launch_rank(
        adapter, "llama-3-70b", settings or {}, GPU, PORT, role=role(rank, port), model_path=MODEL, **kw
    )


def test_vllm_with_multiprocessing_multi_node_flags_from_0_12() -> None:
    serve = ["vllm", "serve", MODEL, "--served-model-name", "llama-3-70b", *API, "--tensor-parallel-size", "2"]
    dist = ["--nnodes", "2", "--master-addr", HEAD, "--master-port", str(VLLM_PORT)]
    head = launch(VLLM, 0, VLLM_PORT, {"max_model_len": 8192}, version="0.12.0", extra_args=["--seed", "1"])
    assert head.command == [*serve, "--max-model-len", "8192", *dist[:2], "--node-rank", "0", *dist[2:], "--seed", "1"]
    assert head.env == {**VLLM_ENV, "VLLM_HOST_IP": HEAD}
    assert head.health == VLLM.probe(PORT)  # the head serves the API
    worker = launch(VLLM, 1, VLLM_PORT, {"max_model_len": 8192}, version="v0.13.1")
    assert worker.command == [*serve, "--max-model-len", "8192", *dist[:2], "--node-rank", "1", *dist[2:], "--headless"]
    assert worker.env == {**VLLM_ENV, "VLLM_HOST_IP": WORKER}
    assert worker.health == attrs.evolve(VLLM.probe(PORT), command=["true"])  # no API: it runs
    assert worker.shm_bytes == head.shm_bytes == 8 * 2**30


def test_vllm_before_0_12_runs_a_ray_head_and_ray_workers() -> None:
    serve = ["vllm", "serve", MODEL, "--served-model-name", "llama-3-70b", *API, "--tensor-parallel-size", "2"]
    env = {**VLLM_ENV, "RAY_USAGE_STATS_ENABLED": "0"}
    head = launch(VLLM, 0, 6379, version="0.11.2", extra_args=["--seed", "1"])
    script = 'ray start --head --node-ip-address="$1" --port="$2" && shift 2 && exec "$@"'
    ray = ["sh", "-c", script, "ray-head", HEAD, "6379"]
    assert head.command == [*ray, *serve, "--distributed-executor-backend", "ray", "--seed", "1"]
    assert head.env == {**env, "VLLM_HOST_IP": HEAD}
    assert head.health == VLLM.probe(PORT)
    worker = launch(VLLM, 1, 6379, version="")  # an unreadable version: the style every release has
    script = 'exec ray start --address="$2" --node-ip-address="$1" --block'
    assert worker.command == ["sh", "-c", script, "ray-worker", WORKER, f"{HEAD}:6379"]
    assert worker.env == {**env, "VLLM_HOST_IP": WORKER}
    assert worker.health.command == ["true"]


def test_the_ray_scripts_take_every_value_as_an_argument(tmp_path: Any) -> None:
    """The scripts are fixed text: a value (here a hostile one, which the contract would refuse
    anyway) reaches them as "$1", never as shell code; a stand-in `ray` shows what it is given."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "ray").write_text('#!/bin/sh\nfor a in "$@"; do echo "ray:$a"; done\n')
    (bin_dir / "ray").chmod(0o755)
    head = launch(VLLM, 0, 6379, version="0.11.0")
    hostile = [*head.command[:4], "x; touch pwned", "6379", "printf", "%s|", "vllm", "serve"]
    out = subprocess.run(
        hostile, capture_output=True, text=True, check=True, cwd=tmp_path, env={"PATH": f"{bin_dir}:/usr/bin:/bin"}
    )
    assert out.stdout.splitlines() == [
        "ray:start",
        "ray:--head",
        "ray:--node-ip-address=x; touch pwned",
        "ray:--port=6379",
        "vllm|serve|",
    ]
    assert not (tmp_path / "pwned").exists()


def test_sglang_ranks_join_the_heads_dist_init_address() -> None:
    settings: dict[str, object] = {"mem_fraction_static": 0.8, "pipeline_parallel_size": 2}
    serve = ["python3", "-m", "sglang.launch_server", "--model-path", MODEL, "--served-model-name", "llama-3-70b"]
    serve += [*API, "--enable-metrics", "--pp-size", "2", "--mem-fraction-static", "0.8"]
    dist = ["--nnodes", "2", "--node-rank"]
    head = launch(SGLANG, 0, SGLANG_PORT, settings)
    assert head.command == [*serve, *dist, "0", "--dist-init-addr", f"{HEAD}:{SGLANG_PORT}"]
    # Each rank's SGLANG_HOST_IP (what SGLang binds its cross-node sockets on and advertises) is its fabric address.
    assert head.env == {**SGLANG_ENV, "SGLANG_HOST_IP": HEAD} and head.health == SGLANG.probe(PORT)
    worker = launch(SGLANG, 1, SGLANG_PORT, settings, extra_args=["--log-level", "debug"])
    assert worker.command == [*serve, *dist, "1", "--dist-init-addr", f"{HEAD}:{SGLANG_PORT}", "--log-level", "debug"]
    assert worker.env == {**SGLANG_ENV, "SGLANG_HOST_IP": WORKER}
    assert worker.health.command == ["true"]
    # Tensor parallel over the whole group unless told otherwise (SGLang's `--tp 16` over two nodes of 8).
    command = launch(SGLANG, 0, SGLANG_PORT).command
    assert command[command.index("--tp-size") + 1] == "2" and "--pp-size" not in command


@pytest.mark.parametrize(
    ("adapter", "version", "port", "own"),
    [
        (VLLM, "0.12.0", VLLM_PORT, {**VLLM_ENV, "VLLM_HOST_IP": WORKER}),
        (VLLM, "0.11.2", 6379, {**VLLM_ENV, "VLLM_HOST_IP": WORKER, "RAY_USAGE_STATS_ENABLED": "0"}),
        (SGLANG, "", SGLANG_PORT, {**SGLANG_ENV, "SGLANG_HOST_IP": WORKER}),
    ],
)
def test_nccl_and_gloo_are_pointed_at_the_fabric_interface_its_node_discovered(
    adapter: Any, version: str, port: int, own: dict[str, str]
) -> None:
    # The ConnectX-7 port's interface on a DGX Spark (NVIDIA's playbook names it enp1s0f0np0).
    members = [
        GroupMember(rank=r, node_id=f"spark-{r + 1}", address=f"10.10.0.{r + 1}", port=port, interface="enp1s0f0np0")
        for r in range(2)
    ]
    fabric = GroupRole(group="chat-g0", rank=1, members=members, fabric=FabricAccess.RDMA)
    worker = groups.launch_rank(adapter, "llama-3-70b", {}, GPU, PORT, role=fabric, model_path=MODEL, version=version)
    # NCCL's `=` matches the name exactly (not as a prefix of enp1s0f0np0v1, say).
    assert worker.env == {**own, "GLOO_SOCKET_IFNAME": "enp1s0f0np0", "NCCL_SOCKET_IFNAME": "=enp1s0f0np0"}
    # Without a discovered interface (an address from the fabric-address label) neither is set.
    assert "NCCL_SOCKET_IFNAME" not in launch(adapter, 1, port, version=version).env
    # An interface name is checked like the inventory's.
    with pytest.raises(ValueError, match="interface"):
        GroupMember(rank=0, node_id="spark-1", address=HEAD, port=port, interface="eth0; rm -rf /")


def test_llama_cpp_workers_run_the_rpc_server_on_their_fabric_address_only() -> None:
    members = [GroupMember(rank=r, node_id=f"n{r}", address=f"10.10.0.{r + 1}", port=RPC_PORT + r) for r in range(3)]
    group = GroupRole(group="g", rank=0, members=members, fabric=FabricAccess.TCP)
    server = ["llama-server", "--model", f"{MODEL}/model.gguf", "--alias", "tiny", *API, "--metrics"]
    head = groups.launch_rank(
        LLAMA_SERVER_ADAPTER,
        "tiny",
        {"ctx_size": 512},
        [],
        PORT,
        role=group,
        model_path=f"{MODEL}/model.gguf",
        extra_args=["--seed", "1"],
    )
    rpc = ["--rpc", f"10.10.0.2:{RPC_PORT + 1},10.10.0.3:{RPC_PORT + 2}"]
    assert head.command == [*server, "--ctx-size", "512", *rpc, "--seed", "1"]
    assert head.env == LLAMA_ENV
    worker = groups.launch_rank(
        LLAMA_SERVER_ADAPTER,
        "tiny",
        {"threads": 4},
        [],
        PORT,
        role=attrs.evolve(group, rank=2),
        model_path=f"{MODEL}/model.gguf",
        extra_args=["--seed", "1"],
    )
    # Bound on the fabric address (never 0.0.0.0 nor the node's management address); no extra_args.
    assert worker.command == ["/app/ggml-rpc-server", "-H", "10.10.0.3", "-p", str(RPC_PORT + 2), "-t", "4"]
    assert worker.env == LLAMA_ENV
    assert worker.health.command == ["sh", "-c", groups.LISTENING_SCRIPT, "listening", str(RPC_PORT + 2)]
    older = groups.launch_rank(
        LLAMA_SERVER_ADAPTER, "tiny", {"rpc_server": "/app/rpc-server"}, [], PORT, role=attrs.evolve(group, rank=1)
    )
    assert older.command[:2] == ["/app/rpc-server", "-H"]


def test_the_listening_probe_reads_the_kernels_socket_table() -> None:
    """Run the probe's script here against this machine's own socket table: a port that listens
    passes, one that does not fails (no connection is made, so an RPC server's one client slot is
    never taken)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        port = s.getsockname()[1]
        probe = ["sh", "-c", groups.LISTENING_SCRIPT, "listening", str(port)]
        assert subprocess.run(probe, check=False).returncode == 0
    assert subprocess.run(probe, check=False).returncode != 0


def test_ipv6_fabric_addresses_are_bracketed_where_a_port_follows() -> None:
    members = [GroupMember(rank=r, node_id=f"n{r}", address=f"fd00::{r + 1}", port=RPC_PORT) for r in range(2)]
    group = GroupRole(group="g", rank=0, members=members)
    assert groups.launch_rank(SGLANG, "m", {}, GPU, PORT, role=attrs.evolve(group, rank=1)).command[-2:] == [
        "--dist-init-addr",
        f"[fd00::1]:{RPC_PORT}",
    ]
    assert groups.launch_rank(LLAMA_SERVER_ADAPTER, "m", {}, [], PORT, role=group).command[-2:] == [
        "--rpc",
        f"[fd00::2]:{RPC_PORT}",
    ]


def test_tensorrt_llm_and_llama_cpp_python_groups_are_refused_saying_what_to_do() -> None:
    with pytest.raises(NotDeployable, match="one MPI world") as caught:
        launch(TRTLLM, 0, 29500)
    assert "vLLM or SGLang" in caught.value.message and caught.value.code == "not_deployable"
    with pytest.raises(NotDeployable, match=r"set settings\.server to llama-server"):
        launch(LLAMA_CPP_PYTHON_ADAPTER, 1, RPC_PORT)
    # The same refusals when the deployment is checked, before anything is placed.
    assert adapters.settings_problems(RuntimeKind.TRTLLM, {}, accelerators=1, nodes=2) == [groups.TRTLLM_GROUP_REFUSAL]
    assert adapters.settings_problems(RuntimeKind.TRTLLM, {}, accelerators=1) == []
    # The sim runtime is a process of one node: no group of it.
    assert adapters.settings_problems(RuntimeKind.SIM, {}, accelerators=0, nodes=2) == [
        "nodes_per_replica: the sim runtime runs on one node (set it to 1)"
    ]
    assert adapters.settings_problems(RuntimeKind.SIM, {}, accelerators=0) == []


@pytest.mark.parametrize(
    ("kind", "settings", "nodes", "problem"),
    [
        (
            RuntimeKind.VLLM,
            {"tensor_parallel_size": 3},
            2,
            "tensor x pipeline parallel (3 x 1) must be the replica's 2 GPUs",
        ),
        (
            RuntimeKind.VLLM,
            {"pipeline_parallel_size": 2, "tensor_parallel_size": 2},
            1,
            "(2 x 2) must be the replica's 1 GPUs",
        ),
        (RuntimeKind.SGLANG, {"pipeline_parallel_size": 0}, 2, "settings.pipeline_parallel_size: at least 1"),
        (RuntimeKind.SGLANG, {"tensor_parallel_size": "2"}, 2, "settings.tensor_parallel_size: an integer"),
        (RuntimeKind.LLAMACPP, {"tensor_parallel_size": 2}, 2, "unknown option for llama-server"),
        (
            RuntimeKind.LLAMACPP,
            {"rpc_server": "bin/../rpc-server"},
            2,
            "settings.rpc_server: a program name or an absolute path",
        ),
        (RuntimeKind.LLAMACPP, {"rpc_server": "/app/rpc-server"}, 1, "settings.rpc_server: only a replica group"),
        (RuntimeKind.LLAMACPP, {"rpc_server": ".."}, 2, "settings.rpc_server: a program name or an absolute path"),
        (RuntimeKind.LLAMACPP, {"rpc_server": "rpc server"}, 2, "settings.rpc_server: a program name"),
    ],
)
def test_bad_group_settings_are_named(kind: RuntimeKind, settings: dict[str, object], nodes: int, problem: str) -> None:
    problems = adapters.settings_problems(kind, settings, accelerators=1, nodes=nodes)
    assert any(problem in p for p in problems), problems


def test_parallel_settings_on_one_node_and_the_group_flags_nexa_owns() -> None:
    # On one node of 4 GPUs: pipeline parallel 2 makes tensor parallel 2 (the product is the GPUs).
    gpus = [f"nvidia.com/gpu={i}" for i in range(4)]
    command = VLLM.launch("m", {"pipeline_parallel_size": 2}, gpus, PORT).command
    assert command[command.index("--tensor-parallel-size") :][:4] == [
        "--tensor-parallel-size",
        "2",
        "--pipeline-parallel-size",
        "2",
    ]
    assert adapters.settings_problems(RuntimeKind.VLLM, {"pipeline_parallel_size": 2}, accelerators=4) == []
    refused = {
        RuntimeKind.VLLM: [
            "--nnodes",
            "2",
            "--node-rank=1",
            "--master-addr",
            "x",
            "--headless",
            "--distributed-executor-backend=ray",
        ],
        RuntimeKind.SGLANG: ["--nnodes", "2", "--dist-init-addr", "x", "--nccl-init-addr", "x", "--node-rank", "1"],
        RuntimeKind.LLAMACPP: ["--rpc", "10.0.0.9:50052"],
    }
    for kind, extra in refused.items():
        flags = [refusal.partition(":")[0] for refusal in adapters.extra_args_refusals(kind, {}, extra)]
        assert flags == [a.partition("=")[0] for a in extra if a.startswith("--")], kind
