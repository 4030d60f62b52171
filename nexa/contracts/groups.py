"""Replica groups: one model served by N nodes together. Each rank's part of a group as the signed
set names it (`GroupRole` in `RuntimeSpec.group`), and the fabric access its containers opt into
(`FabricAccess`, from the runtime registration). Pure data and validation; no I/O.

A group's members are listed in rank order; rank 0 is the head, which runs the API server the
gateway routes to; the other ranks join it over the fabric at the addresses and ports named here.
"""

from __future__ import annotations

import enum
import ipaddress
from typing import Final

import attrs

from nexa.contracts.fabric import name_problem

#: A group has at least two members (one node is a plain replica) and at most this many.
MIN_GROUP_SIZE: Final = 2
MAX_GROUP_SIZE: Final = 16
#: A group id, a node id: what the rest of the contracts allow for ids, bounded.
MAX_ID_CHARS: Final = 128


class FabricAccess(enum.StrEnum):
    """What a group's containers get to use the fabric between its nodes, as the runtime's
    registration opts in (`nexa runtimes register --fabric`); nothing beyond today's hardening
    without it."""

    #: Nothing: each container keeps its own network namespace (members cannot reach each other
    #: unless the runtime is registered with `--host-network`).
    NONE = "none"
    #: The node's network namespace (the fabric interface's address can be bound) and a larger /dev/shm.
    TCP = "tcp"
    #: What `tcp` gives, and the node's RDMA devices (/dev/infiniband), IPC_LOCK and an unlimited
    #: locked-memory limit, which verbs need to register memory.
    RDMA = "rdma"


def _id(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ID_CHARS or not value.isprintable():
        raise ValueError(f"{attribute.name} must be 1 to {MAX_ID_CHARS} printable characters")


def _ip_literal(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    try:
        parsed = ipaddress.ip_address(value)
    except ValueError:
        raise ValueError(f"{attribute.name} must be an IP address literal, not {value[:100]!r}") from None
    if str(parsed) != value or parsed.is_unspecified or parsed.is_multicast:
        # One spelling only (the canonical one), and an address a peer can connect to.
        raise ValueError(f"{attribute.name} must be a unicast IP address in canonical form, not {value[:100]!r}")


def _port(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise ValueError(f"{attribute.name} must be a port from 1 to 65535")


def _interface(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not isinstance(value, str) or (value and name_problem(value) is not None):
        raise ValueError(f"{attribute.name}: {name_problem(str(value)) or 'must be a string'}")


@attrs.frozen(kw_only=True)
class GroupMember:
    """One member of a replica group: its rank, its node, and where its peers reach it on the fabric."""

    rank: int
    node_id: str = attrs.field(validator=_id)
    #: The member's fabric address (an IP literal): what its worker or rendezvous port is bound on.
    address: str = attrs.field(validator=_ip_literal)
    #: Its worker or rendezvous port on `address` (the head's: where the others join it).
    port: int = attrs.field(validator=_port)
    #: The network interface `address` sits on, as its node discovered it ("" when unknown: an
    #: address from the node's `fabric-address` label); what NCCL and Gloo are told to use.
    interface: str = attrs.field(default="", validator=_interface)


@attrs.frozen(kw_only=True)
class GroupRole:
    """One rank's part in a replica group, as the signed set names it: the group, this node's rank,
    every member in rank order (`members[0]` is the head) and the fabric access the runtime opted into."""

    #: The replica group's id (the same on every member's spec).
    group: str = attrs.field(validator=_id)
    rank: int
    members: list[GroupMember]
    fabric: FabricAccess = FabricAccess.NONE

    def __attrs_post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, int):
            raise ValueError("rank must be an integer")
        if not MIN_GROUP_SIZE <= len(self.members) <= MAX_GROUP_SIZE:
            raise ValueError(
                f"members: a group has {MIN_GROUP_SIZE} to {MAX_GROUP_SIZE} members, not {len(self.members)}"
            )
        ranks = [m.rank for m in self.members]
        if ranks != list(range(len(self.members))):
            raise ValueError(f"members: ranks must be 0 to {len(self.members) - 1} in order, not {ranks}")
        if not 0 <= self.rank < len(self.members):
            raise ValueError(f"rank must be one of the members' ranks (0 to {len(self.members) - 1}), not {self.rank}")
        nodes = [m.node_id for m in self.members]
        if len(set(nodes)) != len(nodes):
            raise ValueError("members: each member is on a node of its own (a node id appears twice)")
        endpoints = [(m.address, m.port) for m in self.members]
        if len(set(endpoints)) != len(endpoints):
            raise ValueError("members: two members share a fabric address and port")

    @property
    def size(self) -> int:
        return len(self.members)

    @property
    def head(self) -> GroupMember:
        return self.members[0]

    @property
    def is_head(self) -> bool:
        return self.rank == 0

    @property
    def me(self) -> GroupMember:
        """This rank's own member entry."""
        return self.members[self.rank]

    @property
    def others(self) -> list[GroupMember]:
        """Every member but this rank, in rank order."""
        return [m for m in self.members if m.rank != self.rank]


@attrs.frozen(kw_only=True)
class GroupRunRecord:
    """What the store keeps of a group replica's run (`control.deployments.grouprun`), written by the
    leader with the node sets it changes, so that a controller taking over continues it: its phase,
    its members' fabric endpoints, its failures in a row (the next backoff) and its restarts."""

    replica_id: str = attrs.field(validator=_id)
    #: Its deployment's name.
    deployment: str = attrs.field(validator=_id)
    #: A `grouprun.GroupPhase` value.
    phase: str
    detail: str = ""
    #: Every member's address and port, by rank (empty while pending).
    members: list[GroupMember] = attrs.Factory(list)
    #: Failures in a row since it was last Ready (the next restart waits 2**failures backoff steps).
    failures: int = 0
    #: Every restart of the group since it was first started.
    restarts: int = 0
    #: While restarting: when it is sent again (Unix time, seconds); 0 otherwise.
    restart_at: float = 0.0
