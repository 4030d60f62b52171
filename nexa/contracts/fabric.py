"""A node's fabric: its RDMA devices, their ports, the network interfaces they sit on, and the fabric
identity placement groups nodes by (issue 33). Pure data and validation; no I/O.

A node reports this in its inventory (`NodeInventory.fabric`, discovered from sysfs by
`nexa.node.fabric`). Everything here comes from a node and is untrusted: every name, string, count
and figure is bounded, so an oversized or odd fabric fails the heartbeat's decoding (counted as
`malformed`) instead of reaching the store.

The fabric a node is on, for placement and a group's peers, is `effective_fabric`: the node's
`fabric` label when it has one (the admin's, or its inventory.json's for a node the admin gave
none), else the discovered `Fabric.name`.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Mapping
from typing import Any, Final

import attrs

from nexa.contracts.bounds import Validator, finite, whole

#: The label that names a node's fabric, overriding the discovered one (`effective_fabric`).
FABRIC_LABEL: Final = "fabric"
#: The most RDMA devices, ports per device, netdevs per device, interfaces and addresses per
#: interface one node reports (far above any machine: a DGX has 8-12 RDMA devices).
MAX_RDMA_DEVICES: Final = 64
MAX_RDMA_PORTS: Final = 64
MAX_NETDEVS: Final = 64
MAX_FABRIC_INTERFACES: Final = 256
MAX_ADDRESSES: Final = 64
#: Port numbers: 0 (a switch's management port) to 1023 (the kernel's u32, bounded to sense).
PORT_NUMBER_MAX: Final = 1023
#: Rates and interface speeds: up to 100 Tb/s.
RATE_GBPS_MAX: Final = 100_000.0
SPEED_MBPS_MAX: Final = 100_000_000
#: The largest MTU Linux allows on any interface (loopback's default is 65536).
MTU_MAX: Final = 1 << 20
#: An RDMA device or interface name: the kernel's IB_DEVICE_NAME_MAX is 64 (IFNAMSIZ is 16), and
#: udev's names are letters, digits and `-_.:@` (rocep1s0f1, mlx5_0, enP2p1s0f1np1, ib0.8001).
NAME_MAX: Final = 64
_NAME_RE: Final = re.compile(r"^[A-Za-z0-9][-A-Za-z0-9_.:@]{0,63}$")
#: A state, physical state, link layer, operstate or rate as the kernel prints it ("ACTIVE",
#: "LinkUp", "Phy Test", "<unknown>", "200 Gb/sec (4X HDR)"): printable ASCII.
TEXT_MAX: Final = 64
_TEXT_RE: Final = re.compile(r"^[ -~]{0,64}$")
#: A node GUID as sysfs prints it (`b83f:d203:00a1:2b3c`).
_GUID_RE: Final = re.compile(r"^[0-9a-fA-F]{4}(?::[0-9a-fA-F]{4}){3}$")
#: The longest fabric name: "ipv6:" and an IPv6 network in CIDR form.
FABRIC_NAME_MAX: Final = 64


def name_problem(value: str) -> str | None:
    """Why `value` is not a valid RDMA device or interface name, or None when it is."""
    if not _NAME_RE.match(value):
        return f"a name is 1-{NAME_MAX} letters, digits, '-', '_', '.', ':' or '@', starting with a letter or digit"
    return None


def text_problem(value: str) -> str | None:
    """Why `value` is not a valid sysfs text value (state, rate, ...), or None when it is."""
    if not _TEXT_RE.match(value):
        return f"at most {TEXT_MAX} printable ASCII characters"
    return None


def address_problem(value: str) -> str | None:
    """Why `value` is not an interface address in CIDR form (`192.168.100.10/24`), or None."""
    if "/" not in value or len(value) > 64:
        return "an address is in CIDR form, e.g. 192.168.100.10/24 or fd10::5/64"
    try:
        ipaddress.ip_interface(value)
    except ValueError:
        return "an address is in CIDR form, e.g. 192.168.100.10/24 or fd10::5/64"
    return None


def _checked(problem_of: Callable[[str], str | None], *, optional: bool = False) -> Validator:
    def check(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if value is None and optional:
            return
        if not isinstance(value, str):
            raise ValueError(f"{attribute.name} must be a string")
        problem = problem_of(value)
        if problem is not None:
            raise ValueError(f"{attribute.name}: {problem}")

    return check


def _each(limit: int, problem_of: Callable[[str], str | None]) -> Validator:
    def check(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not isinstance(value, list) or len(value) > limit:
            raise ValueError(f"{attribute.name} must be a list of at most {limit}")
        for i, item in enumerate(value):
            problem = problem_of(item) if isinstance(item, str) else "must be a string"
            if problem is not None:
                raise ValueError(f"{attribute.name}[{i}]: {problem}")

    return check


def _at_most(limit: int) -> Validator:
    def check(_: object, attribute: attrs.Attribute[Any], value: object) -> None:
        if not isinstance(value, list) or len(value) > limit:
            raise ValueError(f"{attribute.name} must be a list of at most {limit}")

    return check


def guid_problem(value: str) -> str | None:
    """Why `value` is not a node GUID as sysfs prints it, or None when it is."""
    return None if _GUID_RE.match(value) else "a node GUID is four groups of four hex digits (b83f:d203:00a1:2b3c)"


def _fabric_name_problem(value: str) -> str | None:
    family, colon, network = value.partition(":")
    if colon and family in ("ipv4", "ipv6") and len(value) <= FABRIC_NAME_MAX:
        try:
            net = ipaddress.ip_network(network)
        except ValueError:
            pass
        else:
            if f"ipv{net.version}" == family:
                return None
    return "a fabric name is ipv4:NETWORK or ipv6:NETWORK in CIDR form (ipv4:192.168.100.0/24)"


def _address_only_problem(value: str) -> str | None:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        return "an address is an IPv4 or IPv6 address without a prefix"
    return None


@attrs.frozen(kw_only=True)
class RdmaPort:
    """One port of an RDMA device, as `/sys/class/infiniband/<dev>/ports/<n>/` says (None: unreadable)."""

    number: int = attrs.field(validator=whole(0, PORT_NUMBER_MAX))
    #: The logical state without its number: "ACTIVE", "DOWN", "INIT", "ARMED".
    state: str | None = attrs.field(default=None, validator=_checked(text_problem, optional=True))
    #: The physical state without its number: "LinkUp", "Polling", "Disabled".
    physical_state: str | None = attrs.field(default=None, validator=_checked(text_problem, optional=True))
    #: As the kernel prints it: "200 Gb/sec (4X HDR)".
    rate: str | None = attrs.field(default=None, validator=_checked(text_problem, optional=True))
    rate_gbps: float | None = attrs.field(default=None, validator=finite(0.0, RATE_GBPS_MAX, optional=True))
    #: "InfiniBand" or "Ethernet" (RoCE).
    link_layer: str | None = attrs.field(default=None, validator=_checked(text_problem, optional=True))

    @property
    def active(self) -> bool:
        return self.state == "ACTIVE"


@attrs.frozen(kw_only=True)
class RdmaDevice:
    """One RDMA device (`/sys/class/infiniband/<name>`), its ports and the netdevs it sits on."""

    name: str = attrs.field(validator=_checked(name_problem))
    node_guid: str | None = attrs.field(default=None, validator=_checked(guid_problem, optional=True))
    ports: list[RdmaPort] = attrs.field(factory=list, validator=_at_most(MAX_RDMA_PORTS))
    #: Its network interfaces (RoCE: the Ethernet netdev; InfiniBand: the IPoIB one), by name.
    netdevs: list[str] = attrs.field(factory=list, validator=_each(MAX_NETDEVS, name_problem))


@attrs.frozen(kw_only=True)
class FabricInterface:
    """A network interface an RDMA device sits on (`/sys/class/net/<name>`) and its addresses."""

    name: str = attrs.field(validator=_checked(name_problem))
    #: CIDR form: "192.168.100.10/24", "fd10::5/64".
    addresses: list[str] = attrs.field(factory=list, validator=_each(MAX_ADDRESSES, address_problem))
    mtu: int | None = attrs.field(default=None, validator=whole(0, MTU_MAX, optional=True))
    #: None while the link is down or the driver does not say.
    speed_mbps: int | None = attrs.field(default=None, validator=whole(0, SPEED_MBPS_MAX, optional=True))
    #: "up", "down", "lowerlayerdown", "unknown", ... ("unknown": unreadable too).
    operstate: str = attrs.field(default="unknown", validator=_checked(text_problem))


@attrs.frozen(kw_only=True)
class Fabric:
    """What a node found of its fabric. Empty on a node without RDMA devices (and from older agents)."""

    devices: list[RdmaDevice] = attrs.field(factory=list, validator=_at_most(MAX_RDMA_DEVICES))
    interfaces: list[FabricInterface] = attrs.field(factory=list, validator=_at_most(MAX_FABRIC_INTERFACES))
    #: The fabric's identity as discovered: the network of the first interface that carries an
    #: ACTIVE RDMA port, IPv4 preferred ("ipv4:192.168.100.0/24"); None without one.
    name: str | None = attrs.field(default=None, validator=_checked(_fabric_name_problem, optional=True))
    #: That interface's address ("192.168.100.10"): where the node's group peers reach it.
    address: str | None = attrs.field(default=None, validator=_checked(_address_only_problem, optional=True))

    def interface(self, name: str) -> FabricInterface | None:
        return next((i for i in self.interfaces if i.name == name), None)


def effective_fabric(labels: Mapping[Any, str], fabric: Fabric | None) -> str | None:
    """The fabric a node is on: its `fabric` label when set and not empty, else the discovered name.
    `labels` are the node's merged labels (`control.fleet.grants.labels`; keys are str or LabelKey)."""
    label = labels.get(FABRIC_LABEL)
    if label:
        return label
    return fabric.name if fabric is not None else None
