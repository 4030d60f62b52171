"""Fabric access proven on running containers, on every engine (libpod, podman's Docker API, dockerd;
tests/realparts.py), as the hardening tests do: a replica group's rank whose runtime is registered
with `--fabric rdma` runs with IPC_LOCK as its only capability, an unlimited locked-memory limit, a
16 GiB /dev/shm and its RDMA device node, on an otherwise hardened container (issue 33, point 4).

This machine has no RDMA device (/dev/infiniband does not exist), so the node's device list names
`/dev/infiniband/uverbs0` and the test maps the harmless character device /dev/zero (1:5) there:
what the container must show is the same (a character device at that path it may open and read).
Nor may it raise a hard resource limit (no CAP_SYS_RESOURCE in the sandbox): there the unlimited
memlock is shown reaching the OCI runtime (which refuses it, as the kernel says) and the rest is
proven on a container without it; where the capability exists, `ulimit -l` is checked inside.
"""

from __future__ import annotations

import uuid

import attrs
import pytest
import trio

from nexa import container_spec
from nexa.contracts import wire
from nexa.contracts.groups import FabricAccess, GroupMember, GroupRole
from nexa.contracts.node import RuntimeKind
from nexa.contracts.runtime import HealthProbe, RuntimeSpec
from nexa.errors import EngineError
from nexa.node.engines.interface import ContainerEngine
from tests.realparts import BuiltImages

TIMEOUT_S = 60
MiB = 1024 * 1024
UVERBS = "/dev/infiniband/uverbs0"
#: Each check exits with its own code, so a failure names what failed.
SCRIPT = (
    # IPC_LOCK (bit 14) and nothing else, as the kernel holds it.
    "grep -q '^CapEff:\t0000000000004000$' /proc/self/status || exit 11; "
    "grep -q '^CapPrm:\t0000000000004000$' /proc/self/status || exit 12; "
    "grep -q '^NoNewPrivs:\t1$' /proc/self/status || exit 13; "
    'test "$(ulimit -l)" = unlimited || exit 14; '
    "grep -q ' /dev/shm tmpfs .*size=16777216k' /proc/mounts || exit 15; "
    f"test -c {UVERBS} || exit 16; "
    f'test "$(stat -c %t:%T {UVERBS})" = 1:5 || exit 17; '
    f'test "$(head -c 4 {UVERBS} | wc -c)" = 4 || exit 18; '
    # The rest of the hardening stays: a read-only root, a writable /tmp.
    "touch /rootfs-write 2>/dev/null && exit 19; "
    "touch /tmp/ok || exit 20; "
    "exit 0"
)


def rank_spec(image: str, fabric: FabricAccess, script: str) -> RuntimeSpec:
    members = [GroupMember(rank=r, node_id=f"spark-{r + 1}", address=f"10.10.0.{r + 1}", port=50052) for r in (0, 1)]
    return RuntimeSpec(
        kind=RuntimeKind.LLAMACPP,
        image=image,
        command=["/bin/sh", "-c", script],
        port=18300,
        memory_bytes=64 * MiB,
        cpus=0.5,
        pids_limit=64,
        health=HealthProbe(command=["true"], timeout_s=5, start_period_s=0, retries=1),
        stop_timeout_s=1.0,
        group=GroupRole(group="g", rank=1, members=members, fabric=fabric),
    )


async def _exit_code(engine: ContainerEngine, container_id: str) -> int:
    with trio.fail_after(TIMEOUT_S):
        while True:
            state = await engine.inspect(container_id)
            if state.exited:
                assert state.exit_code is not None
                return state.exit_code
            await trio.sleep(0.1)


def can_raise_limits() -> bool:
    """Whether this machine may raise a hard resource limit: CAP_SYS_RESOURCE (bit 24) in our own
    effective set. The sandbox the suite runs in drops it (its hard memlock limit is 8 MiB), which a
    root podman or dockerd on a real node has."""
    with open("/proc/self/status") as status:
        caps = next(line for line in status if line.startswith("CapEff:"))
    return bool(int(caps.split()[1], 16) & (1 << 24))


async def test_an_rdma_rank_runs_with_ipc_lock_unlimited_memlock_its_device_and_the_rest_hardened(
    engine: ContainerEngine, test_images: BuiltImages, run_labels: dict[str, str]
) -> None:
    assignment = wire.Assignment(
        id=f"a-{uuid.uuid4().hex[:12]}",
        deployment="d1",
        runtime=rank_spec(test_images.busybox, FabricAccess.RDMA, SCRIPT),
    )
    spec = container_spec.container_spec("n1", assignment, 1, None, rdma_devices=[UVERBS, "/dev/infiniband/umad0"])
    assert spec.device_nodes == [(UVERBS, UVERBS)] and spec.memlock_unlimited
    # No /dev/infiniband here: /dev/zero stands in for the verbs device, at the same container path.
    spec = attrs.evolve(spec, device_nodes=[("/dev/zero", UVERBS)], labels={**spec.labels, **run_labels})
    if not can_raise_limits():
        # The engine passes the limit to the OCI runtime, which this machine does not let raise it:
        # the start fails with the kernel's refusal (podman adds its own open-files default beside it,
        # `pkg/specgen/generate/oci.go`, and that is refused first). Then the rest is proven without it.
        cid = await engine.create(attrs.evolve(spec, name=f"{spec.name}-memlock"))
        with pytest.raises(EngineError, match=r"setting rlimit type [78]: operation not permitted"):
            await engine.start(cid)
        unlimited = 'test "$(ulimit -l)" = unlimited || exit 14; '
        assert unlimited in SCRIPT
        spec = attrs.evolve(spec, memlock_unlimited=False, command=["/bin/sh", "-c", SCRIPT.replace(unlimited, "")])
    cid = await engine.create(spec)
    await engine.start(cid)
    assert await _exit_code(engine, cid) == 0


async def test_without_the_rdma_opt_in_a_rank_has_no_capability_no_device_and_the_default_memlock(
    engine: ContainerEngine, test_images: BuiltImages, run_labels: dict[str, str]
) -> None:
    script = (
        "grep -q '^CapEff:\t0000000000000000$' /proc/self/status || exit 11; "
        'test "$(ulimit -l)" != unlimited || exit 12; '
        "test -e /dev/infiniband && exit 13; "
        "grep -q ' /dev/shm tmpfs .*size=16777216k' /proc/mounts || exit 14; "  # tcp: the larger /dev/shm
        "exit 0"
    )
    assignment = wire.Assignment(
        id=f"a-{uuid.uuid4().hex[:12]}",
        deployment="d1",
        runtime=rank_spec(test_images.busybox, FabricAccess.TCP, script),
    )
    spec = container_spec.container_spec("n1", assignment, 1, None, rdma_devices=[UVERBS])
    spec = attrs.evolve(spec, labels={**spec.labels, **run_labels})
    cid = await engine.create(spec)
    await engine.start(cid)
    assert await _exit_code(engine, cid) == 0
