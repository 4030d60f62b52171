"""Errors of the controllers as a cluster: leadership, recovery, a node out of reach, key rotation."""

from __future__ import annotations

from nexa.errors.base import Conflict, Unavailable


class NodeUnreachable(Unavailable):
    """What needs the node itself (`nexa nodes rotate`) while its channel is not open. Changes nothing."""

    code = "node_unreachable"

    def __init__(self, *, node_id: str) -> None:
        super().__init__(
            f"node {node_id} is not connected, so it cannot be asked now: retry once it is Ready, "
            "or run `nexa node rotate-keys` on the node (its agent sends the new keys when it connects)"
        )
        self.node_id = node_id


class Recovering(Unavailable):
    """A mutation refused while the controller recovers (started from a restored or older state).

    Reads and inference go on; every write waits until recovery ends, which changes nothing now.
    """

    code = "recovering"

    def __init__(self, message: str = "") -> None:
        super().__init__(
            message
            or "the controller is recovering from a restored or older state and accepts no changes yet: "
            "see what it would change with `nexa recovery plan`, then end recovery with `nexa recovery finish`"
        )


class NotLeader(Unavailable):
    """A write only the leader may make (desired sets, placement, rollout steps), refused because this
    controller does not hold the lease at its epoch, checked in the write's own transaction: nothing
    was written. `leader_address` is where the leader was last seen (for forwarding, never shown)."""

    code = "not_leader"

    def __init__(self, message: str = "", *, leader_address: str | None = None) -> None:
        super().__init__(
            message
            or "this controller is not the leader, so it refused the write and changed nothing: "
            "retry the request (on any controller: followers pass writes to the leader)"
        )
        self.leader_address = leader_address


class NotRecovering(Conflict):
    code = "not_recovering"


class ControllersRunning(Conflict):
    """`nexa keys rotate-controller` on a shared store while other controllers run on it: a
    rotation writes the keys directory of this host only, and the others would keep signing with
    the old keys. Nothing was changed."""

    code = "controllers_running"

    def __init__(self, *, others: list[str], wait_s: float) -> None:
        super().__init__(
            f"{len(others)} other controller(s) run on this store (GET /api/v1/cluster lists them), and a key "
            "rotation changes the keys directory of this controller only, so nothing was changed: stop every "
            f"other controller (a stopped one counts as running for {wait_s:g} s more), rotate here, then copy "
            "this controller's <state_dir>/keys (mode 0700) over each other one's before it starts again (the "
            "store accepts the rotated keys)"
        )
        self.others = others


class RotationEndpointInUse(Conflict):
    """`nexa keys rotate-controller` serves the new Curve key on the channel's second endpoint
    before it writes a key file; that endpoint could not be bound, so nothing was changed."""

    code = "rotation_endpoint_in_use"
    retryable = True

    def __init__(self, *, endpoint: str, reason: str) -> None:
        super().__init__(
            f"the key rotation serves the new Curve key on {endpoint} first, and it cannot be bound ({reason}), so "
            "the keys were not changed: free that port, or set [channel] rotation_listen (and rotation_advertise) to "
            "a free one and restart the controller, then rotate again"
        )
        self.endpoint = endpoint
