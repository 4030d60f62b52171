"""Fabric access for a replica group's containers (issue 33, point 4): what the node's container
spec and both engines' create bodies get for `--fabric tcp` and `--fabric rdma`, pinned, and that
everything else keeps today's hardening. Pure: the running-container proof is in
tests/node/engines/test_fabric_containers.py."""

from __future__ import annotations

from pathlib import Path

import attrs
import pytest

from nexa import container_spec
from nexa.container_spec import FABRIC_SHM_BYTES
from nexa.contracts import wire
from nexa.contracts.groups import FabricAccess, GroupMember, GroupRole
from nexa.contracts.runtime import NETWORK_HOST, NETWORK_PRIVATE, ContainerSpec, RuntimeSpec
from nexa.errors import ContractError
from nexa.node.engines.common import validate_spec
from nexa.node.engines.docker import docker_create_body
from nexa.node.engines.libpod import RLIM_INFINITY, create_body
from nexa.node.rdma import rdma_device_nodes
from tests.conftest import sample_runtime

ARTIFACT = Path("/var/lib/nexa/artifacts/" + "1" * 64)
NODE_HOST = "127.0.0.12"
RDMA = ["/dev/infiniband/rdma_cm", "/dev/infiniband/uverbs0", "/dev/infiniband/umad0", "/dev/infiniband/issm0"]


def ranked(fabric: FabricAccess | None, **change: object) -> RuntimeSpec:
    fields: dict[str, object] = {"command": ["--host", "{runtime_host}", "--port", "18300"], "shm_bytes": 64 * 2**20}
    rt = attrs.evolve(sample_runtime(), **(fields | change))
    if fabric is None:
        return rt
    members = [GroupMember(rank=r, node_id=f"spark-{r + 1}", address=f"10.10.0.{r + 1}", port=50052) for r in (0, 1)]
    return attrs.evolve(rt, group=GroupRole(group="g", rank=1, members=members, fabric=fabric))


def spec_for(rt: RuntimeSpec, rdma: list[str] | None = None) -> ContainerSpec:
    assignment = wire.Assignment(id="a1", deployment="d1", runtime=rt)
    return container_spec.container_spec("n1", assignment, 1, ARTIFACT, host=NODE_HOST, rdma_devices=rdma or [])


def test_without_the_opt_in_a_group_member_keeps_every_hardening_key() -> None:
    plain = spec_for(ranked(None))
    member = spec_for(ranked(FabricAccess.NONE), RDMA)
    for spec in (plain, member):
        assert (spec.network, spec.publish_host, spec.publish_port) == (NETWORK_PRIVATE, NODE_HOST, 18300)
        assert (spec.device_nodes, spec.cap_add, spec.memlock_unlimited) == ([], [], False)
        assert spec.shm_bytes == 64 * 2**20
        body = create_body(spec)
        assert body["cap_add"] == [] and "r_limits" not in body
        assert body["devices"] == [{"path": "nvidia.com/gpu=0"}]
        assert "Devices" not in (host := docker_create_body(spec)["HostConfig"]) and "Ulimits" not in host
    assert attrs.evolve(member, labels={}) == attrs.evolve(plain, labels={})  # only the spec's digest differs


def test_tcp_gives_the_nodes_network_namespace_and_a_larger_dev_shm() -> None:
    spec = spec_for(ranked(FabricAccess.TCP), RDMA)
    assert spec.network == NETWORK_HOST and (spec.publish_host, spec.publish_port) == ("", 0)
    assert spec.command == ["--host", NODE_HOST, "--port", "18300"]  # the API stays on the runtime address
    assert spec.shm_bytes == FABRIC_SHM_BYTES == 16 * 2**30
    assert (spec.device_nodes, spec.cap_add, spec.memlock_unlimited) == ([], [], False)
    # A larger /dev/shm the runtime already asks for stays.
    assert spec_for(ranked(FabricAccess.TCP, shm_bytes=32 * 2**30)).shm_bytes == 32 * 2**30


def test_rdma_adds_the_verbs_devices_ipc_lock_and_unlimited_memlock_on_both_engines() -> None:
    spec = spec_for(ranked(FabricAccess.RDMA), RDMA)
    assert spec.network == NETWORK_HOST and spec.shm_bytes == FABRIC_SHM_BYTES
    # The verbs device and the connection manager; never the subnet-management nodes (umad, issm).
    assert spec.device_nodes == [
        ("/dev/infiniband/rdma_cm", "/dev/infiniband/rdma_cm"),
        ("/dev/infiniband/uverbs0", "/dev/infiniband/uverbs0"),
    ]
    assert (spec.cap_add, spec.memlock_unlimited) == (["IPC_LOCK"], True)
    validate_spec(spec)

    body = create_body(spec)
    assert body["devices"] == [
        {"path": "nvidia.com/gpu=0"},
        {"path": "/dev/infiniband/rdma_cm:/dev/infiniband/rdma_cm:rwm"},
        {"path": "/dev/infiniband/uverbs0:/dev/infiniband/uverbs0:rwm"},
    ]
    assert body["cap_drop"] == ["all"] and body["cap_add"] == ["CAP_IPC_LOCK"]
    assert body["r_limits"] == [{"type": "memlock", "hard": RLIM_INFINITY, "soft": RLIM_INFINITY}]
    assert RLIM_INFINITY == 18_446_744_073_709_551_615
    assert body["shm_size"] == FABRIC_SHM_BYTES and body["netns"] == {"nsmode": "host"}
    assert (body["read_only_filesystem"], body["no_new_privileges"], body["privileged"]) == (True, True, False)
    assert body["resource_limits"]["pids"] == {"limit": 4096}

    host = docker_create_body(spec)["HostConfig"]
    assert host["Devices"] == [
        {"PathOnHost": p, "PathInContainer": p, "CgroupPermissions": "rwm"}
        for p in ("/dev/infiniband/rdma_cm", "/dev/infiniband/uverbs0")
    ]
    assert host["CapDrop"] == ["ALL"] and host["CapAdd"] == ["CAP_IPC_LOCK"]
    assert host["Ulimits"] == [{"Name": "memlock", "Soft": -1, "Hard": -1}]
    assert host["ShmSize"] == FABRIC_SHM_BYTES and host["NetworkMode"] == "host"
    assert (host["ReadonlyRootfs"], host["SecurityOpt"], host["Privileged"]) == (True, ["no-new-privileges"], False)
    assert host["PidsLimit"] == 4096


def test_rdma_on_a_node_without_rdma_devices_is_refused_saying_what_to_do() -> None:
    for found in ([], ["/dev/infiniband/rdma_cm", "/dev/infiniband/umad0"]):
        with pytest.raises(ContractError) as caught:
            spec_for(ranked(FabricAccess.RDMA), found)
        assert caught.value.problems == (
            "runtime.group.fabric: rdma, but this node has no RDMA verbs device under /dev/infiniband",
        )
        assert "--fabric tcp" in caught.value.message


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"cap_add": ["SYS_ADMIN"]}, "cap_add: 'SYS_ADMIN' is never added back (only IPC_LOCK)"),
        ({"device_nodes": [("/dev/sda", "/dev/sda")]}, "device_nodes: '/dev/sda' -> '/dev/sda'"),
        ({"device_nodes": [("/dev/../etc/x", "/dev/infiniband/uverbs0")]}, "must be a device under /dev"),
        ({"device_nodes": [("/tmp/uverbs0", "/dev/infiniband/uverbs0")]}, "must be a device under /dev"),
    ],
)
def test_the_engines_refuse_any_other_device_or_capability(change: dict[str, object], problem: str) -> None:
    spec = attrs.evolve(spec_for(ranked(None)), **change)
    with pytest.raises(ContractError) as caught:
        validate_spec(spec)
    assert any(problem in p for p in caught.value.problems), caught.value.problems


def test_the_node_lists_its_rdma_character_devices(tmp_path: Path) -> None:
    assert rdma_device_nodes(tmp_path / "absent") == []
    (tmp_path / "not-a-device").write_text("")
    assert rdma_device_nodes(tmp_path) == []
    assert rdma_device_nodes(Path("/dev")) == sorted(
        str(p) for p in Path("/dev").iterdir() if p.is_char_device()
    )  # (this machine has no /dev/infiniband: /dev itself shows the listing keeps character devices)
