"""Which controller leads: `Leadership`, one per controller process, over the store's lease row.

On the embedded SQLite store there is one controller and it always leads (`Leadership.solo`): no
lease, no round-trip, writes go straight to `Store.run`. On a shared (PostgreSQL) store every
controller competes for the lease (`Leadership.leased`, `store.lease`): the holder renews it every
`[cluster] renew_s`; the others try to take it each round and do so once it has not been renewed
for `lease_s`, at epoch + 1.

Fencing: every write only the leader may make (desired sets, placement, re-placement, rollout
steps) goes through `Leadership.write`, which checks the lease and epoch in the write's own
transaction. A deposed leader's write fails with NotLeader, writes nothing, and the controller
steps down at once: every `while_leader` scope is cancelled.

The controllers sign for one another, so they share the controller keys: the first controller's
`<state_dir>/keys` is copied (mode 0700, files 0600) to each other one before that one first
starts, as configured secret files are. Their fingerprint is stored in the database by the first
controller; one whose keys differ is refused at start (`store.check_keys_fingerprint`).
"""

from __future__ import annotations

import logging
import math
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Final, NoReturn, TypeVar

import trio

from nexa.config import ClusterConfig, HttpConfig, parse_host_port
from nexa.contracts.api import ClusterMember, ClusterView
from nexa.control import store as st
from nexa.errors import NotLeader, StoreError, StoreUnusable

log = logging.getLogger(__name__)

T = TypeVar("T")

LEADER: Final = "leader"
FOLLOWER: Final = "follower"
#: The longest a clean shutdown waits for the store to release the lease.
_RELEASE_TIMEOUT_S: Final = 2.0


def controller_identity(cluster: ClusterConfig, http: HttpConfig) -> tuple[str, str]:
    """(controller id, address) as configured, else `<hostname>:<http port>` and `http://<http.listen>`
    (`https://` when it serves TLS): both from configuration, so they stay the same across restarts."""
    host, port = parse_host_port(http.listen)
    controller_id = cluster.controller_id or f"{socket.gethostname()}:{port}"
    scheme = "https" if http.tls_cert_file else "http"
    address = cluster.address or f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"
    return controller_id, address


class Leadership:
    """This controller's role (`is_leader`, `epoch`), the loop that keeps it (`run`), the fenced
    write path (`write`) and the tasks that run only while it leads (`while_leader`)."""

    def __init__(
        self,
        store: st.Store,
        *,
        cfg: ClusterConfig | None,
        controller_id: str,
        address: str,
        epoch: int | None,
        clock: Callable[[], float],
    ) -> None:
        self._store = store
        self._cfg = cfg  # None: solo
        self.controller_id = controller_id
        self.address = address
        self._solo_epoch = epoch
        self._clock = clock
        self._started_at = clock()
        self._leading = cfg is None
        self._epoch = 0  # leased: the epoch held, or last held (0: never led)
        self._renewed_at = 0.0  # leased: `clock()` of the last renewal that succeeded
        self._deadline = -math.inf  # leased: trio time at which the leader stops acting as one
        self._seen: st.LeaseRow | None = None  # the lease as this controller last read it
        #: The store's clock minus `clock()`, as measured at this controller's last round (0 on
        #: SQLite): lease times are the store's (the database server's on PostgreSQL).
        self._offset = 0.0
        self._term = 0  # one up at each start of a leadership
        self._changed = trio.Event()  # set (and replaced) at each change of role or epoch
        self._scopes: set[trio.CancelScope] = set()
        self._listeners: list[Callable[[Leadership], None]] = []

    @classmethod
    def solo(
        cls, store: st.Store, epoch: int | None = None, *, controller_id: str = "", address: str = ""
    ) -> Leadership:
        """The only controller on its store (SQLite): always the leader, never a lease round-trip.

        `epoch`: the one it signs with; None (the composition root): the store's, read at each use,
        since a recovery's end moves it (`control.operations.recovery`)."""
        return cls(store, cfg=None, controller_id=controller_id, address=address, epoch=epoch, clock=time.time)

    @classmethod
    def leased(
        cls,
        store: st.Store,
        cfg: ClusterConfig,
        *,
        controller_id: str,
        address: str,
        clock: Callable[[], float] = time.time,
    ) -> Leadership:
        """One of several controllers on a shared store, leading while it holds the lease.
        `clock`: the wall clock the lease's times are in (a test passes a fake one)."""
        return cls(store, cfg=cfg, controller_id=controller_id, address=address, epoch=None, clock=clock)

    # ---- what it is now -----------------------------------------------------------------------

    @property
    def is_leader(self) -> bool:
        return self._leading

    @property
    def role(self) -> str:
        return LEADER if self._leading else FOLLOWER

    @property
    def epoch(self) -> int:
        """The epoch it signs with while it leads; a follower's is the last one it held (0: never),
        so nothing it might still send outranks the leader's."""
        if self._cfg is None:
            return self._store.epoch if self._solo_epoch is None else self._solo_epoch
        return self._epoch

    @property
    def leader_address(self) -> str | None:
        """Where the leader's API is (this controller's own while it leads); None while none leads."""
        if self._leading:
            return self.address
        seen = self._seen
        return seen.address if seen is not None and not seen.expired(self.store_clock()) else None

    @property
    def leader_id(self) -> str | None:
        """The id of the controller that leads (this one's while it leads); None while none leads."""
        if self._leading:
            return self.controller_id
        seen = self._seen
        return seen.holder if seen is not None and not seen.expired(self.store_clock()) else None

    @property
    def lease_age_s(self) -> float | None:
        """Seconds since the leader's lease was last renewed, as known here; None without a lease."""
        if self._cfg is None:
            return None
        if self._leading:
            return max(0.0, self.store_clock() - self._renewed_at)
        seen = self._seen
        return None if seen is None else max(0.0, self.store_clock() - seen.renewed_at)

    def store_clock(self) -> float:
        """Now on the store's clock, as this host's clock and the last round's offset tell."""
        return self._clock() + self._offset

    def on_change(self, callback: Callable[[Leadership], None]) -> None:
        """Call `callback` (sync, must not block) when the role or the epoch changes."""
        self._listeners.append(callback)

    # ---- the loop -----------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Take or renew the lease every `renew_s` and write this controller's row; `started()`
        after the first round, so the role is known once it has started. A store failure in that
        first round is a failed start; later ones are logged and the next round tries again.
        Cancelled (shutdown): the lease is released, so another controller takes it at once."""
        cfg = self._cfg
        if cfg is None:
            task_status.started()
            await trio.sleep_forever()
        try:
            began = trio.current_time()
            await self._round(cfg, first=True)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(self._watchdog, cfg)
                task_status.started()
                while True:
                    # Every renew_s from the last round's start, however long that round took.
                    began = max(began + cfg.renew_s, trio.current_time())
                    await trio.sleep_until(began)
                    await self._round(cfg, first=False)
        finally:
            with trio.move_on_after(_RELEASE_TIMEOUT_S, shield=True):
                await self.step_down()

    async def _round(self, cfg: ClusterConfig, *, first: bool) -> None:
        began, now = trio.current_time(), self.store_clock()
        try:
            if self._leading:
                epoch = self._epoch
                kept = await self._store.run(st.renew_lease, self.controller_id, epoch, now, cfg.lease_s)
                if self._leading and self._epoch == epoch:  # nothing stepped it down meanwhile
                    if kept:
                        self._renewed(now, began, cfg)
                    else:
                        self._lose("its lease was taken or expired")
            if not self._leading:
                row = await self._store.run(st.acquire_lease, self.controller_id, self.address, now, cfg.lease_s)
                if row is not None:
                    self._take(row, began, cfg)
                else:
                    self._seen = await self._store.run(st.read_lease)
            local = self._clock()
            stored = await self._store.run(st.save_controller, self._row(local + self._offset))
            self._offset = stored - local
        except StoreUnusable:
            raise
        except StoreError as exc:
            if first:
                raise
            # The watchdog steps a leader down if this goes on; a follower just tries again.
            log.warning("leadership round failed (%s); the next one tries again", exc.message)

    def _renewed(self, now: float, began: float, cfg: ClusterConfig) -> None:
        # The stored expiry is `now + lease_s`, `now` read when the round began; from then on
        # another controller may take the lease (by its own clock). Stepping down at
        # `lease_s - renew_s` after the round began keeps one renewal period as a margin for the
        # clocks of the controllers drifting apart and for the tasks noticing their cancellation.
        # Writes are fenced whatever the timing; this bounds what is not a write (sets pushed,
        # reconciler decisions) to before the lease can change hands.
        self._renewed_at = now
        self._deadline = began + cfg.lease_s - cfg.renew_s

    def _take(self, row: st.LeaseRow, began: float, cfg: ClusterConfig) -> None:
        changed = not self._leading or self._epoch != row.epoch
        self._leading, self._epoch, self._seen = True, row.epoch, row
        self._renewed(row.renewed_at, began, cfg)
        if changed:
            self._term += 1
            log.info(
                "controller %s leads at epoch %d",
                self.controller_id,
                row.epoch,
                extra={"fields": {"controller": self.controller_id, "epoch": row.epoch}},
            )
            self._notify()

    def _lose(self, reason: str) -> None:
        """Step down now: stop everything that runs only while leading. Sync, so that nothing
        else runs between learning it and acting on it."""
        if not self._leading:
            return
        self._leading = False
        for scope in self._scopes:
            scope.cancel()
        log.warning(
            "controller %s no longer leads (epoch %d): %s",
            self.controller_id,
            self._epoch,
            reason,
            extra={"fields": {"controller": self.controller_id, "epoch": self._epoch}},
        )
        self._notify()

    def _notify(self) -> None:
        for listener in self._listeners:
            listener(self)
        self._changed.set()
        self._changed = trio.Event()

    async def _watchdog(self, cfg: ClusterConfig) -> NoReturn:
        """Step the leader down once its renewals have failed for `lease_s - renew_s` (see
        `_renewed`), even while a renewal still hangs on an unreachable store."""
        while True:
            changed = self._changed
            if not self._leading:
                await changed.wait()
                continue
            await trio.sleep_until(self._deadline)
            if self._leading and trio.current_time() >= self._deadline:
                self._lose(f"no renewal succeeded for {cfg.lease_s - cfg.renew_s:g} s")

    def _row(self, now: float) -> st.ControllerRow:
        return st.ControllerRow(
            id=self.controller_id,
            address=self.address,
            role=self.role,
            epoch=self.epoch,
            started_at=self._started_at,
            seen_at=now,
        )

    async def step_down(self) -> None:
        """Clean shutdown: stop leading and release the lease (it expires now), so another
        controller takes it at its next round, not `lease_s` later. A store failure is logged."""
        if self._cfg is None:
            return
        self._lose("it is shutting down")
        if self._epoch == 0:
            return
        try:
            # Conditional on (holder, epoch): a lease another controller took meanwhile stays.
            await self._store.run(st.release_lease, self.controller_id, self._epoch)
            await self._store.run(st.save_controller, self._row(self.store_clock()))
        except StoreError as exc:
            log.warning("could not release the leader's lease (%s): it expires by itself", exc.message)

    # ---- what runs only while leading ------------------------------------------------------------

    async def write(self, fn: Callable[..., T], *args: object) -> T:
        """A leader-only transaction: `fn(db, *args)` with the lease checked first in the same
        transaction. NotLeader (nothing written) steps this controller down at once. Solo:
        `store.run(fn, *args)`."""
        if self._cfg is None:
            return await self._store.run(fn, *args)
        if not self._leading:
            raise NotLeader(leader_address=self.leader_address)
        epoch = self._epoch
        try:
            result: T = await self._store.run(st.fenced_write, self._clock, self.controller_id, epoch, fn, *args)
        except NotLeader:
            if self._epoch == epoch:
                self._lose("a leader-only write found the lease taken or expired")
            raise
        return result

    async def while_leader(
        self, fn: Callable[[], Awaitable[None]], *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> NoReturn:
        """Forever: wait until this controller leads, run `fn()` in a cancel scope that stepping
        down cancels, and again at the next leadership. A `fn` that returns runs once per leadership."""
        task_status.started()
        while True:
            changed = self._changed
            if not self._leading:
                await changed.wait()
                continue
            with trio.CancelScope() as scope:
                self._scopes.add(scope)
                try:
                    await fn()
                    await trio.sleep_forever()  # until this leadership ends
                finally:
                    self._scopes.discard(scope)

    # ---- the cluster as the store holds it ---------------------------------------------------------

    async def view(self) -> ClusterView:
        """Every controller on the store, which one leads and the ages of their rows and lease
        (`GET /api/v1/cluster`). Solo: this controller, the leader."""
        if self._cfg is None:
            me = ClusterMember(
                id=self.controller_id,
                address=self.address,
                role=LEADER,
                epoch=self.epoch,
                seen_age_s=0.0,
                leader=True,
            )
            return ClusterView(
                leader=self.controller_id, epoch=self.epoch, answered_by=self.controller_id, controllers=[me]
            )
        lease = await self._store.run(st.read_lease)
        rows = await self._store.run(st.list_controllers)
        now = self.store_clock()
        holder = lease.holder if lease is not None and not lease.expired(now) else None
        members = [
            ClusterMember(
                id=row.id,
                address=row.address,
                role=row.role,
                epoch=row.epoch,
                seen_age_s=max(0.0, now - row.seen_at),
                leader=row.id == holder,
                lease_age_s=max(0.0, now - lease.renewed_at) if lease is not None and row.id == holder else None,
            )
            for row in rows
        ]
        return ClusterView(
            leader=holder,
            epoch=lease.epoch if lease is not None else 0,
            answered_by=self.controller_id,
            controllers=members,
        )
