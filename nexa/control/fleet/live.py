"""A node as the controller knows it right now (`NodeLive`, owned by `nodes.Fleet`), and when
its liveness and its state run out."""

from __future__ import annotations

import attrs

from nexa.contracts.domain import Node, NodeAdminState, NodeState
from nexa.contracts.node import NodeInventory
from nexa.contracts.wire import (
    AssignmentStatus,
    CacheDisk,
    DesiredAssignments,
    MemoryPressure,
    RuntimeCacheDisk,
    RuntimeLoad,
)
from nexa.security import PublicKey, ReplayWindow


@attrs.define
class NodeLive:
    """A node as the controller knows it right now (mutable; owned by Fleet)."""

    node: Node
    inventory: NodeInventory | None
    desired: DesiredAssignments
    window: ReplayWindow
    #: trio clock time of the last good message, None if never heard from since start.
    last_seen: float | None = None
    last_seen_wall: float | None = None
    reachable: bool = False
    agent_version: str = ""
    #: The node's protocol level (`Hello.protocol`; `wire.PROTOCOL_VERSION`): what it may be sent.
    #: 1 until its Hello is heard since this controller started.
    protocol: int = 1
    statuses: list[AssignmentStatus] = attrs.field(factory=list)
    reported_epoch: int = 0
    reported_generation: int = 0
    free_memory_bytes: int = 0
    free_accelerators: int = 0
    last_push: float = float("-inf")
    inventory_digest: str | None = None
    signing_key: PublicKey | None = None
    #: The keys the node had before it rotated them, still admitted until it uses the new ones
    #: (signing key parsed, Curve key in Z85); None outside a rotation.
    previous_keys: tuple[PublicKey, str] | None = None
    #: The retired controller key the node pins, when it pins no other after the overlap ended
    #: (`needs_reenrollment`): Unreachable from then on, sent nothing; "" for every other node.
    reenroll_key_id: str = ""
    #: Its channel's refusals since this controller started, by reason (`nexa_node_messages_rejected_total`'s
    #: reasons), and `disconnected`: its connections libzmq closed (`nexa_channel_disconnects_total`).
    channel: dict[str, int] = attrs.field(factory=dict)
    #: A changed inventory or acknowledgement kept in memory, not yet written (above the node's write rate).
    inventory_unsaved: bool = False
    desired_unsaved: bool = False
    #: The runtime load each Ready replica reported in the last heartbeat, with the trio clock
    #: time its figures were read (the heartbeat's arrival less their `age_s`), by replica id.
    loads: dict[str, tuple[RuntimeLoad, float]] = attrs.field(factory=dict)
    #: The artifact cache's disk, from the last heartbeat (None: not reported).
    cache_disk: CacheDisk | None = None
    #: The replicas' writable caches, from the last heartbeat (None: not reported).
    runtime_cache: RuntimeCacheDisk | None = None
    #: Set while the node reports memory pressure (placement skips it); and the replicas its guard stopped.
    memory_pressure: MemoryPressure | None = None
    memory_pressure_stops: int = 0
    #: Each replica's measured memory in the last heartbeat that changed it, by assignment id.
    measured: dict[str, int] = attrs.field(factory=dict)
    #: trio clock time of its last state (a `Heartbeat`; its first signed message since this
    #: controller started until one comes), the state interval that state announced and its seq.
    last_state: float | None = None
    state_interval_s: float = 0.0
    state_seq: int = 0
    #: trio clock time this controller last asked the node for its state (`StateRequest`).
    state_asked: float = float("-inf")

    @property
    def state(self) -> NodeState:
        admin = self.node.admin_state
        if admin is NodeAdminState.REVOKED:
            return NodeState.REVOKED
        if not self.reachable or self.reenroll_key_id:
            return NodeState.UNREACHABLE
        if admin is NodeAdminState.DRAINING:
            return NodeState.DRAINING
        if admin is NodeAdminState.CORDONED:
            return NodeState.CORDONED
        return NodeState.READY if self.inventory is not None else NodeState.JOINING  # no heartbeat yet

    def state_current(self, now: float, lease_s: float) -> bool:
        """Whether its last state came within the interval it announced plus `lease_s`."""
        return self.last_state is not None and now - self.last_state < self.state_interval_s + lease_s

    def deadline(self, lease_s: float) -> float | None:
        """When it becomes Unreachable (trio clock) unless something good comes: `lease_s` after
        its last message, or its state's interval and `lease_s` after its last state; None: never heard."""
        if self.last_seen is None:
            return None
        deadline = self.last_seen + lease_s
        if self.last_state is not None:
            deadline = min(deadline, self.last_state + self.state_interval_s + lease_s)
        return deadline
