"""The fabric contract: what a node may report of its RDMA devices and interfaces is bounded, an
inventory from before it decodes as an empty fabric, and the `fabric` label wins over discovery."""

from __future__ import annotations

import json
from typing import Any

import pytest

from nexa.contracts import codec
from nexa.contracts.fabric import Fabric, FabricInterface, RdmaDevice, RdmaPort, effective_fabric
from nexa.contracts.node import NodeInventory
from nexa.errors import ContractError

PORT: dict[str, Any] = {
    "number": 1,
    "state": "ACTIVE",
    "physical_state": "LinkUp",
    "rate": "200 Gb/sec (4X HDR)",
    "rate_gbps": 200.0,
    "link_layer": "Ethernet",
}
DEVICE: dict[str, Any] = {
    "name": "rocep1s0f0",
    "node_guid": "4cbb:4703:00f2:6a10",
    "ports": [PORT],
    "netdevs": ["enp1s0f0np0"],
}
IFACE: dict[str, Any] = {
    "name": "enp1s0f0np0",
    "addresses": ["192.168.100.10/24"],
    "mtu": 9000,
    "speed_mbps": 200000,
    "operstate": "up",
}
FABRIC: dict[str, Any] = {
    "devices": [DEVICE],
    "interfaces": [IFACE],
    "name": "ipv4:192.168.100.0/24",
    "address": "192.168.100.10",
}


def _inventory(fabric: object | None) -> dict[str, Any]:
    inv: dict[str, Any] = {
        "hostname": "spark-1",
        "arch": "arm64",
        "cpu_count": 20,
        "memory_total_bytes": 128 * 2**30,
        "memory_available_bytes": 100 * 2**30,
        "gpus": [],
        "labels": {},
        "taints": [],
        "data_classes": ["public"],
        "runtimes": ["llamacpp"],
        "accelerator_memory_bytes": 0,
        "discovered_at": 1.0,
    }
    if fabric is not None:
        inv["fabric"] = fabric
    return inv


def _decode(data: object) -> NodeInventory:
    return codec.loads(codec.wire, json.dumps(data), NodeInventory)


def test_a_good_fabric_round_trips_and_an_older_inventory_has_an_empty_one() -> None:
    inv = _decode(_inventory(FABRIC))
    assert inv.fabric.devices[0].ports[0] == RdmaPort(**PORT)
    assert inv.fabric.interface("enp1s0f0np0") == FabricInterface(**IFACE)
    assert inv.fabric.devices[0] == RdmaDevice(**{**DEVICE, "ports": [RdmaPort(**PORT)]})
    assert _decode(json.loads(codec.dumps(codec.wire, inv))) == inv
    assert _decode(_inventory(None)).fabric == Fabric()


def _with(path: str, value: object) -> dict[str, Any]:
    fabric = json.loads(json.dumps(FABRIC))
    *parents, last = path.split(".")
    here: Any = fabric
    for part in parents:
        here = here[int(part)] if part.isdigit() else here[part]
    here[int(last) if last.isdigit() else last] = value
    return fabric


@pytest.mark.parametrize(
    ("path", "value", "problem"),
    [
        ("devices", [DEVICE] * 65, "devices must be a list of at most 64"),
        ("devices.0.ports", [PORT] * 65, "ports must be a list of at most 64"),
        ("devices.0.netdevs", ["eth0"] * 65, "netdevs must be a list of at most 64"),
        ("interfaces", [IFACE] * 257, "interfaces must be a list of at most 256"),
        ("interfaces.0.addresses", ["10.0.0.1/8"] * 65, "addresses must be a list of at most 64"),
        ("devices.0.name", "x" * 65, "name: a name is 1-64"),
        ("devices.0.name", "mlx5\x1b[2J", "name: a name is 1-64"),
        ("devices.0.netdevs", ["has space"], "netdevs[0]: a name is 1-64"),
        ("devices.0.node_guid", "ffff", "node_guid: a node GUID"),
        ("devices.0.ports.0.number", -1, "number must be a whole number from 0 to 1023"),
        ("devices.0.ports.0.state", "A" * 65, "state: at most 64 printable ASCII"),
        ("devices.0.ports.0.rate", "fast\x1b]0;owned\x07", "rate: at most 64 printable ASCII"),
        ("devices.0.ports.0.rate_gbps", 1e12, "rate_gbps must be a finite number"),
        ("interfaces.0.addresses", ["192.168.100.10"], "addresses[0]: an address is in CIDR form"),
        ("interfaces.0.addresses", ["not-an-ip/24"], "addresses[0]: an address is in CIDR form"),
        ("interfaces.0.mtu", 1 << 40, "mtu must be a whole number"),
        ("interfaces.0.speed_mbps", -1, "speed_mbps must be a whole number"),
        ("interfaces.0.operstate", "u\u202ep", "operstate: at most 64 printable ASCII"),
        ("name", "rack-a", "name: a fabric name is ipv4:NETWORK or ipv6:NETWORK"),
        ("name", "ipv4:fd10::/64", "name: a fabric name is"),
        ("address", "192.168.100.10/24", "address: an address is an IPv4 or IPv6 address"),
    ],
)
def test_an_oversized_or_odd_fabric_is_refused_naming_the_field(path: str, value: object, problem: str) -> None:
    with pytest.raises(ContractError) as caught:
        _decode(_inventory(_with(path, value)))
    assert problem in " ".join(caught.value.problems or (caught.value.message,))


def test_the_fabric_label_wins_over_the_discovered_name() -> None:
    discovered = Fabric(name="ipv4:192.168.100.0/24", address="192.168.100.10")
    assert effective_fabric({}, discovered) == "ipv4:192.168.100.0/24"
    assert effective_fabric({"fabric": "spark-pair-a"}, discovered) == "spark-pair-a"
    assert effective_fabric({"fabric": ""}, discovered) == "ipv4:192.168.100.0/24"
    assert effective_fabric({"fabric": "spark-pair-a"}, None) == "spark-pair-a"
    assert effective_fabric({}, None) is None and effective_fabric({}, Fabric()) is None
