"""How one controller takes part in its cluster (the composition root's part, `control.service`):
its leadership (solo on a store of its own, leased on a shared one), the change feed that keeps its
caches up with the others' writes, the owner it names on what it runs, and the loops it runs while
it leads. On the embedded store it is the only controller: always the leader, no feed, no lease.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from functools import partial

import trio

from nexa.config import ControlConfig
from nexa.control.access.accounts import Accounts
from nexa.control.cluster.follow import ChangeFeed, Orphans, other_live_controllers
from nexa.control.cluster.leadership import Leadership, controller_identity
from nexa.control.datapath.quotas import UNFLUSHED_S, Quotas
from nexa.control.datapath.workloads import Workloads
from nexa.control.deployments import Deployments
from nexa.control.fleet.nodes import Fleet
from nexa.control.fleet.southbound import Southbound
from nexa.control.operations.jobs import Jobs
from nexa.control.registry.models import ModelRegistry
from nexa.control.store import Store
from nexa.supervision import supervised
from nexa.telemetry import Metrics


def leadership(cfg: ControlConfig, store: Store, metrics: Metrics) -> Leadership:
    """Once the keys are known to be the store's: solo on a store of its own (the embedded SQLite
    store: always the leader, no lease), leased on a shared one (PostgreSQL, or the SQLite file of
    gateway workers); `nexa_controller_epoch` follows its epoch."""
    controller_id, address = controller_identity(cfg.cluster, cfg.http)
    if not getattr(store, "shared", False):
        lead = Leadership.solo(store, controller_id=controller_id, address=address)
    else:
        lead = Leadership.leased(store, cfg.cluster, controller_id=controller_id, address=address)
    metrics.controller_epoch.set(lead.epoch)
    metrics.controller_role.set(1 if lead.is_leader else 0)
    lead.on_change(lambda now: metrics.controller_epoch.set(now.epoch))
    lead.on_change(lambda now: metrics.controller_role.set(1 if now.is_leader else 0))
    return lead


def change_feed(
    cfg: ControlConfig,
    store: Store,
    leadership: Leadership,
    *,
    accounts: Accounts,
    models: ModelRegistry,
    fleet: Fleet,
    deployments: Deployments,
    quotas: Quotas,
) -> ChangeFeed | None:
    """On a shared store, what keeps this controller's caches up with the others' writes; None on
    the embedded one (its only controller writes everything itself)."""
    if not getattr(store, "shared", False):
        return None
    return ChangeFeed(
        store,
        cfg.cluster,
        controller_id=leadership.controller_id,
        accounts=accounts,
        models=models,
        fleet=fleet,
        deployments=deployments,
        quotas=quotas,
        # Tokens not in the usage rows yet: metering writes them within one flush (and its write).
        unflushed_s=max(UNFLUSHED_S, 3 * cfg.gateway.metering_flush_s),
    )


async def start_leading(
    loops: trio.Nursery,
    leadership: Leadership,
    feed: ChangeFeed | None,
    southbound: Southbound,
    leader_loops: list[tuple[str, Callable[..., Awaitable[object]]]],
) -> None:
    """Start the loops that decide desired state. The only controller (the embedded store) always
    leads: they start here, as they always did (a failed start ends the process). On a shared
    store: the change feed, and the loops under `Leadership.while_leader` (`_lead`)."""
    if feed is None:
        for name, fn in leader_loops:
            await loops.start(supervised, name, fn)
        return
    await loops.start(supervised, "follow", feed.run)
    lead = partial(_lead, feed, southbound, leader_loops)
    await loops.start(supervised, "leader", partial(leadership.while_leader, lead))


async def owner(cfg: ControlConfig, store: Store, leadership: Leadership) -> tuple[str | None, bool]:
    """(The controller named on each workload and job this one runs: its id on a shared store,
    None on the embedded one; whether no other controller runs now, so that at start the rows
    naming none, written before controllers were named, are failed too.)"""
    if not getattr(store, "shared", False):
        return None, True
    owner = leadership.controller_id
    return owner, not await other_live_controllers(store, owner, cfg.cluster.lease_s)


def orphans(
    cfg: ControlConfig, store: Store, owner: str | None, workloads: Workloads, jobs: Jobs
) -> list[tuple[str, Callable[..., Awaitable[object]]]]:
    """On a shared store (`owner`: this controller's id), the leader's loop that fails what a
    controller gone for good left unfinished (`follow.Orphans`); none on the embedded store."""
    if owner is None:
        return []
    return [("orphans", Orphans(store, cfg.cluster, controller_id=owner, parts=(workloads, jobs)).run)]


async def _lead(
    feed: ChangeFeed, southbound: Southbound, loops: list[tuple[str, Callable[..., Awaitable[object]]]]
) -> None:
    """What runs while this controller leads (`Leadership.while_leader` cancels it when that ends).

    A controller that has just taken the lease first re-reads everything from the store (the last
    changes of the leader before it), then sends every node its set at the new epoch; only then do
    the loops that decide desired state start."""
    await feed.refresh_all()
    await southbound.lead()
    async with trio.open_nursery() as nursery:
        for name, fn in loops:
            await nursery.start(supervised, name, fn)
