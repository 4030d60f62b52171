"""What the node makes of a verified assignment set: `judge`, pure (the agent acts on its `Verdict`)."""

from __future__ import annotations

import attrs

from nexa.contracts import wire
from nexa.node.identity import Fence


@attrs.frozen(kw_only=True)
class Verdict:
    """What the node makes of one verified assignment set."""

    reason: wire.RejectReason | None
    #: Why, for the Ack and the log: ids and numbers only.
    detail: str = ""
    #: Accepted as a lease renewal of the set already in force.
    renewal: bool = False

    @property
    def accepted(self) -> bool:
        return self.reason is None


def judge(node_id: str, fence: Fence, offered: wire.AssignmentSet, now: float) -> Verdict:
    """Check a verified set against this node's id, its fence and the clock. Pure.

    Newer epoch: accepted whatever its generation. Same epoch: a higher generation replaces the
    set; the same generation is only a lease renewal of identical assignments.
    """
    reject = wire.RejectReason
    if offered.node_id != node_id:
        return Verdict(reason=reject.WRONG_NODE, detail="the set is addressed to another node")
    if offered.epoch < fence.epoch:
        return Verdict(
            reason=reject.STALE_EPOCH, detail=f"epoch {offered.epoch} is older than the accepted epoch {fence.epoch}"
        )
    renewal = False
    if offered.epoch == fence.epoch and fence.accepted_any:
        if offered.generation < fence.generation:
            return Verdict(
                reason=reject.STALE_GENERATION,
                detail=f"generation {offered.generation} is older than the accepted generation {fence.generation}",
            )
        if offered.generation == fence.generation:
            if offered.assignments != fence.assignments:
                return Verdict(
                    reason=reject.STALE_GENERATION,
                    detail=f"generation {offered.generation} is already accepted with other assignments",
                )
            renewal = True
    if not offered.lease_expires_at > now:
        ago = now - offered.lease_expires_at
        return Verdict(reason=reject.LEASE_EXPIRED, detail=f"the lease expired {ago:.3f} s ago")
    return Verdict(reason=None, renewal=renewal)
