"""What a replica runs and what placement is asked for it: the signed `wire.Assignment` a node
runs (`assignment_for`) and the `PlacementRequest` a deployment's replicas make (`placement_request`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Final

import attrs

from nexa import adapters
from nexa.adapters import entrypoints, lora
from nexa.adapters.base import LLAMA_CPP_PYTHON, LLAMA_SERVER, Adapter
from nexa.adapters.groups import launch_rank
from nexa.contracts.deployments import Deployment, DeploymentCreate, Replica
from nexa.contracts.groups import GroupRole
from nexa.contracts.kvcache import DEFAULT_KV_TYPE, KV_TYPE_BYTES_PER_32, GgufFigures
from nexa.contracts.models import ModelFormat, ModelRecord, RuntimeRecord
from nexa.contracts.placement import MemoryLimit, MemoryShare, PlacementRequest
from nexa.contracts.qualification import image_digest
from nexa.contracts.runtime import ArtifactRef, HealthProbe, LoraSpec, RuntimeSpec
from nexa.contracts.wire import Assignment


def artifact_ref(model: ModelRecord) -> ArtifactRef:
    """What a node fetches and mounts for `model`: a manifest's files, assembled as a directory
    at `/models/<name>`; an artifact registered as one object, that object at `/models/model`
    (the reference assignments have had since the first release, so their spec hash holds)."""
    artifact = model.artifact
    if not artifact.files:
        return ArtifactRef(uri=artifact.uri, sha256=artifact.sha256, size_bytes=artifact.size_bytes)
    manifest = artifact.manifest()
    return ArtifactRef(
        uri=artifact.uri,
        sha256=artifact.sha256 or manifest.digest,
        size_bytes=artifact.size_bytes or manifest.size_bytes,
        files=list(manifest.files),
        entry=manifest.entry,
        mount_path=f"/models/{model.name}",
    )


def assignment_for(
    dep: Deployment,
    replica: Replica,
    model: ModelRecord,
    runtime: RuntimeRecord,
    port: int,
    *,
    unified_pool_bytes: int | None = None,
    arch: str | None = None,
    role: GroupRole | None = None,
    loras: Sequence[tuple[str, ModelRecord]] = (),
    live_loras: bool = True,
) -> Assignment:
    """The signed unit a node runs for one replica, or with `role` for one rank of a group replica
    (`replica`: that rank's, its id and GPUs; the command is the rank's, `adapters.groups.launch_rank`).

    Image and kind from the runtime record (pinned by digest); the model artifact
    (`artifact_ref`: a manifest's directory at `/models/<name>`, or one object at
    `/models/model`); memory from the deployment's resources (else the model's own figure);
    the replica's GPUs; `port` is the loopback port chosen for it on its node. The runtime
    kind's adapter (`nexa.adapters`) builds the command (the model's path, serving it under
    its registered name, bound to `{runtime_host}`), the readiness probe and /dev/shm from the
    deployment's settings and extra_args (and the runtime's registered version); a non-empty
    `options.command` replaces the adapter's command and a non-empty `options.health_command`
    its probe. `sim` runs `options.command` as its flags, probed by `true`. The options' env is added to the adapter's.

    On a unified-memory node (`unified_pool_bytes`: its pool) the replica's memory becomes the
    runtime's own limit: the adapter's memory setting derived from the reservation and the
    pool (`_runtime_memory`), unless the operator set it.

    The container's entrypoint is set so the process is exactly that command, whatever the image's
    own entrypoint (`entrypoints.entrypoint_for`, from the image config of the node's architecture
    `arch` that the controller read at registration): the command's program, or the image's exec
    wrapper in front of the whole command.

    `loras`: the LoRA adapters aliases serve on `model` ((alias, adapter) each, `ModelRegistry.loras_on`),
    given to a replica on one node of a runtime that loads them (`nexa.adapters.lora`) with the
    runtime's flags for them. A runtime that loads them at start (llama-server, SGLang without its
    pool's shape set) has each adapter's artifact in its spec (`RuntimeSpec.loras`, mounted at
    `/models/lora/<alias>`); one that loads them at run time (vLLM, sim, SGLang given
    `max_lora_rank` and `lora_target_modules`: `lora.loads_at_run_time`) has them in the
    assignment (`Assignment.loras`, named `<alias>@<version>`, outside the spec: `live_loras`),
    where an alias may be given twice, its earlier and its new version, while an adapter rollout
    in place soaks; its flags depend on the aliases alone, with room for one version more
    (`lora_args(spare=1)`). `live_loras` False: the node's protocol level is below
    `wire.LIVE_LORAS_PROTOCOL` (an earlier release): in the spec.
    """
    options = dep.options
    command = list(options.command)
    env = dict(options.env)
    health = HealthProbe(command=list(options.health_command) or ["true"])
    shm_bytes = 0
    artifact = artifact_ref(model)
    adapter = adapters.adapter_for(runtime.kind, options.settings) if adapters.has_adapter(runtime.kind) else None
    given = [lora_spec(name, record) for name, record in loras] if role is None else []
    given = given if lora.loads_loras(runtime.kind, adapter) else []
    live: list[LoraSpec] = []
    if given and live_loras and lora.loads_at_run_time(runtime.kind, options.settings):
        live = live_lora_specs(loras)
        given = [g for i, g in enumerate(given) if all(g.name != h.name for h in given[:i])]
    mounted = [(g.name, g.artifact.model_path) for g in given]
    spare = 1 if live else 0
    if adapter is not None:
        limit = _memory_limit(dep, model, runtime)
        memory = None
        if limit is not None and unified_pool_bytes is not None:
            memory = limit.on(rank_bytes(dep, model), unified_pool_bytes)
        if role is None:
            launch = adapter.launch(
                model.name,
                options.settings,
                replica.gpus,
                port,
                model_path=artifact.model_path,
                memory=memory,
                extra_args=options.extra_args,
                version=runtime.version,
                model_dir=artifact.mount_path,
            )
        else:
            launch = launch_rank(
                adapter,
                model.name,
                options.settings,
                replica.gpus,
                port,
                role=role,
                model_path=artifact.model_path,
                memory=memory,
                extra_args=options.extra_args,
                version=runtime.version,
                model_dir=artifact.mount_path,
            )
        extra, lora_env = lora.lora_args(
            runtime.kind, options.settings, launch.command, mounted, spare=spare, live=bool(live)
        )
        command = command or [*launch.command, *extra]
        env = {**launch.env, **lora_env, **env}
        health = HealthProbe(command=list(options.health_command)) if options.health_command else launch.health
        shm_bytes = launch.shm_bytes
    elif given:  # sim: its flags are the deployment's command
        command += lora.lora_args(runtime.kind, options.settings, command, mounted, spare=spare)[0]
    entrypoint: list[str] = []
    if adapters.has_adapter(runtime.kind):
        split = entrypoints.entrypoint_for(command, runtime.image_config(arch))
        entrypoint, command = split.entrypoint, split.command
    return Assignment(
        id=replica.id,
        deployment=dep.name,
        runtime=RuntimeSpec(
            kind=runtime.kind,
            image=runtime.image,
            command=command,
            env=env,
            port=port,
            artifact=artifact,
            gpus=list(replica.gpus),
            memory_bytes=rank_bytes(dep, model),
            cpus=dep.resources.cpus,
            shm_bytes=shm_bytes,
            health=health,
            host_network=runtime.host_network,
            entrypoint=entrypoint,
            group=role,
            loras=[] if live else given,
            live_loras=bool(live),
        ),
        loras=live,
    )


def live_lora_specs(loras: Sequence[tuple[str, ModelRecord]]) -> list[LoraSpec]:
    """Adapters a runtime loads at run time, as its assignment gives them (`Assignment.loras`): each
    (alias, adapter version) named `<alias>@<version>`."""
    return [lora_spec(f"{name}@{record.version}", record) for name, record in loras]


def lora_spec(name: str, adapter: ModelRecord) -> LoraSpec:
    """A LoRA adapter as a replica is given it: its artifact mounted at `/models/lora/<name>`."""
    ref = artifact_ref(adapter)
    return LoraSpec(name=name, artifact=attrs.evolve(ref, mount_path=f"{lora.LORA_MOUNT_ROOT}/{name}"))


def declared_bytes(dep: Deployment | DeploymentCreate, model: ModelRecord) -> int:
    """A replica's declared memory: the deployment's `resources.memory_bytes`, else the model's."""
    return dep.resources.memory_bytes or model.memory_bytes


def rank_share(total: int, dep: Deployment | DeploymentCreate) -> int:
    """One rank's even share of a replica's `total` bytes (rounded up); the whole on one node."""
    return -(-total // dep.nodes_per_replica)


def rank_bytes(dep: Deployment | DeploymentCreate, model: ModelRecord) -> int:
    """What each rank of a replica declares on its own node: an even share of `declared_bytes`
    over the replica's `nodes_per_replica` (all of it for a replica on one node)."""
    return rank_share(declared_bytes(dep, model), dep)


def _memory_limit(dep: Deployment | DeploymentCreate, model: ModelRecord, runtime: RuntimeRecord) -> MemoryLimit | None:
    """The runtime's memory setting on unified-memory nodes (llama.cpp's: its context); None
    without an adapter, or with a full `options.command` (the operator owns that command line,
    flags and all)."""
    if not adapters.has_adapter(runtime.kind) or dep.options.command:
        return None
    adapter = adapters.adapter_for(runtime.kind, dep.options.settings)
    # Each rank holds its share of the weights.
    limit = adapter.memory_limit(dep.options.settings, weights_bytes=rank_share(model.artifact.size_bytes, dep))
    return limit if limit is not None else _context_limit(dep, model, runtime, adapter)


@attrs.frozen
class _ContextSettings:
    """The settings of a llama.cpp variant that size its KV cache, and the batch it takes by default."""

    context: str
    batch: str
    batch_default: int
    cache_type_k: str | None = None
    cache_type_v: str | None = None


#: llama-server (`common/common.h`: `n_batch` 2048) and llama-cpp-python (`ModelSettings.n_batch`
#: 512). llama.cpp holds the physical batch (`--ubatch-size`, 512) to the logical one itself.
_CONTEXT_SETTINGS: Final = {
    LLAMA_SERVER: _ContextSettings("ctx_size", "batch_size", 2048, "cache_type_k", "cache_type_v"),
    LLAMA_CPP_PYTHON: _ContextSettings("n_ctx", "n_batch", 512),
}


def _context_limit(
    dep: Deployment | DeploymentCreate, model: ModelRecord, runtime: RuntimeRecord, adapter: Adapter
) -> MemoryLimit | None:
    """llama.cpp's context as its memory bound (`MemoryShare.CONTEXT`), from the KV cache per token
    of the model's GGUF figures and the cache types set; None for a runtime that has no context."""
    names = _CONTEXT_SETTINGS.get(adapter.name)
    if names is None:
        return None
    settings = dep.options.settings
    given = settings.get(names.context)
    operator = float(given) if isinstance(given, int) and not isinstance(given, bool) else None
    figures, why = gguf_figures(model)
    per_token = 0.0
    if figures is not None:
        types = [
            settings.get(name, DEFAULT_KV_TYPE) if name else DEFAULT_KV_TYPE
            for name in (names.cache_type_k, names.cache_type_v)
        ]
        type_k, type_v = (t if isinstance(t, str) and t in KV_TYPE_BYTES_PER_32 else DEFAULT_KV_TYPE for t in types)
        per_token = figures.kv_bytes_per_token(type_k, type_v)
    batch = "" if names.batch in settings else names.batch
    return MemoryLimit(
        setting=names.context,
        flag=adapter.options[names.context].flag,
        share_of=MemoryShare.CONTEXT,
        operator_value=operator,
        weights_bytes=rank_share(model.artifact.size_bytes, dep),
        kv_bytes_per_token=per_token,
        context_max=figures.context_length if figures is not None else 0,
        overhead_bytes=overhead_bytes(dep, runtime),
        batch_setting=batch,
        batch_flag=adapter.options[batch].flag if batch else "",
        batch_max=names.batch_default,
        unbounded="" if figures is not None else f"llama.cpp's context is not bounded by the reservation: {why}",
    )


def gguf_figures(model: ModelRecord) -> tuple[GgufFigures | None, str]:
    """The model's GGUF figures, read at verification, or None and why there are none."""
    v = model.verification
    if v is not None and v.gguf is not None:
        return v.gguf, ""
    if model.format is not ModelFormat.GGUF:
        return None, f"the model is {model.format}, not a GGUF"
    if v is None:
        return None, "the model version is not verified, so its GGUF header was not read"
    if v.gguf_problem:
        return None, f"its GGUF header could not be read ({v.gguf_problem})"
    return None, "it was verified before nexa read GGUF headers (register it again as a new version to have it read)"


def overhead_bytes(dep: Deployment | DeploymentCreate, runtime: RuntimeRecord) -> int:
    """The engine's own memory beyond the replica's: the deployment's figure, else its adapter's."""
    if dep.resources.overhead_bytes is not None:
        return dep.resources.overhead_bytes
    if not adapters.has_adapter(runtime.kind):
        return 0
    return adapters.adapter_for(runtime.kind, dep.options.settings).overhead_bytes


def reservation_bytes(
    dep: Deployment | DeploymentCreate, model: ModelRecord, runtime: RuntimeRecord, measured: int | None
) -> int:
    """What placement reserves for one replica (each rank of a group, on its own node): its memory
    plus the engine's overhead, or what a replica of the same runtime, model and settings was
    measured to hold, whichever is larger."""
    return max(rank_bytes(dep, model) + overhead_bytes(dep, runtime), measured or 0)


def placement_request(
    dep: Deployment | DeploymentCreate,
    model: ModelRecord,
    runtime: RuntimeRecord,
    replicas: int,
    *,
    measured: int | None = None,
    qualified: Iterable[tuple[str, str]] | None = None,
) -> PlacementRequest:
    """What placement is asked for `replicas` of `dep` (each a group of `dep.nodes_per_replica`
    ranks, asking what each rank needs on its own node). `qualified`: with `[placement]
    require_qualified`, the (arch, GPU model) pairs the runtime's image passed a qualification on
    (None: not required)."""
    spec = dep.placement
    return PlacementRequest(
        deployment=dep.name,
        replicas=replicas,
        runtime=runtime.kind,
        arch=spec.arch,
        image_archs=runtime.image_archs,
        memory_bytes=rank_bytes(dep, model),
        accelerators=dep.resources.accelerators,
        artifact_sha256=model.artifact.sha256,
        data_classes=tuple(spec.data_classes),
        node_selector=dict(spec.node_selector),
        tolerations=tuple(spec.tolerations),
        policy=spec.policy,
        host_network=runtime.host_network,
        memory_limit=_memory_limit(dep, model, runtime),
        reserve_bytes=reservation_bytes(dep, model, runtime, measured),
        qualified=None if qualified is None else tuple(qualified),
        image_digest="" if qualified is None else image_digest(runtime.image),
        nodes_per_replica=dep.nodes_per_replica,
    )
