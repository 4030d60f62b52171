"""The leader's lease, the controllers on one store, and the fingerprint of their shared keys.

One row (`leader_lease`, id 1) names the controller that may make leader-only writes and the epoch
it took. A takeover (the row absent or expired) takes a new epoch from `meta.epoch` in the same
transaction, so epochs stay strictly increasing across every controller on the store. Fencing:
every leader-only write runs `check_lease` first in its own transaction (`fenced_write`); on
PostgreSQL the lease row is read `FOR SHARE`, so a takeover (which locks it `FOR UPDATE`) waits
until that write has committed, and a write after the takeover sees the new holder and fails. On
SQLite writers are serialised by the database itself.

Times are the store's (Unix seconds): on PostgreSQL the database server's clock, read in each
lease transaction (`store_now`), so controllers whose clocks disagree still agree on when a lease
expires and when a controller was last seen; on SQLite (one host) the caller's clock, the host's.
A lease is expired when `expires_at < now`.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Final

import attrs

from nexa.control.store.schema import take_epoch
from nexa.control.store.sql import Db, T, as_float, as_int, is_postgres, meta, txn
from nexa.errors import ControllerKeysDiffer, NotLeader

#: `release_lease` sets the expiry to this: expired for every clock.
_RELEASED_AT: Final = 0.0
_LEASE_COLUMNS: Final = "holder, epoch, address, acquired_at, renewed_at, expires_at"


@attrs.frozen(kw_only=True)
class LeaseRow:
    """The leader's lease: who holds it, at which epoch, where it is reached, and its times."""

    holder: str
    epoch: int
    #: The base URL of the holder's API (`[cluster] address`): where followers forward writes.
    address: str
    acquired_at: float
    renewed_at: float
    expires_at: float

    def expired(self, now: float) -> bool:
        return self.expires_at < now


@attrs.frozen(kw_only=True)
class ControllerRow:
    """One controller on the store as it last wrote itself (`GET /api/v1/cluster`)."""

    id: str
    address: str
    #: "leader" or "follower", as that controller saw itself at `seen_at`.
    role: str
    epoch: int
    started_at: float
    seen_at: float


def _lease(db: Db, *, lock: str = "") -> LeaseRow | None:
    clause = f" {lock}" if lock and is_postgres(db) else ""
    rows = db.execute(f"SELECT {_LEASE_COLUMNS} FROM leader_lease WHERE id = 1{clause}").fetchall()  # noqa: S608
    if not rows:
        return None
    holder, epoch, address, acquired_at, renewed_at, expires_at = rows[0]
    return LeaseRow(
        holder=str(holder),
        epoch=as_int(epoch),
        address=str(address),
        acquired_at=as_float(acquired_at),
        renewed_at=as_float(renewed_at),
        expires_at=as_float(expires_at),
    )


def store_now(db: Db, host_now: float) -> float:
    """The store's clock: the PostgreSQL server's (`clock_timestamp()`, Unix seconds), or on SQLite
    `host_now`, the clock of the one host the database lives on."""
    if not is_postgres(db):
        return host_now
    return as_float(db.execute("SELECT extract(epoch FROM clock_timestamp())::float8").fetchall()[0][0])


def read_lease(db: Db) -> LeaseRow | None:
    """The lease as stored now; None before any controller took it."""
    with txn(db):
        return _lease(db)


def acquire_lease(db: Db, holder: str, address: str, now: float, lease_s: float) -> LeaseRow | None:
    """Take the lease for `holder` until `now + lease_s`; None while another holds an unexpired one.

    Absent or expired (whoever held it, `holder` too): a takeover at a new epoch (`take_epoch`), in
    this transaction. Held by `holder` and unexpired: renewed at its epoch. The row is locked
    (`FOR UPDATE` on PostgreSQL) so two controllers cannot both take it.
    """
    with txn(db):
        row = _lease(db, lock="FOR UPDATE")
        now = store_now(db, now)  # read once the row is ours: a wait for the lock is not counted
        if row is not None and not row.expired(now):
            if row.holder != holder:
                return None
            db.execute(
                "UPDATE leader_lease SET address = ?, renewed_at = ?, expires_at = ? WHERE id = 1",
                (address, now, now + lease_s),
            )
            return attrs.evolve(row, address=address, renewed_at=now, expires_at=now + lease_s)
        taken = LeaseRow(
            holder=holder,
            epoch=take_epoch(db),
            address=address,
            acquired_at=now,
            renewed_at=now,
            expires_at=now + lease_s,
        )
        values = (taken.holder, taken.epoch, taken.address, taken.acquired_at, taken.renewed_at, taken.expires_at)
        if row is None:
            # No row to lock yet: of two first takers, the second inserts nothing and stays a follower.
            db.execute(
                f"INSERT INTO leader_lease(id, {_LEASE_COLUMNS}) VALUES (1, ?, ?, ?, ?, ?, ?)"  # noqa: S608
                " ON CONFLICT(id) DO NOTHING",
                values,
            )
        else:
            db.execute(
                "UPDATE leader_lease SET holder = ?, epoch = ?, address = ?, acquired_at = ?, renewed_at = ?,"
                " expires_at = ? WHERE id = 1 AND holder = ? AND epoch = ?",
                (*values, row.holder, row.epoch),
            )
        return taken if db.changes() == 1 else None


def renew_lease(db: Db, holder: str, epoch: int, now: float, lease_s: float) -> bool:
    """Push the lease's expiry to `now + lease_s`; False (nothing changed) unless `holder` holds it
    at `epoch`, unexpired: an expired lease is not renewed, it is taken again at a new epoch."""
    with txn(db):
        now = store_now(db, now)
        db.execute(
            "UPDATE leader_lease SET renewed_at = ?, expires_at = ?"
            " WHERE id = 1 AND holder = ? AND epoch = ? AND expires_at >= ?",
            (now, now + lease_s, holder, epoch, now),
        )
        return db.changes() == 1


def release_lease(db: Db, holder: str, epoch: int) -> None:
    """A clean shutdown: the lease expires now, so another controller takes it at its next round
    instead of after `lease_s`. Nothing changes when `holder` no longer holds it at `epoch`."""
    with txn(db):
        db.execute(
            "UPDATE leader_lease SET expires_at = ? WHERE id = 1 AND holder = ? AND epoch = ?",
            (_RELEASED_AT, holder, epoch),
        )


def check_lease(db: Db, holder: str, epoch: int, now: float) -> None:
    """Raise NotLeader unless `holder` holds the lease at `epoch`, unexpired at `now`.

    Call it inside the transaction of the write it guards (`fenced_write`). On PostgreSQL the row
    is read `FOR SHARE`: a takeover's `FOR UPDATE` waits until this transaction ends.
    """
    with txn(db):
        row = _lease(db, lock="FOR SHARE")
        now = store_now(db, now)
        if row is None or row.holder != holder or row.epoch != epoch or row.expired(now):
            address = row.address if row is not None and row.holder != holder and not row.expired(now) else None
            raise NotLeader(leader_address=address)


def fenced_write(
    db: Db,
    clock: Callable[[], float],
    holder: str,
    epoch: int,
    fn: Callable[..., T],
    *args: object,
) -> T:
    """`fn(db, *args)` in one transaction with `check_lease` before it: a controller deposed
    meanwhile gets NotLeader and nothing of `fn` is written. `clock` is read inside the
    transaction, after any wait for the store lane."""
    with txn(db):
        check_lease(db, holder, epoch, clock())
        return fn(db, *args)


def save_controller(db: Db, row: ControllerRow) -> float:
    """Write (or refresh) this controller's row: each round of its leadership loop. `seen_at` is
    the store's time (`store_now`, `row.seen_at` on SQLite), which is returned."""
    with txn(db):
        row = attrs.evolve(row, seen_at=store_now(db, row.seen_at))
        db.execute(
            "INSERT INTO controller(id, address, role, epoch, started_at, seen_at) VALUES (?,?,?,?,?,?)"
            " ON CONFLICT(id) DO UPDATE SET address = excluded.address, role = excluded.role,"
            " epoch = excluded.epoch, started_at = excluded.started_at, seen_at = excluded.seen_at",
            (row.id, row.address, row.role, row.epoch, row.started_at, row.seen_at),
        )
    return row.seen_at


def controllers_now(db: Db, host_now: float) -> tuple[list[ControllerRow], float]:
    """Every controller's row and the store's time (`store_now`) to compare their `seen_at` with."""
    with txn(db):
        return list_controllers(db), store_now(db, host_now)


def list_controllers(db: Db) -> list[ControllerRow]:
    """Every controller that ever wrote its row on this store, by id (a stopped one stays, aging)."""
    with txn(db):
        rows = db.execute("SELECT id, address, role, epoch, started_at, seen_at FROM controller ORDER BY id").fetchall()
    return [
        ControllerRow(
            id=str(id_),
            address=str(address),
            role=str(role),
            epoch=as_int(epoch),
            started_at=as_float(started_at),
            seen_at=as_float(seen_at),
        )
        for id_, address, role, epoch, started_at, seen_at in rows
    ]


def check_keys_fingerprint(db: Db, fingerprint: str, replaces: Collection[str] = ()) -> None:
    """At start: the fingerprint of this controller's keys must be the one the store holds.

    The first controller on a store stores its own ('' until then). A stored fingerprint listed in
    `replaces` (the keys this keys directory rotated away from, `nexa keys rotate-controller`) is
    replaced by `fingerprint`. Any other raises ControllerKeysDiffer and changes nothing.
    """
    with txn(db):
        stored = str(meta(db, "keys_fingerprint", lock=True))  # two first controllers: one stores
        if stored == fingerprint:
            return
        if stored and stored not in replaces:
            raise ControllerKeysDiffer(stored=stored, got=fingerprint)
        db.execute("UPDATE meta SET value = ? WHERE key = 'keys_fingerprint'", (fingerprint,))
