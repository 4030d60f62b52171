"""Fabric discovery: the host's RDMA devices (sysfs), the interfaces they sit on and their addresses.

Reads only sysfs (`<sysfs>/class/infiniband`, `<sysfs>/class/net`) and asks the kernel for the
interfaces' addresses over rtnetlink (the stdlib's AF_NETLINK socket; `ip addr` asks the same way).
The sysfs root is a parameter (`[node] sysfs_path`) so tests read a fixture tree. Nothing here
raises on what it finds: a missing `class/infiniband` is an empty fabric, an unreadable or odd file
(not a plain file, longer than a page, not UTF-8, not the kernel's format) is that field None, a
name the contract would refuse is left out, and too many of anything are cut to the contract's
bounds with a problem line, so a node always reports a fabric the controller accepts.
"""

from __future__ import annotations

import ipaddress
import logging
import os
import re
import socket
import stat
import struct
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Final

from nexa.contracts.bounds import in_range
from nexa.contracts.fabric import (
    MAX_ADDRESSES,
    MAX_FABRIC_INTERFACES,
    MAX_NETDEVS,
    MAX_RDMA_DEVICES,
    MAX_RDMA_PORTS,
    MTU_MAX,
    PORT_NUMBER_MAX,
    RATE_GBPS_MAX,
    SPEED_MBPS_MAX,
    Fabric,
    FabricInterface,
    RdmaDevice,
    RdmaPort,
    address_problem,
    guid_problem,
    name_problem,
    text_problem,
)

log = logging.getLogger(__name__)

DEFAULT_SYSFS_PATH: Final = "/sys"
#: A sysfs attribute is at most one page; anything longer is not one.
ATTR_MAX_BYTES: Final = 4096
#: Directory entries read per listing before giving up on the rest (a hostile tree's million files).
_LIST_MAX: Final = 4096
#: GID table entries whose netdev is read for a device without `device/net` (rxe, some VFs):
#: RoCE puts each netdev's default GIDs first.
_GID_NDEVS: Final = 16
#: "4: ACTIVE", "5: LinkUp": the kernel's number, a colon, the name.
_NUMBERED_RE: Final = re.compile(r"^\d+: (.+)$")
#: "200 Gb/sec (4X HDR)", "2.5 Gb/sec (1X SDR)".
_RATE_RE: Final = re.compile(r"^(\d+(?:\.\d+)?) Gb/sec\b")

#: Interface name -> its addresses in CIDR form.
Addresses = Mapping[str, list[str]]


def read_attr(path: Path) -> str | None:
    """A sysfs attribute's text, stripped; None when missing, unreadable, not a plain file, longer
    than a page or not UTF-8. Opened non-blocking: a FIFO or device planted in the tree never hangs."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        raw = os.read(fd, ATTR_MAX_BYTES + 1)
    except OSError:
        return None  # e.g. `speed` of a link that is down: EINVAL
    finally:
        os.close(fd)
    if len(raw) > ATTR_MAX_BYTES:
        return None
    try:
        return raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None


def _listing(path: Path) -> list[str]:
    """The names in a directory, sorted; [] when it is missing or unreadable."""
    names: list[str] = []
    try:
        with os.scandir(path) as entries:
            for entry in entries:
                if len(names) >= _LIST_MAX:
                    break
                names.append(entry.name)
    except OSError:
        return []
    return sorted(names)


def _text(value: str | None) -> str | None:
    return value if value is not None and text_problem(value) is None else None


def _numbered(value: str | None) -> str | None:
    """ "4: ACTIVE" -> "ACTIVE" (text without the number is taken as it is)."""
    if value is None:
        return None
    match = _NUMBERED_RE.match(value)
    return _text(match.group(1) if match else value)


def _whole(value: str | None, hi: int) -> int | None:
    if value is None or not re.fullmatch(r"\d{1,12}", value):
        return None  # "-1" (unknown speed) is None too
    number = int(value)
    return number if number <= hi else None


def parse_rate_gbps(rate: str | None) -> float | None:
    """The figure of a port's rate ("200 Gb/sec (4X HDR)" -> 200.0), None when it is not one."""
    match = _RATE_RE.match(rate or "")
    if match is None:
        return None
    gbps = float(match.group(1))
    return gbps if in_range(gbps, 0.0, RATE_GBPS_MAX) else None


def _port(port_dir: Path, number: int) -> RdmaPort:
    rate = _text(read_attr(port_dir / "rate"))
    return RdmaPort(
        number=number,
        state=_numbered(read_attr(port_dir / "state")),
        physical_state=_numbered(read_attr(port_dir / "phys_state")),
        rate=rate,
        rate_gbps=parse_rate_gbps(rate),
        link_layer=_text(read_attr(port_dir / "link_layer")),
    )


def _netdevs(dev_dir: Path, ports: list[str]) -> list[str]:
    """The device's netdevs: its PCI function's (`device/net/*`), else its ports' RoCE GIDs' (rxe)."""
    found = _listing(dev_dir / "device" / "net")
    if not found:
        for port in ports:
            ndevs = dev_dir / "ports" / port / "gid_attrs" / "ndevs"
            found += [n for i in range(_GID_NDEVS) if (n := read_attr(ndevs / str(i)))]
    return sorted({n for n in found if name_problem(n) is None})[:MAX_NETDEVS]


def _device(dev_dir: Path, problems: list[str]) -> RdmaDevice:
    port_names = [p for p in _listing(dev_dir / "ports") if p.isdigit() and int(p) <= PORT_NUMBER_MAX]
    port_names.sort(key=int)
    if len(port_names) > MAX_RDMA_PORTS:
        problems.append(f"fabric: {dev_dir.name} has {len(port_names)} ports; reporting the first {MAX_RDMA_PORTS}")
        port_names = port_names[:MAX_RDMA_PORTS]
    guid = read_attr(dev_dir / "node_guid")
    return RdmaDevice(
        name=dev_dir.name,
        node_guid=guid if guid is not None and guid_problem(guid) is None else None,
        ports=[_port(dev_dir / "ports" / p, int(p)) for p in port_names],
        netdevs=_netdevs(dev_dir, port_names),
    )


def _interface(net_dir: Path, name: str, addresses: Addresses) -> FabricInterface:
    here = net_dir / name
    cidrs = [a for a in addresses.get(name, []) if address_problem(a) is None][:MAX_ADDRESSES]
    return FabricInterface(
        name=name,
        addresses=cidrs,
        mtu=_whole(read_attr(here / "mtu"), MTU_MAX),
        speed_mbps=_whole(read_attr(here / "speed"), SPEED_MBPS_MAX),
        operstate=_text(read_attr(here / "operstate")) or "unknown",
    )


def fabric_identity(devices: list[RdmaDevice], interfaces: list[FabricInterface]) -> tuple[str | None, str | None]:
    """(name, address): the network and address of the first interface that carries an ACTIVE RDMA
    port, an IPv4 address before any IPv6 one (IPv6 link-local ones never: every link has fe80::/64)."""
    by_name = {i.name: i for i in interfaces}
    carriers = [by_name[n] for d in devices if any(p.active for p in d.ports) for n in d.netdevs if n in by_name]
    for version in (4, 6):
        for iface in carriers:
            for cidr in iface.addresses:
                ip = ipaddress.ip_interface(cidr)
                if ip.version == version and not (version == 6 and ip.ip.is_link_local):
                    return f"ipv{version}:{ip.network}", str(ip.ip)
    return None, None


def discover_fabric(
    sysfs: str | os.PathLike[str] = DEFAULT_SYSFS_PATH,
    *,
    addresses: Callable[[], Addresses] | None = None,
) -> tuple[Fabric, tuple[str, ...]]:
    """The host's fabric and what went wrong finding it. Blocking (file reads): run it in a thread.

    `addresses` gives each interface's addresses (default: the kernel's, `interface_addresses`);
    it is asked only when some RDMA device sits on an interface."""
    root = Path(sysfs)
    problems: list[str] = []
    ib_dir = root / "class" / "infiniband"
    names = [n for n in _listing(ib_dir) if name_problem(n) is None]
    if len(names) > MAX_RDMA_DEVICES:
        problems.append(f"fabric: {len(names)} RDMA devices; reporting the first {MAX_RDMA_DEVICES}")
        names = names[:MAX_RDMA_DEVICES]
    devices = [_device(ib_dir / n, problems) for n in names]
    netdevs = sorted({n for d in devices for n in d.netdevs})
    if len(netdevs) > MAX_FABRIC_INTERFACES:
        problems.append(f"fabric: {len(netdevs)} interfaces; reporting the first {MAX_FABRIC_INTERFACES}")
        netdevs = netdevs[:MAX_FABRIC_INTERFACES]
    found: Addresses = {}
    if netdevs:
        try:
            found = (addresses or interface_addresses)()
        except OSError as exc:
            problems.append(f"fabric: cannot read the interfaces' addresses: {exc.strerror or type(exc).__name__}")
    interfaces = [_interface(root / "class" / "net", n, found) for n in netdevs]
    name, address = fabric_identity(devices, interfaces)
    return Fabric(devices=devices, interfaces=interfaces, name=name, address=address), tuple(problems)


# ---------------------------------------------------------------------------------------------
# Addresses over rtnetlink (linux/netlink.h, linux/rtnetlink.h, linux/if_addr.h)

_NLMSGHDR: Final = struct.Struct("=IHHII")  # length, type, flags, seq, pid
_IFADDRMSG: Final = struct.Struct("=BBBBI")  # family, prefix length, flags, scope, interface index
_RTATTR: Final = struct.Struct("=HH")  # length, type
_RTM_NEWADDR: Final = 20
_RTM_GETADDR: Final = 22
_NLMSG_ERROR: Final = 2
_NLMSG_DONE: Final = 3
_NLM_F_REQUEST: Final = 0x1
_NLM_F_DUMP: Final = 0x300
_IFA_ADDRESS: Final = 1
_IFA_LOCAL: Final = 2
#: Reads of one dump before giving up (a dump of every address of a host is a few reads).
_MAX_READS: Final = 4096
_NETLINK_TIMEOUT_S: Final = 2.0


def _align(n: int) -> int:
    return (n + 3) & ~3


def _address(family: int, prefix: int, attrs_: dict[int, bytes]) -> str | None:
    # IPv4: IFA_LOCAL is the interface's own address (IFA_ADDRESS is the peer's on a point-to-point
    # link); IPv6 has only IFA_ADDRESS.
    raw = attrs_.get(_IFA_LOCAL) if family == socket.AF_INET else None
    raw = raw or attrs_.get(_IFA_ADDRESS)
    size = 4 if family == socket.AF_INET else 16
    if raw is None or len(raw) != size:
        return None
    return f"{socket.inet_ntop(family, raw)}/{prefix}"


def parse_addr_dump(data: bytes, names: Mapping[int, str], out: dict[str, list[str]]) -> bool:
    """Add the RTM_NEWADDR messages in one read of a dump to `out`; True at the dump's end."""
    at = 0
    while at + _NLMSGHDR.size <= len(data):
        length, kind, _, _, _ = _NLMSGHDR.unpack_from(data, at)
        if length < _NLMSGHDR.size or at + length > len(data):
            return True  # truncated: take what came
        if kind == _NLMSG_DONE:
            return True
        if kind == _NLMSG_ERROR:
            (errno,) = struct.unpack_from("=i", data, at + _NLMSGHDR.size)
            raise OSError(-errno, os.strerror(-errno))
        body = at + _NLMSGHDR.size
        if kind == _RTM_NEWADDR and length >= _NLMSGHDR.size + _IFADDRMSG.size:
            family, prefix, _, _, index = _IFADDRMSG.unpack_from(data, body)
            found: dict[int, bytes] = {}
            rta = body + _IFADDRMSG.size
            while rta + _RTATTR.size <= at + length:
                rta_len, rta_type = _RTATTR.unpack_from(data, rta)
                if rta_len < _RTATTR.size or rta + rta_len > at + length:
                    break
                found[rta_type] = data[rta + _RTATTR.size : rta + rta_len]
                rta += _align(rta_len)
            name = names.get(index)
            cidr = _address(family, prefix, found) if family in (socket.AF_INET, socket.AF_INET6) else None
            if name is not None and cidr is not None:
                out.setdefault(name, []).append(cidr)
        at += _align(length)
    return False


def interface_addresses() -> dict[str, list[str]]:
    """Every interface's addresses in CIDR form, as the kernel has them now (an RTM_GETADDR dump).
    Raises OSError when the kernel cannot be asked (no AF_NETLINK: a sandbox that forbids it)."""
    names = dict(socket.if_nameindex())
    out: dict[str, list[str]] = {}
    with socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, socket.NETLINK_ROUTE) as sock:
        sock.settimeout(_NETLINK_TIMEOUT_S)
        sock.bind((0, 0))
        header = _NLMSGHDR.pack(_NLMSGHDR.size + _IFADDRMSG.size, _RTM_GETADDR, _NLM_F_REQUEST | _NLM_F_DUMP, 1, 0)
        sock.sendto(header + _IFADDRMSG.pack(socket.AF_UNSPEC, 0, 0, 0, 0), (0, 0))
        for _ in range(_MAX_READS):
            if parse_addr_dump(sock.recv(1 << 16), names, out):
                break
    return out
