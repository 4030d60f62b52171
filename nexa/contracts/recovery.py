"""`GET /api/v1/recovery/plan` and `POST /api/v1/recovery/finish`: what a recovering controller
would change once writes resume, and what ending recovery did. Pure data."""

from __future__ import annotations

import attrs


@attrs.frozen(kw_only=True)
class PlannedPush:
    """One node's set as the controller will sign it at the end of recovery, beside what the node accepted."""

    node_id: str
    #: The highest (epoch, generation) the node reported accepting (its last hello or heartbeat).
    accepted_epoch: int
    accepted_generation: int
    #: What the controller will sign: an epoch above every node's, and the restored generation.
    epoch: int
    generation: int
    #: Assignments of the restored set the node does not run yet: it starts them.
    start: list[str] = attrs.field(factory=list)


@attrs.frozen(kw_only=True)
class PlannedStop:
    """A replica a node runs that the restored state does not know (made after the backup): it stops."""

    node_id: str
    #: The replica's id, as the node reports it in its heartbeats.
    assignment_id: str
    #: The deployment its id names (replica ids are `<deployment>-<hex>`).
    deployment: str
    #: Its runtime state as the node last reported it (`Ready`, `Starting`, ...).
    state: str


@attrs.frozen(kw_only=True)
class PlannedReplacement:
    """A replica of the restored state on a node not heard from: placed elsewhere if the node stays away."""

    deployment: str
    replica_id: str
    node_id: str
    reason: str


@attrs.frozen(kw_only=True)
class RecoveryPlan:
    """`GET /api/v1/recovery/plan`: empty, with `recovering` false, outside recovery."""

    recovering: bool
    #: Why recovery began: a restore marker, a node's fence above this controller's, or `--recover`.
    reason: str = ""
    #: The epoch the controller runs at now, and the one it will sign with once recovery ends.
    epoch: int = 0
    next_epoch: int = 0
    pushes: list[PlannedPush] = attrs.field(factory=list)
    stops: list[PlannedStop] = attrs.field(factory=list)
    replacements: list[PlannedReplacement] = attrs.field(factory=list)
    #: Enrolled nodes (not revoked) that have reported nothing since this controller started.
    unheard: list[str] = attrs.field(factory=list)


@attrs.frozen(kw_only=True)
class RecoveryFinished:
    """`POST /api/v1/recovery/finish`: the epoch taken and the nodes sent their sets at once."""

    epoch: int
    pushed: list[str] = attrs.field(factory=list)
    #: Nodes not heard from: they get their sets when they next say hello.
    unheard: list[str] = attrs.field(factory=list)
