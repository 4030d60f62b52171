"""The fabric firewall: a replica group's ports reachable on the fabric address only.

A group's ranks run in the node's network namespace (fabric access `tcp` or `rdma`), and one of
their listeners no runtime option narrows: torch.distributed's rendezvous store on the head (vLLM's
`--master-port`, the port of SGLang's `--dist-init-addr`) listens on every address of the node and
has no authentication of its own. So before a member's container is adopted or started, the agent
closes that member's port (`GroupMember.port`) in a table of its own in the host's nftables, to
every destination but the member's fabric address, arriving on the fabric interface (when the node
discovered it) or from the node itself (`lo`); connections anywhere else are reset. The port opens
again once the member's container is gone.

The agent owns its table (`[firewall] table`, `inet` family) and rewrites the whole of it in one
`nft -f -` transaction at each change (create, delete, create: nftables applies a file atomically),
so a rule is never half there and a rule of a port no longer used goes with the next change. Each
port has one rule set even when two holds name it (a replaced member whose container is still
stopping, and its successor). A base chain's drop or reject is final for the packet, whatever
other tables (Docker's, firewalld's) accept, so nexa's rules do not depend on their order.

Pure text where it can be (`ruleset`): every value in the file is a validated port,
an `ipaddress` literal or a contract-checked interface name, quoted.
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Hashable, Mapping
from typing import Final

import attrs
import trio

from nexa.config.node import table_problem
from nexa.contracts.groups import FabricAccess, GroupMember
from nexa.contracts.runtime import RuntimeSpec

log = logging.getLogger(__name__)

#: The base chain's priority: before the `filter` tables of Docker and firewalld (priority 0).
CHAIN_PRIORITY: Final = "filter - 10"
CHAIN_NAME: Final = "fabric_ports"
#: The systemd drop-in that gives the agent (and the nft it runs) CAP_NET_ADMIN, and nothing more.
FABRIC_DROP_IN: Final = "units/nexa-node.service.d/fabric.conf"
NFT_TIMEOUT_S: Final = 10.0
#: What of nft's standard error a refusal quotes.
ERROR_CHARS: Final = 600


class FirewallError(Exception):
    """The node could not close a group member's port: its container is not started."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


@attrs.frozen
class Closed:
    """One member port closed to all but its fabric address (and interface, when known)."""

    port: int
    address: str
    interface: str = ""

    @classmethod
    def of(cls, member: GroupMember) -> Closed:
        return cls(port=member.port, address=member.address, interface=member.interface)  # canonical (contract)


def _rules(closed: Closed) -> list[str]:
    family = "ip" if ipaddress.ip_address(closed.address).version == 4 else "ip6"
    ifaces = ["lo"] if not closed.interface else sorted({"lo", closed.interface})
    match_if = "" if not closed.interface else " iifname { " + ", ".join(f'"{i}"' for i in ifaces) + " }"
    return [
        f"tcp dport {closed.port} {family} daddr {closed.address}{match_if} accept",
        f"tcp dport {closed.port} reject with tcp reset",
    ]


def ruleset(table: str, closed: Mapping[int, Closed]) -> str:
    """The nft file that makes `table` hold exactly these ports' rules (by port); none: no table."""
    lines = [f"table inet {table} {{}}", f"delete table inet {table}"]
    if not closed:
        return "\n".join(lines) + "\n"
    lines += [f"table inet {table} {{", f"  chain {CHAIN_NAME} {{"]
    lines.append(f"    type filter hook input priority {CHAIN_PRIORITY}; policy accept;")
    for port in sorted(closed):
        lines += [f"    {rule}" for rule in _rules(closed[port])]
    lines += ["  }", "}"]
    return "\n".join(lines) + "\n"


def in_host_network(runtime: RuntimeSpec) -> GroupMember | None:
    """The member a group rank's spec makes of this node when its runtime opted into fabric access
    (its container in the node's network namespace, its port on every address); else None."""
    group = runtime.group
    return None if group is None or group.fabric is FabricAccess.NONE else group.me


class FabricFirewall:
    """Closes group members' ports in the agent's own nftables table; see the module's text."""

    def __init__(self, table: str = "nexa", nft: str = "nft") -> None:
        if (problem := table_problem(table)) is not None:
            raise ValueError(f"[firewall] table {table[:80]!r}: {problem}")
        self.table = table
        self._nft = nft
        #: hold (a member's worker) → what it closes; a port stays closed while any hold names it.
        self._holds: dict[Hashable, Closed] = {}
        self._lock = trio.Lock()

    def closed(self) -> dict[int, Closed]:
        """Each closed port's rule (the last hold's to name it, when two do)."""
        return {c.port: c for c in self._holds.values()}

    async def close(self, *holds: tuple[Hashable, GroupMember]) -> None:
        """Close each (hold, member)'s port to all but the member's fabric address, in one table
        write, before their containers run. Raises FirewallError (nothing changed) when nft refuses
        or cannot be run."""
        if not holds:
            return  # (no checkpoint: a reconcile pass without group members is as it was)
        async with self._lock:
            wanted = {hold: Closed.of(member) for hold, member in holds}
            if all(self._holds.get(hold) == closed for hold, closed in wanted.items()):
                return  # written already (the member restarts; its port stayed closed meanwhile)
            before = dict(self._holds)
            self._holds.update(wanted)
            try:
                await self._apply()
            except FirewallError:
                self._holds = before
                raise

    async def release(self, hold: Hashable) -> None:
        """Open the hold's port again (unless another hold still names it). Logs a failure: the
        port stays closed, which is the safe side, until the next change rewrites the table."""
        if hold not in self._holds:
            return  # (no checkpoint: most workers that end never held a port)
        async with self._lock:
            if self._holds.pop(hold, None) is None:
                return
            try:
                await self._apply()
            except FirewallError as exc:
                log.warning("%s", exc.message)

    async def _apply(self) -> None:
        try:
            code, err = await _nft(self._nft, "-f", "-", stdin=ruleset(self.table, self.closed()).encode())
        except OSError as exc:
            raise FirewallError(
                f"cannot run {self._nft!r} to close a replica group's port on all but the fabric address: {exc}; "
                "install nftables (apt install nftables), or set [firewall] enabled = false and close the port in "
                "the host's firewall yourself"
            ) from exc
        except trio.TooSlowError as exc:
            raise FirewallError(f"{self._nft} did not answer within {NFT_TIMEOUT_S:g} s; nothing was changed") from exc
        if code != 0:
            raise FirewallError(
                f"nft refused table inet {self.table} (exit {code}): {err or 'no message'}; the agent needs "
                f"CAP_NET_ADMIN ({FABRIC_DROP_IN}, or run it as root), or set [firewall] enabled = false and "
                "close the port in the host's firewall yourself"
            )
        log.info("firewall: table inet %s closes ports %s", self.table, sorted(self.closed()) or "none")


async def _nft(nft: str, *args: str, stdin: bytes = b"") -> tuple[int, str]:
    """nft's exit status and (the start of) its standard error. OSError: it cannot run;
    trio.TooSlowError: it did not end within NFT_TIMEOUT_S."""
    with trio.fail_after(NFT_TIMEOUT_S):
        done = await trio.run_process([nft, *args], stdin=stdin, capture_stdout=True, capture_stderr=True, check=False)
    return done.returncode, done.stderr.decode("utf-8", "replace").strip()[:ERROR_CHARS]


async def nft_problem(nft: str) -> str | None:
    """Why `nft list tables` fails (what the agent's writes need too: nft, and CAP_NET_ADMIN), or None."""
    try:
        code, err = await _nft(nft, "list", "tables")
    except OSError as exc:
        return f"cannot run {nft!r}: {exc.strerror or exc}"
    except trio.TooSlowError:
        return f"{nft} did not answer within {NFT_TIMEOUT_S:g} s"
    return None if code == 0 else f"{nft} list tables failed (exit {code}): {err or 'no message'}"
