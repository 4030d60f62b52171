"""Fabric discovery (`nexa.node.fabric`) against sysfs fixture trees laid out as real hosts'
(tests/fixtures/sysfs/README.md says where the layout and values come from), hostile trees made
from them, and the kernel's own addresses read over rtnetlink in a network namespace the test makes.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from nexa.contracts import codec
from nexa.contracts.fabric import Fabric, FabricInterface, RdmaDevice, RdmaPort
from nexa.node.fabric import discover_fabric, parse_addr_dump, parse_rate_gbps, read_attr
from nexa.node.inventory import discover
from tests.conftest import FIXTURES

SPARK = FIXTURES / "sysfs" / "dgx-spark"
IB_HOST = FIXTURES / "sysfs" / "infiniband-host"
SPARK_ADDRESSES = {
    "enp1s0f0np0": ["192.168.100.10/24", "fe80::4ebb:47ff:fef2:6a10/64"],
    "enp1s0f1np1": ["192.168.101.10/24"],
    "enP7s7": ["10.0.0.5/24"],  # the management port: no RDMA device, never reported
}


def _copy(tree: Path, tmp_path: Path) -> Path:
    root = tmp_path / "sys"
    shutil.copytree(tree, root)
    return root


def test_a_dgx_spark_with_one_cable_reports_its_active_roce_ports_and_the_fabric() -> None:
    fabric, problems = discover_fabric(SPARK, addresses=lambda: SPARK_ADDRESSES)
    assert problems == ()
    assert [d.name for d in fabric.devices] == ["roceP2p1s0f0", "roceP2p1s0f1", "rocep1s0f0", "rocep1s0f1"]
    up = next(d for d in fabric.devices if d.name == "rocep1s0f0")
    assert up == RdmaDevice(
        name="rocep1s0f0",
        node_guid="4cbb:4703:00f2:6a10",
        ports=[
            RdmaPort(
                number=1,
                state="ACTIVE",
                physical_state="LinkUp",
                rate="200 Gb/sec (4X HDR)",
                rate_gbps=200.0,
                link_layer="Ethernet",
            )
        ],
        netdevs=["enp1s0f0np0"],
    )
    down = next(d for d in fabric.devices if d.name == "roceP2p1s0f0")
    assert (down.ports[0].state, down.ports[0].physical_state) == ("DOWN", "Disabled")
    assert [i.name for i in fabric.interfaces] == ["enP2p1s0f0np0", "enP2p1s0f1np1", "enp1s0f0np0", "enp1s0f1np1"]
    assert fabric.interface("enp1s0f0np0") == FabricInterface(
        name="enp1s0f0np0",
        addresses=["192.168.100.10/24", "fe80::4ebb:47ff:fef2:6a10/64"],
        mtu=9000,
        speed_mbps=200000,
        operstate="up",
    )
    # A link that is down reports speed -1 (SPEED_UNKNOWN): not a figure.
    assert fabric.interface("enP2p1s0f0np0") == FabricInterface(
        name="enP2p1s0f0np0", addresses=[], mtu=1500, speed_mbps=None, operstate="down"
    )
    # The fabric is the network of the first interface carrying an ACTIVE port (devices by name).
    assert (fabric.name, fabric.address) == ("ipv4:192.168.100.0/24", "192.168.100.10")
    # What the node reports decodes as the controller decodes it.
    assert codec.loads(codec.wire, codec.dumps(codec.wire, fabric), Fabric) == fabric


def test_an_infiniband_port_down_and_a_device_without_a_netdev() -> None:
    asked: list[bool] = []

    def addresses() -> dict[str, list[str]]:
        asked.append(True)
        return {"ibp3s0": ["10.20.0.3/16"]}

    fabric, problems = discover_fabric(IB_HOST, addresses=addresses)
    assert problems == ()
    down, no_netdev = fabric.devices
    assert down.name == "ibp3s0" and down.netdevs == ["ibp3s0"]
    assert down.ports == [
        RdmaPort(
            number=1,
            state="DOWN",
            physical_state="Polling",
            rate="10 Gb/sec (4X SDR)",
            rate_gbps=10.0,
            link_layer="InfiniBand",
        )
    ]
    assert no_netdev.name == "ibp4s0" and no_netdev.netdevs == []
    assert no_netdev.ports[0].active and no_netdev.ports[0].rate_gbps == 400.0
    assert [i.name for i in fabric.interfaces] == ["ibp3s0"] and asked == [True]
    # The only interface with an address carries no ACTIVE port; the active device has no interface.
    assert (fabric.name, fabric.address) == (None, None)


def test_ipv6_when_no_ipv4_and_never_a_link_local_one(tmp_path: Path) -> None:
    only_v6 = {"enp1s0f0np0": ["fe80::1/64", "fd10::5/64"]}
    fabric, _ = discover_fabric(SPARK, addresses=lambda: only_v6)
    assert (fabric.name, fabric.address) == ("ipv6:fd10::/64", "fd10::5")
    fabric, _ = discover_fabric(SPARK, addresses=lambda: {"enp1s0f0np0": ["fe80::1/64"]})
    assert (fabric.name, fabric.address) == (None, None)
    # The second active function's IPv4 address wins over the first's IPv6 one.
    fabric, _ = discover_fabric(SPARK, addresses=lambda: {**only_v6, "enp1s0f1np1": ["192.168.101.10/24"]})
    assert (fabric.name, fabric.address) == ("ipv4:192.168.101.0/24", "192.168.101.10")


def test_a_host_without_rdma_devices_has_an_empty_fabric_and_addresses_are_not_asked(tmp_path: Path) -> None:
    def never() -> dict[str, list[str]]:
        raise AssertionError("addresses asked without an RDMA interface")

    assert discover_fabric(tmp_path / "no-such-sys", addresses=never) == (Fabric(), ())
    (tmp_path / "sys" / "class" / "infiniband").mkdir(parents=True)
    assert discover_fabric(tmp_path / "sys", addresses=never) == (Fabric(), ())


def test_unreadable_and_hostile_files_are_unknown_never_a_crash(tmp_path: Path) -> None:
    root = _copy(SPARK, tmp_path)
    port = root / "class/infiniband/rocep1s0f0/ports/1"
    (port / "rate").write_bytes(b"2" * (1 << 20))  # a 1 MB "attribute"
    (port / "state").write_bytes(b"4: \xff\xfeACTIVE\n")  # not UTF-8
    (port / "phys_state").unlink()
    (port / "phys_state").mkdir()  # not a plain file
    (port / "link_layer").write_text("Ether\x1b[31mnet\n")  # a terminal escape
    (root / "class/net/enp1s0f0np0/mtu").unlink()
    os.mkfifo(root / "class/net/enp1s0f0np0/mtu")  # a FIFO no one writes: a blocking read would hang
    (root / "class/net/enp1s0f0np0/speed").write_text("99999999999999999999\n")
    (root / "class/net/enp1s0f0np0/operstate").write_text("x" * 100 + "\n")
    (root / "class/infiniband/rocep1s0f0/node_guid").write_text("not a guid\n")
    os.remove(root / "class/infiniband/rocep1s0f1/ports/1/state")
    (root / "class/infiniband/rocep1s0f1/ports/1/state").symlink_to("/nonexistent")  # dangling
    (root / "class/infiniband/rocep1s0f1/ports/notaport").mkdir()
    (root / "class/infiniband/bad\x1bname").mkdir()  # a name the contract refuses: left out
    (root / "class/infiniband/roceP2p1s0f0/device/net/has space").mkdir()

    fabric, problems = discover_fabric(root, addresses=lambda: {"enp1s0f0np0": ["192.168.100.10/24", "nonsense"]})
    assert problems == ()
    names = [d.name for d in fabric.devices]
    assert names == ["roceP2p1s0f0", "roceP2p1s0f1", "rocep1s0f0", "rocep1s0f1"]
    hostile = fabric.devices[2]
    assert hostile.node_guid is None
    assert hostile.ports == [
        RdmaPort(number=1, state=None, physical_state=None, rate=None, rate_gbps=None, link_layer=None)
    ]
    assert fabric.devices[3].ports == [
        RdmaPort(
            number=1,
            state=None,
            physical_state="LinkUp",
            rate="200 Gb/sec (4X HDR)",
            rate_gbps=200.0,
            link_layer="Ethernet",
        )
    ]
    assert fabric.devices[0].netdevs == ["enP2p1s0f0np0"]
    iface = fabric.interface("enp1s0f0np0")
    assert iface == FabricInterface(
        name="enp1s0f0np0", addresses=["192.168.100.10/24"], mtu=None, speed_mbps=None, operstate="unknown"
    )
    # No port is readably ACTIVE any more: no fabric identity.
    assert (fabric.name, fabric.address) == (None, None)
    assert codec.loads(codec.wire, codec.dumps(codec.wire, fabric), Fabric) == fabric


def test_too_many_devices_are_cut_to_the_contracts_bound_with_a_problem(tmp_path: Path) -> None:
    root = _copy(SPARK, tmp_path)
    template = root / "class/infiniband/rocep1s0f0"
    for i in range(70):
        shutil.copytree(template, root / f"class/infiniband/x{i:03d}")
    fabric, problems = discover_fabric(root, addresses=lambda: SPARK_ADDRESSES)
    assert len(fabric.devices) == 64
    assert problems == ("fabric: 74 RDMA devices; reporting the first 64",)
    assert codec.loads(codec.wire, codec.dumps(codec.wire, fabric), Fabric) == fabric


def test_an_address_reader_that_fails_is_a_problem_not_a_crash() -> None:
    def refused() -> dict[str, list[str]]:
        raise PermissionError(1, "Operation not permitted")

    fabric, problems = discover_fabric(SPARK, addresses=refused)
    assert problems == ("fabric: cannot read the interfaces' addresses: Operation not permitted",)
    assert len(fabric.interfaces) == 4 and all(not i.addresses for i in fabric.interfaces)
    assert fabric.name is None


@pytest.mark.parametrize(
    ("text", "gbps"),
    [
        ("200 Gb/sec (4X HDR)", 200.0),
        ("400 Gb/sec (4X NDR)", 400.0),
        ("2.5 Gb/sec (1X SDR)", 2.5),
        ("800 Gb/sec (4X XDR)", 800.0),
        ("fast", None),
        ("1e309 Gb/sec", None),
        (None, None),
    ],
)
def test_rates_as_the_kernel_prints_them(text: str | None, gbps: float | None) -> None:
    assert parse_rate_gbps(text) == gbps


def test_read_attr_reads_a_page_and_no_more(tmp_path: Path) -> None:
    page = tmp_path / "page"
    page.write_bytes(b"a" * 4096)
    assert read_attr(page) == "a" * 4096
    page.write_bytes(b"a" * 4097)
    assert read_attr(page) is None


def test_a_truncated_or_refused_netlink_answer(tmp_path: Path) -> None:
    out: dict[str, list[str]] = {}
    assert parse_addr_dump(b"\x10\x00", {}, out) is False and out == {}
    error = (36).to_bytes(4, "little") + (2).to_bytes(2, "little") + bytes(10) + (-1).to_bytes(4, "little", signed=True)
    with pytest.raises(OSError, match="not permitted"):
        parse_addr_dump(error + bytes(16), {}, out)


_IN_NAMESPACE = """
import json, sys
from nexa.node.fabric import discover_fabric, interface_addresses
fabric, problems = discover_fabric(sys.argv[1])
print(json.dumps({"addresses": interface_addresses(), "name": fabric.name, "address": fabric.address,
                  "iface": [[i.name, i.addresses, i.mtu, i.operstate] for i in fabric.interfaces]}))
"""


def test_the_kernels_addresses_over_rtnetlink_in_a_network_namespace(tmp_path: Path) -> None:
    """A veth named as a Spark's first ConnectX-7 function, with two IPv4 addresses and an IPv6 one,
    in a network namespace of the test's own; the fixture's RDMA device sits on it."""
    if shutil.which("unshare") is None or shutil.which("ip") is None or os.geteuid() != 0:
        pytest.skip("needs root, unshare and ip to make a network namespace")
    root = _copy(SPARK, tmp_path)
    script = (
        "set -e; ip link add enp1s0f0np0 type veth peer name peer0; "
        "ip addr add 192.168.100.10/24 dev enp1s0f0np0; ip addr add 10.9.0.1/16 dev enp1s0f0np0; "
        "ip -6 addr add fd10::5/64 dev enp1s0f0np0; "
        f'exec "{sys.executable}" -c "$0" "{root}"'
    )
    done = subprocess.run(
        ["unshare", "--net", "sh", "-c", script, _IN_NAMESPACE],
        capture_output=True,
        text=True,
        timeout=60,
        env={**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", str(Path.cwd()))},
        check=False,
    )
    assert done.returncode == 0, done.stderr
    seen = json.loads(done.stdout)
    # Only what the namespace has: its loopback is down and has no address.
    assert seen["addresses"] == {"enp1s0f0np0": ["192.168.100.10/24", "10.9.0.1/16", "fd10::5/64"]}
    assert (seen["name"], seen["address"]) == ("ipv4:192.168.100.0/24", "192.168.100.10")
    assert ["enp1s0f0np0", ["192.168.100.10/24", "10.9.0.1/16", "fd10::5/64"], 9000, "up"] in seen["iface"]


async def test_discovery_reports_the_fabric_and_its_problems(tmp_path: Path) -> None:
    host = await discover(None, meminfo_path=str(FIXTURES / "meminfo" / "h100_dgx_2t.meminfo"), sysfs_path=str(SPARK))
    assert [d.name for d in host.fabric.devices][2:] == ["rocep1s0f0", "rocep1s0f1"]
    assert not [p for p in host.problems if p.startswith("fabric")]
    assert socket.gethostname() == host.hostname
