"""What a replica runs and what placement is asked for it: the signed `wire.Assignment` a node
runs (`assignment_for`) and the `PlacementRequest` a deployment's replicas make (`placement_request`)."""

from __future__ import annotations

from collections.abc import Iterable

from nexa import adapters
from nexa.contracts.deployments import Deployment, DeploymentCreate, Replica
from nexa.contracts.models import ModelRecord, RuntimeRecord
from nexa.contracts.placement import MemoryLimit, PlacementRequest
from nexa.contracts.qualification import image_digest
from nexa.contracts.runtime import ArtifactRef, HealthProbe, RuntimeSpec
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
) -> Assignment:
    """The signed unit a node runs for one replica.

    Image and kind from the runtime record (pinned by digest); the model artifact
    (`artifact_ref`: a manifest's directory at `/models/<name>`, or one object at
    `/models/model`); memory from the deployment's resources (else the model's own figure);
    the replica's GPUs; `port` is the loopback port chosen for it on its node. The runtime
    kind's adapter (`nexa.adapters`) builds the command (the model's path, serving it under
    its registered name, bound to `{runtime_host}`), the readiness probe and /dev/shm from the
    deployment's settings; a non-empty `options.command` replaces the adapter's command and a
    non-empty `options.health_command` its probe. `sim` runs `options.command` as its flags,
    probed by `true`. The options' env is added to the adapter's.

    On a unified-memory node (`unified_pool_bytes`: its pool) the replica's memory becomes the
    runtime's own limit: the adapter's memory setting derived from the reservation and the
    pool (`_runtime_memory`), unless the operator set it.
    """
    options = dep.options
    command = list(options.command)
    env = dict(options.env)
    health = HealthProbe(command=list(options.health_command) or ["true"])
    shm_bytes = 0
    artifact = artifact_ref(model)
    if adapters.has_adapter(runtime.kind):
        adapter = adapters.adapter_for(runtime.kind, options.settings)
        limit = _memory_limit(dep, model, runtime)
        memory = None
        if limit is not None and unified_pool_bytes is not None:
            memory = limit.on(_memory(dep, model), unified_pool_bytes)
        launch = adapter.launch(
            model.name, options.settings, replica.gpus, port, model_path=artifact.model_path, memory=memory
        )
        command = command or launch.command
        env = {**launch.env, **env}
        health = HealthProbe(command=list(options.health_command)) if options.health_command else launch.health
        shm_bytes = launch.shm_bytes
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
            memory_bytes=_memory(dep, model),
            cpus=dep.resources.cpus,
            shm_bytes=shm_bytes,
            health=health,
            host_network=runtime.host_network,
        ),
    )


def _memory(dep: Deployment | DeploymentCreate, model: ModelRecord) -> int:
    return dep.resources.memory_bytes or model.memory_bytes


def _memory_limit(dep: Deployment | DeploymentCreate, model: ModelRecord, runtime: RuntimeRecord) -> MemoryLimit | None:
    """The runtime's memory setting on unified-memory nodes; None without an adapter, or with a
    full `options.command` (the operator owns that command line, flags and all)."""
    if not adapters.has_adapter(runtime.kind) or dep.options.command:
        return None
    adapter = adapters.adapter_for(runtime.kind, dep.options.settings)
    return adapter.memory_limit(dep.options.settings, weights_bytes=model.artifact.size_bytes)


def placement_request(
    dep: Deployment | DeploymentCreate,
    model: ModelRecord,
    runtime: RuntimeRecord,
    replicas: int,
    *,
    qualified: Iterable[tuple[str, str]] | None = None,
) -> PlacementRequest:
    """What placement is asked for `replicas` of `dep`. `qualified`: with `[placement]
    require_qualified`, the (arch, GPU model) pairs the runtime's image passed a qualification on
    (None: not required)."""
    spec = dep.placement
    return PlacementRequest(
        deployment=dep.name,
        replicas=replicas,
        runtime=runtime.kind,
        arch=spec.arch,
        image_archs=runtime.image_archs,
        memory_bytes=_memory(dep, model),
        accelerators=dep.resources.accelerators,
        artifact_sha256=model.artifact.sha256,
        data_classes=tuple(spec.data_classes),
        node_selector=dict(spec.node_selector),
        tolerations=tuple(spec.tolerations),
        policy=spec.policy,
        host_network=runtime.host_network,
        memory_limit=_memory_limit(dep, model, runtime),
        qualified=None if qualified is None else tuple(qualified),
        image_digest="" if qualified is None else image_digest(runtime.image),
    )
