"""Recovery: a controller started on a restored or otherwise older state reconciles before it writes.

It begins when the store holds the restore marker (`nexa restore` writes it), when the operator
starts `nexa control --recover`, or when a node reports an accepted epoch this state cannot have
signed (`Southbound._check_fence`; above the epoch it issued, only with the signed set behind it:
`control.fleet.claims`, so no node can put it into recovery, or its epochs out of range, by saying so).
Meanwhile reads and inference go on over the replicas nodes report Ready (the gateway routes on
their heartbeats, as always), every management write is refused with 503 `recovering` (`api`),
nothing is pushed to nodes (`Southbound`) and nothing is re-placed (`Deployments.reconcile`). The
controller learns each node's accepted (epoch, generation) from its hello or heartbeats; `plan` says
what ending recovery would change.

Recovery ends once every enrolled node (not revoked) has reported, or on `nexa recovery finish`:
one audited transaction takes an epoch above every node's and deletes the marker, then every
reachable node is sent its restored set at the new epoch, which it accepts whatever generation it
holds (a newer epoch wins), and the reconciler runs again.

`--recover` is for the embedded store only (`refuse_forced`): recovery moves the store's epoch
(`meta.epoch`), while controllers on a shared PostgreSQL store sign with the lease's epoch, and a
new leader takes a higher one by itself. A PostgreSQL store is restored with PostgreSQL's tools.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
from collections.abc import Iterable
from typing import Final, Protocol

import trio

from nexa.contracts import codec
from nexa.contracts.backup import BackupManifest
from nexa.contracts.deployments import Deployment
from nexa.contracts.domain import SYSTEM, Actor, NodeAdminState
from nexa.contracts.recovery import PlannedPush, PlannedReplacement, PlannedStop, RecoveryFinished, RecoveryPlan
from nexa.control import store as st
from nexa.control.access.accounts import audit_draft
from nexa.control.deployments import Deployments
from nexa.control.deployments.records import all_replicas
from nexa.control.fleet.nodes import Fleet, NodeLive
from nexa.control.fleet.southbound import Southbound
from nexa.errors import ConfigError, NexaError, NotRecovering, Unavailable
from nexa.telemetry import Metrics

log = logging.getLogger(__name__)

#: The writes a recovering controller still takes: they change no desired state. Every other
#: POST, PUT or DELETE of the API and the console is refused with 503 `recovering` (`api`).
WRITES_WHILE_RECOVERING: Final = frozenset(
    {
        ("POST", "/api/v1/audit/verify"),
        ("POST", "/api/v1/capacity/forecast"),
        ("POST", "/api/v1/backups"),
        ("POST", "/api/v1/recovery/finish"),
        ("POST", "/console/login"),
        ("POST", "/console/logout"),
        ("POST", "/console/audit/verify"),
    }
)


#: Why `nexa control --recover` is refused on a shared (PostgreSQL) store.
FORCED_ON_SHARED_STORE: Final = (
    "--recover is for the embedded SQLite store: on PostgreSQL, restore the PostgreSQL database with its own "
    "tools; the new leader takes a higher epoch itself. Start without --recover"
)


def refuse_forced(recover: bool, backend: str) -> None:
    """At start, before anything is written: ConfigError for `--recover` on a shared store (`backend`
    other than sqlite; the module docstring says why)."""
    if recover and backend != "sqlite":
        raise ConfigError(FORCED_ON_SHARED_STORE, problems=("--recover: not with [store] url",))


def refused_while_recovering(method: str, rule: str) -> bool:
    """Whether a recovering controller refuses this route (reads never; `WRITES_WHILE_RECOVERING`)."""
    return method not in {"GET", "HEAD", "OPTIONS"} and (method, rule) not in WRITES_WHILE_RECOVERING


def _restored_from(marker: str) -> str:
    """The recovery reason of a restore marker: when the backup was taken, its epoch and audit head
    (the marker is the backup's manifest, as `nexa restore` wrote it); its text otherwise."""
    try:
        manifest = codec.loads(codec.api, marker.encode(), BackupManifest)
    except (NexaError, ValueError):
        return f"the state was restored from a backup ({marker[:200]})"
    taken = datetime.datetime.fromtimestamp(manifest.created_at, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return (
        f"the state was restored from a backup taken at {taken}"
        f" (epoch {manifest.epoch}, audit head {manifest.audit_head_seq})"
    )


class _Rule(Protocol):
    """A routed request's URL rule (werkzeug's `Rule`, without importing werkzeug here)."""

    @property
    def rule(self) -> str: ...


def plan(
    *, recovering: bool, reason: str, epoch: int, nodes: Iterable[NodeLive], deployments: Iterable[Deployment]
) -> RecoveryPlan:
    """What ending recovery would change, from what nodes reported and the restored state. Pure.

    Heard nodes get their restored set at `next_epoch` (above every accepted epoch): they start
    the assignments of it they do not run and stop the ones it does not hold (those were made
    after the backup). Replicas on nodes not heard from are listed as replacements: the
    reconciler places them elsewhere if the node stays away past `nodes.replace_after_s`.
    """
    if not recovering:
        return RecoveryPlan(recovering=False, epoch=epoch, next_epoch=epoch)
    known = [live for live in nodes if live.node.admin_state is not NodeAdminState.REVOKED]
    heard = [live for live in known if live.last_seen is not None]
    unheard = sorted(str(live.node.id) for live in known if live.last_seen is None)
    next_epoch = max([epoch, *(live.reported_epoch for live in heard)]) + 1
    pushes, stops = [], []
    for live in sorted(heard, key=lambda n: n.node.id):
        wanted = [a.id for a in live.desired.assignments]
        running = {s.assignment_id for s in live.statuses}
        pushes.append(
            PlannedPush(
                node_id=live.node.id,
                accepted_epoch=live.reported_epoch,
                accepted_generation=live.reported_generation,
                epoch=next_epoch,
                generation=live.desired.generation,
                start=[a for a in wanted if a not in running],
            )
        )
        stops += [
            PlannedStop(
                node_id=live.node.id,
                assignment_id=s.assignment_id,
                deployment=s.assignment_id.rpartition("-")[0] or s.assignment_id,
                state=s.state.value,
            )
            for s in sorted(live.statuses, key=lambda s: s.assignment_id)
            if s.assignment_id not in set(wanted)
        ]
    away = set(unheard)
    replacements = [
        PlannedReplacement(
            deployment=dep.name,
            replica_id=r.id,
            node_id=r.node_id,
            reason=f"node {r.node_id} has not reported since the controller started",
        )
        for dep in sorted(deployments, key=lambda d: d.name)
        for r in all_replicas(dep)
        if r.node_id in away
    ]
    return RecoveryPlan(
        recovering=True,
        reason=reason,
        epoch=epoch,
        next_epoch=next_epoch,
        pushes=pushes,
        stops=stops,
        replacements=replacements,
        unheard=unheard,
    )


class Recovery:
    """The controller's recovery: begins at start (`begin`), ends once (`finish`, or `run` when every node reported)."""

    def __init__(
        self, store: st.Store, fleet: Fleet, deployments: Deployments, southbound: Southbound, metrics: Metrics
    ) -> None:
        self._store = store
        self._fleet = fleet
        self._deployments = deployments
        self._southbound = southbound
        self._metrics = metrics
        self._lock = trio.Lock()
        self._wake = trio.Event()
        fleet.on_change(self._poke)
        southbound.on_recovery(self._poke)

    @staticmethod
    def of(recovery: Recovery | None) -> Recovery:
        """The API's recovery; a controller composed without one answers 503."""
        if recovery is None:
            raise Unavailable("this controller was composed without recovery")
        return recovery

    @property
    def active(self) -> bool:
        return self._southbound.recovering

    def refuses(self, method: str, rule: _Rule | None) -> bool:
        """Whether to refuse this request with 503 `recovering` (`refused_while_recovering`, while active)."""
        return self.active and rule is not None and refused_while_recovering(method, rule.rule)

    def _poke(self) -> None:
        self._metrics.controller_recovering.set(1 if self.active else 0)
        self._wake.set()

    async def begin(self, *, forced: bool = False) -> None:
        """At start, before the node channel serves: recover if the store was restored, or when `forced`
        (ConfigError on a shared store: `refuse_forced`)."""
        refuse_forced(forced, getattr(self._store, "backend", "sqlite"))
        marker = await self._store.run(st.recovery_marker)
        if marker is not None:
            self._southbound.begin_recovery(_restored_from(marker))
        elif forced:
            self._southbound.begin_recovery("the controller was started with --recover")

    def plan(self) -> RecoveryPlan:
        return plan(
            recovering=self.active,
            reason=self._southbound.recovery_reason,
            epoch=self._store.epoch,
            nodes=self._fleet,
            deployments=(view.deployment for view in self._deployments.all()),
        )

    def unheard(self) -> list[str]:
        return sorted(
            str(live.node.id)
            for live in self._fleet
            if live.node.admin_state is not NodeAdminState.REVOKED and live.last_seen is None
        )

    async def finish(self, actor: Actor) -> RecoveryFinished:
        """End recovery: take an epoch above every node's (audited, marker deleted), push every
        reachable node its set at it, let the reconciler run. Refused (NotRecovering) outside recovery."""
        async with self._lock:
            if not self.active:
                raise NotRecovering("the controller is not recovering: there is nothing to finish")
            unheard = self.unheard()
            # What nodes proved they hold (`control.fleet.claims`); a revoked node's counts no more.
            above = max(
                (
                    live.reported_epoch
                    for live in self._fleet
                    if live.last_seen is not None and live.node.admin_state is not NodeAdminState.REVOKED
                ),
                default=0,
            )
            before = self._store.epoch
            how = "every node reported" if actor is SYSTEM else "finished by an operator"
            detail = f"{how}; epoch above {max(before, above)}; not heard from: {', '.join(unheard) or 'none'}"
            draft = audit_draft(actor, "recovery.finish", "controller", detail=detail[:600])
            epoch, event = await self._store.run(st.end_recovery, above, draft)
            self._metrics.audit_events.labels(event.result.value).inc()
            # The store is the epoch's one owner; every set and receipt signed from here on reads it.
            self._store.epoch = epoch
            self._metrics.controller_epoch.set(epoch)
            reachable = [str(live.node.id) for live in self._fleet if live.reachable]
            await self._southbound.end_recovery()
            self._metrics.controller_recovering.set(0)
            self._deployments.poke()
        log.info("recovery ended (%s): epoch %d -> %d; not heard from: %s", how, before, epoch, unheard or "none")
        return RecoveryFinished(epoch=epoch, pushed=reachable, unheard=unheard)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """End recovery by itself once every enrolled node has reported; until cancelled."""
        task_status.started()
        while True:
            self._wake = trio.Event()
            if self.active and not self.unheard():
                with contextlib.suppress(NotRecovering):  # an operator finished it meanwhile
                    await self.finish(SYSTEM)
                continue
            await self._wake.wait()
