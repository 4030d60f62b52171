"""Replica groups (one model over several nodes): each rank's command line, from its `GroupRole`
(the members' fabric addresses and ports, the head at rank 0) and the deployment's settings. Pure:
no I/O, no trio.

Every rank runs in its own container on its own node; rank 0, the head, serves the API the gateway
routes to (its command is the adapter's own, plus what makes it the head), the others join it over
the fabric. What each runtime takes, and from where:

* vLLM, from the release that has them (`VLLM_MP_MULTINODE_SINCE`), its multiprocessing multi-node
  flags (vllm/config/parallel.py `nnodes`, `node_rank`, `master_addr`, `master_port`; docs
  serving/parallelism_scaling.md "Running vLLM with MultiProcessing"): every rank runs `vllm serve`
  with `--nnodes --node-rank --master-addr --master-port`, the others with `--headless` (no API
  server). Before it, Ray, as vLLM's docs ("Running vLLM on a Ray cluster",
  examples/online_serving/run_cluster.sh) and NVIDIA's DGX Spark playbook do it: the head starts a
  Ray head (`ray start --head --port`) and then `vllm serve … --distributed-executor-backend ray`,
  the others `ray start --address head:port --block`. The container runs one process, so a fixed
  `sh -c` script runs both on the head; every value reaches it as an argument (`"$1"`), never
  inside the script. Each rank's `VLLM_HOST_IP` is its fabric address (the docs' "Network security";
  vllm/utils `get_ip` reads it for the addresses vLLM binds and advertises).
* SGLang: `--nnodes --node-rank --dist-init-addr head:port` on every rank (docs
  references/multi_node_deployment; python/sglang/srt/server_args.py), `--tp-size`/`--pp-size`
  over the whole group; ranks other than 0 serve no HTTP. Each rank's `SGLANG_HOST_IP` is its
  fabric address (`SGLANG_HOST_IP_ENV`).
* vLLM and SGLang (torch.distributed underneath): when the node discovered the interface its fabric
  address sits on (`GroupMember.interface`), `GLOO_SOCKET_IFNAME` and `NCCL_SOCKET_IFNAME` name it
  (`fabric_env`), so Gloo's and NCCL's listeners are on the fabric address too. Ray binds its
  gRPC servers on `--node-ip-address` (and loopback) from ray-project/ray#55484 and #59852 on. What
  no option narrows: torch's rendezvous store (the head's `--master-port`, `--dist-init-addr` port)
  listens on every address of the node.
* llama.cpp: the others run the RPC server (tools/rpc/README.md) bound to their fabric address
  only (`-H address -p port`: never 0.0.0.0 nor a management address; it has no authentication of
  its own), the head runs `llama-server … --rpc host1:port1,host2:port2` over all of them.
  llama-cpp-python's server is not offered for groups.
* TensorRT-LLM runs across nodes only inside one MPI world (`mpirun`, or Slurm's `srun` with
  `trtllm-llmapi-launch`): nexa starts one container per node and shares no MPI launcher, so a
  group of it is refused (`TRTLLM_GROUP_REFUSAL`).

The parallel sizes are `settings.tensor_parallel_size` and `settings.pipeline_parallel_size`
(`base.TENSOR_PARALLEL_SETTING`); unset, the whole group is tensor parallel. Ranks that serve no API
get a probe that only says their process runs (vLLM, SGLang), or that their port listens (the
llama.cpp RPC server, read from /proc/net/tcp: a connection would take the server's one client slot).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Mapping, Sequence
from typing import Final

import attrs

from nexa.adapters.args import version_at_least
from nexa.adapters.base import LLAMA_CPP_PYTHON, LLAMA_SERVER, MODEL_PATH, Adapter, Launch
from nexa.adapters.llamacpp import RPC_SERVER_PROGRAM, RPC_SERVER_SETTING
from nexa.contracts.groups import GroupMember, GroupRole
from nexa.contracts.memory import RuntimeMemory
from nexa.contracts.node import RuntimeKind
from nexa.errors import NotDeployable

#: The first vLLM release with multi-node multiprocessing (`--nnodes`, `--node-rank`, `--master-addr`,
#: `--master-port`, `--headless`): vllm-project/vllm#23691, merged in November 2025 (the weekly summary
#: of 21 November), after the v0.11.1 and v0.11.2 release branches; v0.12.0 is the first release from
#: main after it. Earlier versions (and an unreadable version) get the Ray style.
VLLM_MP_MULTINODE_SINCE: Final = "0.12.0"
#: The head's script for the Ray style: start a Ray head on the fabric address, then become vLLM.
#: `$1` the head's fabric address, `$2` its Ray port, the rest vLLM's command.
RAY_HEAD_SCRIPT: Final = 'ray start --head --node-ip-address="$1" --port="$2" && shift 2 && exec "$@"'
#: A worker's: join the head's Ray cluster and stay in the foreground. `$1` its own fabric address,
#: `$2` the head's `address:port`.
RAY_WORKER_SCRIPT: Final = 'exec ray start --address="$2" --node-ip-address="$1" --block'
#: Ray reports usage to its authors unless told not to (Ray's "Usage Stats Collection" page).
RAY_ENV: Final = {"RAY_USAGE_STATS_ENABLED": "0"}
#: The interface torch.distributed's Gloo backend binds and uses (PyTorch's "Choosing the network
#: interface to use"): its pairs listen on that interface's address.
GLOO_IFNAME_ENV: Final = "GLOO_SOCKET_IFNAME"
#: The interfaces NCCL uses for its bootstrap and socket transport (NCCL's environment variables
#: page); a leading `=` matches the name exactly rather than as a prefix.
NCCL_IFNAME_ENV: Final = "NCCL_SOCKET_IFNAME"
#: The address SGLang binds its cross-node sockets on and advertises to its peers
#: (python/sglang/srt/utils/network.py `get_local_ip_auto`: `SGLANG_HOST_IP`, else a guess by route).
SGLANG_HOST_IP_ENV: Final = "SGLANG_HOST_IP"
#: Whether a TCP port listens (any address), read from the kernel's socket table: `$1` the port.
LISTENING_SCRIPT: Final = (
    'p=$(printf %04X "$1") && cat /proc/net/tcp /proc/net/tcp6 2>/dev/null'
    ' | grep -Eq "^ *[0-9]+: [0-9A-F]+:$p [0-9A-F]+:0000 0A "'
)
TRTLLM_GROUP_REFUSAL: Final = (
    "resources: TensorRT-LLM runs across nodes only inside one MPI world (mpirun, or srun with "
    "trtllm-llmapi-launch), and nexa starts one container per node without a shared MPI launcher; "
    "deploy it on one node (nodes_per_replica 1), or serve the model with vLLM or SGLang across nodes"
)
#: The RPC server's program: a name looked up on the image's PATH, or an absolute path.
_PROGRAM_RE: Final = re.compile(r"^(?:/[A-Za-z0-9._+-]+)+$|^[A-Za-z0-9._+-]+$")


def group_problems(adapter: Adapter, settings: Mapping[str, object], *, nodes: int) -> list[str]:
    """What keeps `adapter` with `settings` from serving one replica over `nodes` nodes (none for one node,
    but a group-only setting given there)."""
    rpc = settings.get(RPC_SERVER_SETTING)
    if nodes < 2:
        return [
            f"settings.{name}: only a replica group runs it"
            for name in sorted(adapter.group_settings)
            if name in settings
        ]
    if adapter.kind is RuntimeKind.TRTLLM:
        return [TRTLLM_GROUP_REFUSAL]
    if adapter.name == LLAMA_CPP_PYTHON:
        return [
            f"settings.server: a llama.cpp group runs {LLAMA_SERVER} and RPC servers; {LLAMA_CPP_PYTHON}'s "
            f"server takes no RPC servers (set settings.server to {LLAMA_SERVER})"
        ]
    if isinstance(rpc, str) and (not _PROGRAM_RE.match(rpc) or {".", ".."} & set(rpc.split("/"))):
        return [f"settings.{RPC_SERVER_SETTING}: a program name or an absolute path, without . or .. parts"]
    return []


def host_port(member: GroupMember) -> str:
    """`address:port`, an IPv6 address in brackets (`[fd00::1]:50052`)."""
    if ipaddress.ip_address(member.address).version == 6:
        return f"[{member.address}]:{member.port}"
    return f"{member.address}:{member.port}"


def launch_rank(
    adapter: Adapter,
    served_name: str,
    settings: Mapping[str, object],
    gpus: Sequence[str],
    port: int,
    *,
    role: GroupRole,
    model_path: str = MODEL_PATH,
    memory: RuntimeMemory | None = None,
    extra_args: Sequence[str] = (),
    version: str = "",
    model_dir: str = "",
) -> Launch:
    """The command, env, probe and /dev/shm size of `role`'s rank (settings and `extra_args` already
    validated, as for `Adapter.launch`; `port` is the head's API port, on the node's runtime address).
    Raises NotDeployable where the runtime cannot run as a group (`group_problems`)."""
    problems = group_problems(adapter, settings, nodes=role.size)
    if problems:
        raise NotDeployable("; ".join(problems))
    base = adapter.launch(
        served_name,
        settings,
        gpus,
        port,
        model_path=model_path,
        memory=memory,
        version=version,
        model_dir=model_dir,
        nodes=role.size,
    )
    if adapter.kind is RuntimeKind.VLLM:
        return _vllm(base, role, extra_args, version)
    if adapter.kind is RuntimeKind.SGLANG:
        flags = ["--nnodes", str(role.size), "--node-rank", str(role.rank), "--dist-init-addr", host_port(role.head)]
        env = {SGLANG_HOST_IP_ENV: role.me.address, **fabric_env(role)}
        return _rank(base, role, [*base.command, *flags, *extra_args], env)
    # llama-server (group_problems refused the rest).
    if role.is_head:
        return attrs.evolve(base, command=[*base.command, "--rpc", ",".join(map(host_port, role.others)), *extra_args])
    program = settings.get(RPC_SERVER_SETTING, RPC_SERVER_PROGRAM)
    command = [str(program), "-H", role.me.address, "-p", str(role.me.port)]
    threads = settings.get("threads")
    if isinstance(threads, int) and not isinstance(threads, bool):
        command += ["-t", str(threads)]
    listening = ["sh", "-c", LISTENING_SCRIPT, "listening", str(role.me.port)]
    return attrs.evolve(base, command=command, health=attrs.evolve(base.health, command=listening))


def fabric_env(role: GroupRole) -> dict[str, str]:
    """What points torch.distributed's Gloo and NCCL at this rank's fabric interface (when its node
    discovered it): their listeners are bound on its address, their traffic goes over it."""
    interface = role.me.interface
    if not interface:
        return {}
    return {GLOO_IFNAME_ENV: interface, NCCL_IFNAME_ENV: f"={interface}"}


def _vllm(base: Launch, role: GroupRole, extra_args: Sequence[str], version: str) -> Launch:
    env = {"VLLM_HOST_IP": role.me.address, **fabric_env(role)}
    if version_at_least(version, VLLM_MP_MULTINODE_SINCE):
        flags = ["--nnodes", str(role.size), "--node-rank", str(role.rank)]
        flags += ["--master-addr", role.head.address, "--master-port", str(role.head.port)]
        if not role.is_head:
            flags.append("--headless")
        return _rank(base, role, [*base.command, *flags, *extra_args], env)
    env |= RAY_ENV
    if role.is_head:
        ray = ["sh", "-c", RAY_HEAD_SCRIPT, "ray-head", role.me.address, str(role.me.port)]
        return _rank(base, role, [*ray, *base.command, "--distributed-executor-backend", "ray", *extra_args], env)
    return _rank(base, role, ["sh", "-c", RAY_WORKER_SCRIPT, "ray-worker", role.me.address, host_port(role.head)], env)


def _rank(base: Launch, role: GroupRole, command: list[str], env: Mapping[str, str] | None = None) -> Launch:
    """`base` with `command` and more `env`; a rank other than the head serves no API, so its probe
    only says its process runs."""
    health = base.health if role.is_head else attrs.evolve(base.health, command=["true"])
    return attrs.evolve(base, command=command, env={**base.env, **(env or {})}, health=health)
