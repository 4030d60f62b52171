"""`ChangeFeed`: each controller on a shared store keeps its in-memory state up with what the others
write (DESIGN §5). On the embedded SQLite store only with gateway workers (`[http] workers`): one
controller alone writes everything there.

Every mutation appends its audit event in its own transaction, so the audit head is the change
feed: every `cluster.refresh_s` the head's seq is read on the reader lane and, when it moved, the
actions of the events since the last one seen name what to re-read, by prefix (`_TOUCHES`): keys
and tenants (the accounts); models, aliases, runtimes and evaluations (the model registry);
deployments (their rows, never a placement: placing is the leader's, and the node sets they
changed); nodes and enrollment (the fleet's node records, keeping each node's live heartbeat
state); quotas (their limits). Events that record what only one controller saw (a node's
reachability on its channel, refused messages) change no record and re-read nothing. The leader
runs the feed too: followers write their own events (node enrollment over their channel, sign-ins).

Quotas on several gateways: each controller enforces its share of the per-minute and concurrency
limits, split among the live controllers (rows seen within `LIVE_LEASES` lease periods), and
re-reads the UTC day's tokens from every controller's usage rows (`USAGE_REFRESH_S`).

A controller whose row has not been written for `LIVE_LEASES` lease periods is gone (`gone`):
killed, or its host lost. What it left unfinished never finishes (it held the calls and ran the
backups), so the leader fails it (`Orphans`: its workloads, with signed receipts, and its running
backups); a controller that starts again fails its own leftovers itself (`Workloads.load`). Rows
that name no controller (written before they were named) are failed once no other controller runs.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Collection, Iterable, Sequence
from typing import Final, NoReturn, Protocol

import trio

from nexa.config import ClusterConfig
from nexa.control import store as st
from nexa.control.datapath.quotas import UNFLUSHED_S, Quotas
from nexa.errors import NexaError, StoreUnusable

log = logging.getLogger(__name__)

#: Audit action prefix → the parts of the state it changes (`ChangeFeed` re-reads them). A
#: deployment change also writes the node sets it touched, which the fleet holds.
_TOUCHES: Final[tuple[tuple[str, frozenset[str]], ...]] = (
    ("key.", frozenset({"accounts"})),
    ("tenant.", frozenset({"accounts"})),
    ("model.", frozenset({"models"})),
    ("alias.", frozenset({"models"})),
    ("runtime.", frozenset({"models"})),
    ("evaluation.", frozenset({"models"})),
    ("deployment.", frozenset({"deployments", "fleet"})),
    ("rollout.", frozenset({"deployments", "fleet"})),
    ("node.", frozenset({"fleet"})),
    ("enrollment", frozenset({"fleet"})),
    ("quota.", frozenset({"quotas"})),
)
#: Actions that record what one controller saw on its own channel and change no stored record:
#: each controller keeps its own view of them (liveness is per channel).
_LOCAL_ONLY: Final = frozenset(
    {"node.reachable", "node.unreachable", "node.message.rejected", "node.rotate_keys_requested"}
)
#: The order parts are re-read in: what a later one reads (tenants, models, node records) first.
PARTS: Final = ("accounts", "models", "fleet", "deployments", "quotas")
#: Events read per page while catching up; past `_REREAD_ALL_AFTER` events behind, everything is
#: re-read instead (cheaper than reading that many events).
_PAGE: Final = 500
_REREAD_ALL_AFTER: Final = 2000
#: The day's tokens (a sum over the day's usage rows) and the live controllers are re-read at most
#: this often: metering writes usage once a second (`gateway.metering_flush_s`) anyway.
USAGE_REFRESH_S: Final = 1.0
#: A controller whose row was written within this many lease periods counts as live for quotas.
LIVE_LEASES: Final = 3


class Refreshable(Protocol):
    """A part of the in-memory state that can re-read itself from the store."""

    async def refresh(self) -> None: ...


def touched(actions: Iterable[str]) -> set[str]:
    """The parts of the state (names in `PARTS`) that these audit actions changed."""
    parts: set[str] = set()
    for action in actions:
        if action in _LOCAL_ONLY:
            continue
        for prefix, names in _TOUCHES:
            if action.startswith(prefix):
                parts |= names
    return parts


class Orphaned(Protocol):
    """What fails the unfinished work of gone controllers (`Workloads`, `Jobs`): how many it failed."""

    async def fail_orphaned(self, controllers: Collection[str | None]) -> int: ...


def gone(controllers: Iterable[st.ControllerRow], me: str, *, now: float, lease_s: float) -> dict[str, float]:
    """id → last seen, of the controllers whose row was not written within `LIVE_LEASES` lease
    periods (never `me`, which runs)."""
    return {r.id: r.seen_at for r in controllers if r.id != me and now - r.seen_at > LIVE_LEASES * lease_s}


async def other_live_controllers(store: st.Store, me: str, lease_s: float) -> list[str]:
    """The other controllers on `store` not `gone`, by id (`KeyRotation`'s refusal)."""
    rows, now = await store.read(st.controllers_now, time.time())
    return [r.id for r in rows if r.id != me and now - r.seen_at <= LIVE_LEASES * lease_s]


def quota_share(controllers: list[st.ControllerRow], me: str, *, now: float, lease_s: float) -> tuple[int, int]:
    """(live controllers, this one's rank among them by id): rows seen within `LIVE_LEASES` lease
    periods, this controller always counted."""
    live = sorted({r.id for r in controllers if now - r.seen_at <= LIVE_LEASES * lease_s} | {me})
    return len(live), live.index(me)


class ChangeFeed:
    """The poll loop (`run`), a catch-up on demand (`catch_up`) and a full re-read (`refresh_all`)."""

    def __init__(
        self,
        store: st.Store,
        cfg: ClusterConfig,
        *,
        controller_id: str,
        accounts: Refreshable,
        models: Refreshable,
        fleet: Refreshable,
        deployments: Refreshable,
        quotas: Quotas,
        unflushed_s: float = UNFLUSHED_S,
    ) -> None:
        self._store = store
        #: Tokens finished here this recently count from memory at a day refresh (`Quotas.refresh_day`).
        self._unflushed_s = unflushed_s
        self._cfg = cfg
        self._controller_id = controller_id
        self._parts: dict[str, Refreshable] = {
            "accounts": accounts,
            "models": models,
            "fleet": fleet,
            "deployments": deployments,
            "quotas": quotas,
        }
        self._quotas = quotas
        #: The audit seq whose changes the in-memory state shows (None: not read yet).
        self.seq: int | None = None
        self._usage_at = -float("inf")
        # One poll at a time: the loop's and a forwarded write's catch-up.
        self._lock = trio.Lock()

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> NoReturn:
        """Re-read everything once (what changed between the loads at start and now), then poll
        every `refresh_s` until cancelled. A store failure in a poll is logged; the next retries."""
        await self.refresh_all()
        task_status.started()
        while True:
            await trio.sleep(self._cfg.refresh_s)
            try:
                await self.poll()
            except StoreUnusable:
                raise
            except NexaError as exc:
                log.warning("reading the change feed failed (%s); the next poll tries again", exc.code)

    async def catch_up(self) -> None:
        """Poll now: after a write forwarded to the leader, so reads here show it."""
        await self.poll()

    async def refresh_all(self) -> None:
        """Re-read every part from the store (at start, and before a follower's first act as leader)."""
        async with self._lock:
            seq, _ = await self._store.read(st.audit_head)
            await self._refresh(set(PARTS))
            await self._refresh_usage(force=True)
            self.seq = seq

    async def poll(self) -> set[str]:
        """One look at the audit head; re-read what changed since the last. The parts re-read."""
        async with self._lock:
            seq, _ = await self._store.read(st.audit_head)
            parts: set[str] = set()
            last = self.seq
            if last is None or seq < last or seq - last > _REREAD_ALL_AFTER:
                parts = set(PARTS)  # never read, or the chain was replaced (a restore): everything
            elif seq > last:
                parts = touched(await self._actions(last, seq))
            # The parts are read after the head: they show at least every change up to `seq`.
            await self._refresh(parts)
            await self._refresh_usage(force=False)
            self.seq = seq
        return parts

    async def _actions(self, after: int, head: int) -> set[str]:
        actions: set[str] = set()
        while after < head:
            events = await self._store.read(st.list_audit, st.AuditQuery(after_seq=after, limit=_PAGE))
            if not events:
                break
            actions.update(e.action for e in events)
            after = events[-1].seq
        return actions

    async def _refresh(self, parts: set[str]) -> None:
        for name in PARTS:
            if name in parts:
                await self._parts[name].refresh()
        if parts:
            log.debug("change feed re-read %s", ", ".join(n for n in PARTS if n in parts))

    async def _refresh_usage(self, *, force: bool) -> None:
        now = trio.current_time()
        if not force and now - self._usage_at < USAGE_REFRESH_S:
            return
        self._usage_at = now
        rows, now_s = await self._store.read(st.controllers_now, time.time())
        count, rank = quota_share(rows, self._controller_id, now=now_s, lease_s=self._cfg.lease_s)
        self._quotas.share(count, rank)
        await self._quotas.refresh_day(unflushed_s=self._unflushed_s)


class Orphans:
    """On the leader only (`Leadership.while_leader`): every `lease_s`, fail what the `gone`
    controllers left unfinished (`parts`, each `Orphaned`), and what names no controller once no
    other one runs. A controller is swept once per time it was last seen (and again by each new
    leader): gone, it writes nothing new."""

    def __init__(
        self,
        store: st.Store,
        cfg: ClusterConfig,
        *,
        controller_id: str,
        parts: Sequence[Orphaned],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._cfg = cfg
        self._controller_id = controller_id
        self._parts = parts
        self._clock = clock
        self._swept: dict[str | None, float] = {}

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> NoReturn:
        """Sweep now, then every `lease_s`, until cancelled; a store failure is logged and the next retries."""
        self._swept.clear()  # a new leadership: the last leader may have died in the middle of one
        task_status.started()
        while True:
            try:
                await self.sweep()
            except StoreUnusable:
                raise
            except NexaError as exc:
                log.warning("failing the work of stopped controllers failed (%s); the next round retries", exc.code)
            await trio.sleep(self._cfg.lease_s)

    async def sweep(self) -> int:
        """One round: fail the unfinished work of controllers gone since the last; how much."""
        # `seen_at` and now on the store's clock (the database server's on PostgreSQL).
        rows, now = await self._store.read(st.controllers_now, self._clock())
        dead: dict[str | None, float] = {}
        dead.update(gone(rows, self._controller_id, now=now, lease_s=self._cfg.lease_s))
        if all(r.id == self._controller_id or r.id in dead for r in rows):
            dead[None] = 0.0  # no other controller runs: rows that name none are nobody's
        fresh = {name: seen for name, seen in dead.items() if self._swept.get(name) != seen}
        if not fresh:
            return 0
        failed = 0
        for part in self._parts:
            failed += await part.fail_orphaned(fresh.keys())
        self._swept.update(fresh)
        if failed:
            names = sorted(name or "none named" for name in fresh)
            log.warning(
                "failed %d unfinished workloads and jobs of stopped controllers (%s)",
                failed,
                ", ".join(names),
                extra={"fields": {"controllers": names, "failed": failed}},
            )
        return failed
