"""The container spec builder: turn a verified assignment into the container spec podman creates. Pure.

No trio and no I/O here: the node supervisor calls these functions. The runtime adapters
(vLLM flags, llama.cpp arguments, …: `nexa.adapters`) run on the controller, which signs what they
build; here the node only fills in its own runtime address where the spec says `{runtime_host}`.
A container never receives a key, token or credential: environment variables with secret-looking
names are refused.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

import attrs

from nexa.contracts import codec, wire
from nexa.contracts.groups import FabricAccess
from nexa.contracts.node import RuntimeKind
from nexa.contracts.runtime import (
    CAP_IPC_LOCK,
    LABEL_ASSIGNMENT,
    LABEL_DEPLOYMENT,
    LABEL_GENERATION,
    LABEL_SPEC,
    NETWORK_HOST,
    NETWORK_PRIVATE,
    RDMA_DEVICE_RE,
    RUNTIME_CACHE_PATH,
    RUNTIME_HOST,
    ContainerSpec,
    ContainerState,
    RuntimeSpec,
)
from nexa.errors import ContractError

#: The node whose agent created the container: several agents may share one podman (tests, demos),
#: and each adopts and removes only its own containers.
LABEL_NODE: Final = "nexa.node"
#: The runtime kind (`vllm`, …, `sim`): the node routes `sim` to its process driver, not podman.
LABEL_KIND: Final = "nexa.kind"
#: The loopback port the runtime listens on (the process driver probes `/health` there).
LABEL_PORT: Final = "nexa.port"
#: A simulated runtime and `nexa sim-runtime` run only where this environment variable is `1`.
SIMULATION_ENV: Final = "NEXA_SIMULATION_ONLY"
#: What a sim runtime's image is, set by the node's process driver (injected faults may be by image).
SIM_IMAGE_ENV: Final = "NEXA_SIM_IMAGE"
#: In its own network namespace a runtime binds every address there (podman's port forward reaches
#: it on the namespace's interface) and its probe, run inside, asks loopback.
PRIVATE_BIND_HOST: Final = "0.0.0.0"  # noqa: S104 - inside the runtime's own network namespace
PRIVATE_PROBE_HOST: Final = "127.0.0.1"
#: Every container the agent creates is named `nexa-<assignment id>`.
NAME_PREFIX: Final = "nexa-"
#: /dev/shm of a group's containers with fabric access (at least): NCCL's and Ray's shared memory
#: live there; vLLM's docs give 16G for multi-node GPUDirect RDMA (serving/parallelism_scaling.md).
FABRIC_SHM_BYTES: Final = 16 * 2**30
#: Where the kernel puts the RDMA device nodes (`uverbsN`, `rdma_cm`) a group with `--fabric rdma` gets.
RDMA_DEVICE_DIR: Final = "/dev/infiniband"
#: Where the assignment's adapter directory is mounted read-only when its runtime loads its adapters
#: at run time (`RuntimeSpec.live_loras`): entries `/models/lora/<name>` (`nexa.adapters.lora.LORA_MOUNT_ROOT`).
LIVE_LORA_MOUNT: Final = "/models/lora"
#: An environment variable whose name contains one of these (any case) is refused.
SECRET_NAME_MARKERS: Final = ("KEY", "TOKEN", "SECRET", "PASSWORD", "CREDENTIAL")

# podman accepts [a-zA-Z0-9][a-zA-Z0-9_.-]* as a container name.
_NAME_OK: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_NAME_BAD_CHARS: Final = re.compile(r"[^A-Za-z0-9_.-]+")


def spec_sha256(runtime: RuntimeSpec) -> str:
    """sha256 of the runtime spec's canonical JSON: equal specs, equal digests, whatever the key order."""
    body = codec.wire.unstructure(runtime)
    artifact = body.get("artifact")
    if isinstance(artifact, dict) and not artifact.get("files") and not artifact.get("entry"):
        # One object, as before manifests: hashed as it was then, so an upgraded agent adopts
        # the runtimes it already runs instead of replacing them.
        artifact.pop("files", None)
        artifact.pop("entry", None)
    if not body.get("entrypoint"):
        body.pop("entrypoint", None)  # sets signed before entrypoints were set hash as they did
    if body.get("group") is None:
        body.pop("group", None)  # a replica on one node hashes as it did before groups
    if not body.get("loras"):
        body.pop("loras", None)  # a replica without LoRA adapters hashes as it did before them
    if not body.get("live_loras"):
        body.pop("live_loras", None)  # nor one whose adapters are fixed at start
    return hashlib.sha256(codec.canonical_json(body).encode()).hexdigest()


def container_name(assignment_id: str) -> str:
    """`nexa-<assignment id>`; an id podman would refuse is sanitised and suffixed with its digest,
    so two different ids never share a name."""
    if _NAME_OK.match(assignment_id):
        return NAME_PREFIX + assignment_id
    cleaned = _NAME_BAD_CHARS.sub("-", assignment_id).strip("-") or "x"
    return f"{NAME_PREFIX}{cleaned}-{hashlib.sha256(assignment_id.encode()).hexdigest()[:12]}"


def secret_env_names(env: Mapping[str, str]) -> list[str]:
    """The variables whose names look like secrets, sorted."""
    return sorted(name for name in env if any(marker in name.upper() for marker in SECRET_NAME_MARKERS))


def check_env(env: Mapping[str, str]) -> None:
    """Raise ContractError naming every variable that looks like a secret."""
    names = secret_env_names(env)
    if names:
        raise ContractError(
            "runtimes never receive keys, tokens or credentials; refused environment variable " + ", ".join(names),
            problems=tuple(f"runtime.env.{name}: looks like a secret" for name in names),
        )


def is_simulated(runtime: RuntimeSpec) -> bool:
    """A `sim` runtime: a local `nexa sim-runtime` process, with no image to pull."""
    return runtime.kind is RuntimeKind.SIM


def sim_command(assignment: wire.Assignment, artifact_path: Path | None, *, host: str = "127.0.0.1") -> list[str]:
    """The `nexa sim-runtime` arguments for a sim assignment: the node's runtime loopback address, its
    port, the deployment as the model name, the spec's own flags, then the artifact's host path (a
    process has no mounts; its LoRA adapters are loaded at run time by their paths on the node)."""
    runtime = assignment.runtime
    command = ["--host", host, "--port", str(runtime.port), "--model", assignment.deployment]
    command.extend(runtime.command)
    if artifact_path is not None:
        command.extend(["--artifact", str(artifact_path)])
    return command


def with_host(args: list[str], host: str) -> list[str]:
    """`args` with every `RUNTIME_HOST` placeholder replaced by the node's runtime loopback address."""
    return [arg.replace(RUNTIME_HOST, host) for arg in args]


def container_spec(
    node_id: str,
    assignment: wire.Assignment,
    generation: int,
    artifact_path: Path | None,
    *,
    host: str = "127.0.0.1",
    cache_dir: Path | None = None,
    rdma_devices: Sequence[str] = (),
    lora_paths: Sequence[Path] = (),
    live_lora_dir: Path | None = None,
) -> ContainerSpec:
    """What podman creates for `assignment`: the image by digest, the spec's command, env and
    limits, its GPUs as CDI devices, the verified artifact (its one file, or a manifest's assembled
    model directory) mounted read-only at `artifact.mount_path`, and the labels the
    supervisor adopts and removes by. Raises ContractError when the env holds a secret-looking name.

    A `sim` runtime is a process, not a container: its command is `sim_command` and it has no mounts.
    `cache_dir`: the replica's writable cache on the node (`node.runtime_cache`), mounted
    read-write at `RUNTIME_CACHE_PATH`.
    `lora_paths`: the fetched artifact of each of the spec's LoRA adapters (`RuntimeSpec.loras`, in
    order), each mounted read-only at its `artifact.mount_path`.
    `live_lora_dir`: the assignment's adapter directory on the node (`node.liveloras`), given exactly
    when the runtime loads its adapters at run time (`RuntimeSpec.live_loras`), mounted read-only at
    `LIVE_LORA_MOUNT`; a change of what it holds never changes the container.

    Networking: by default the container gets its own network namespace, `{runtime_host}` in the
    command becomes `0.0.0.0` (every address of that namespace, nothing of the node's) and in the
    health probe (run inside) `127.0.0.1`; podman publishes the port on `host` (the node's
    `runtime_host`) only. With the runtime's `host_network` opt-in both become `host`, in the
    node's own namespace.

    Fabric access (a replica group whose runtime registration opted in, `RuntimeSpec.group.fabric`):
    with `tcp` the node's namespace (the group's ranks reach each other on their fabric addresses)
    and /dev/shm of at least `FABRIC_SHM_BYTES`; with `rdma` also the node's RDMA device nodes
    (`rdma_devices`, what the node found under `RDMA_DEVICE_DIR`: ContractError when it has no
    verbs device), `IPC_LOCK` and an unlimited locked-memory limit. Every other hardening key stays.
    """
    runtime = assignment.runtime
    check_env(runtime.env)
    fabric = runtime.group.fabric if runtime.group is not None else FabricAccess.NONE
    device_nodes = _rdma_device_nodes(rdma_devices) if fabric is FabricAccess.RDMA else []
    if (runtime.artifact is None) != (artifact_path is None):
        # The supervisor fetches exactly the artifact the spec names: a mismatch is a bug.
        raise ValueError("artifact_path must be given exactly when the runtime has an artifact")
    if len(lora_paths) != len(runtime.loras):
        raise ValueError("lora_paths must give the fetched artifact of each of the runtime's LoRA adapters")
    if runtime.live_loras != (live_lora_dir is not None):
        raise ValueError("live_lora_dir must be given exactly when the runtime loads its adapters at run time")
    ro_mounts: list[tuple[str, str]] = []
    rw_mounts: list[tuple[str, str]] = []
    private = not runtime.host_network and fabric is FabricAccess.NONE and not is_simulated(runtime)
    bind_host, probe_host = (PRIVATE_BIND_HOST, PRIVATE_PROBE_HOST) if private else (host, host)
    if is_simulated(runtime):
        command = sim_command(assignment, artifact_path, host=host)
    else:
        command = with_host(runtime.command, bind_host)
        if runtime.artifact is not None and artifact_path is not None:
            ro_mounts.append((str(artifact_path), runtime.artifact.mount_path))
        ro_mounts += [(str(p), lora.artifact.mount_path) for lora, p in zip(runtime.loras, lora_paths, strict=True)]
        if live_lora_dir is not None:
            ro_mounts.append((str(live_lora_dir), LIVE_LORA_MOUNT))
        if cache_dir is not None:
            rw_mounts.append((str(cache_dir), RUNTIME_CACHE_PATH))
    return ContainerSpec(
        name=container_name(assignment.id),
        image=runtime.image,
        command=command,
        env=dict(runtime.env),
        labels={
            LABEL_NODE: node_id,
            LABEL_ASSIGNMENT: assignment.id,
            LABEL_DEPLOYMENT: assignment.deployment,
            LABEL_GENERATION: str(generation),
            LABEL_SPEC: spec_sha256(runtime),
            LABEL_KIND: str(runtime.kind),
            LABEL_PORT: str(runtime.port),
        },
        memory_bytes=runtime.memory_bytes,
        cpus=runtime.cpus,
        pids_limit=runtime.pids_limit,
        shm_bytes=runtime.shm_bytes if fabric is FabricAccess.NONE else max(runtime.shm_bytes, FABRIC_SHM_BYTES),
        devices=list(runtime.gpus),
        ro_mounts=ro_mounts,
        health=attrs.evolve(runtime.health, command=with_host(runtime.health.command, probe_host)),
        stop_timeout_s=runtime.stop_timeout_s,
        network=NETWORK_PRIVATE if private else NETWORK_HOST,
        publish_host=host if private else "",
        publish_port=runtime.port if private else 0,
        rw_mounts=rw_mounts,
        entrypoint=[] if is_simulated(runtime) else with_host(runtime.entrypoint, bind_host),
        device_nodes=device_nodes,
        cap_add=[CAP_IPC_LOCK] if fabric is FabricAccess.RDMA else [],
        memlock_unlimited=fabric is FabricAccess.RDMA,
    )


def _rdma_device_nodes(found: Sequence[str]) -> list[tuple[str, str]]:
    """The RDMA device nodes of `found` a group's container gets, each at its own path; ContractError
    when there is no verbs device among them (the node has no RDMA device, or its driver is not loaded)."""
    nodes = sorted({path for path in found if RDMA_DEVICE_RE.match(path)})
    if not any("/uverbs" in path for path in nodes):
        problem = f"runtime.group.fabric: rdma, but this node has no RDMA verbs device under {RDMA_DEVICE_DIR}"
        raise ContractError(
            f"{problem}; load the RDMA driver (rdma_ucm, ib_uverbs) on the node, or register the runtime "
            "with --fabric tcp",
            problems=(problem,),
        )
    return [(path, path) for path in nodes]


def image_digest(image: str) -> str:
    """The `sha256:<hex>` part of an image named by digest (`repo@sha256:<hex>`)."""
    return image.rpartition("@")[2]


def image_matches(state: ContainerState, image: str) -> bool:
    """Whether inspect shows the container runs exactly the assigned digest. The podman client
    reports `image_digest` from ImageDigest, or from the image's RepoDigests when they hold the
    exact reference the container was created by; a name alone (or an unknown digest) is not proof.
    """
    return state.image_digest == image_digest(image)
