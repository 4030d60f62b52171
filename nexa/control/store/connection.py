"""`open_store`: lock the state dir, open and migrate the database, take an epoch; `Store`, its lanes.

Every transaction is one short sync function `verb_noun(db, ...)` wrapped whole in `with txn(db):`;
`Store.run` executes it on a single lane (one connection, CapacityLimiter(1)) off the event loop,
so no other task's SQL can interleave with a half-done transaction.

The SQLite file (the default) is opened by `sqlite`; with `[store] url` set, `open_store` opens
PostgreSQL instead (`pg.open_postgres`: imported then only). The Store and its lanes are the same
over either backend's connections (`sqlite.LiteDb`, `pg.PgDb`).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from functools import partial
from pathlib import Path
from typing import Any, Final, Literal, TypeAlias

import trio

from nexa.config import StoreConfig
from nexa.control.store import sqlite
from nexa.control.store.sql import PRUNE_BATCH, Db, T
from nexa.errors import StateDirLocked, StoreError

DB_FILE: Final = "control.db"
LOCK_FILE: Final = "control.lock"


Backend: TypeAlias = Literal["sqlite", "postgresql"]


class Store:
    """Async facade over one connection: `await store.run(txn_fn, *args)`.

    Long reads (`verify_audit`, audit pages) go to `store.read`: a second, read-only connection on
    its own lane. WAL (a REPEATABLE READ transaction on PostgreSQL) lets it read a consistent
    snapshot while the writer commits, so a long read never holds the store lane.

    `call` runs a transaction function on its backend's connection (`sqlite.call`, `pg.call`): each
    backend raises nexa's errors (`StoreConflict`, `StoreBusy`, `StoreUnavailable`, `StoreUnusable`,
    `StoreError`), never its library's.
    """

    def __init__(
        self,
        db: Db,
        *,
        epoch: int,
        inline: bool = False,
        reader: Db | None = None,
        backend: Backend = "sqlite",
        call: Callable[..., Any] | None = None,
        shared: bool | None = None,
    ) -> None:
        self._db = db
        self._limiter = trio.CapacityLimiter(1)
        self._reader = reader
        self._read_limiter = trio.CapacityLimiter(1)
        self._inline = inline
        self._call: Callable[..., Any] = call or sqlite.call
        #: The strictly increasing epoch this process took when it opened the store.
        self.epoch = epoch
        #: Which database holds the state: the embedded "sqlite" file or a shared "postgresql" one.
        self.backend: Backend = backend
        #: Whether other controller processes write this store too (several controllers on
        #: PostgreSQL, or gateway workers sharing the SQLite file): the leadership is then leased
        #: and each process follows the others' writes (`control.cluster`). None: PostgreSQL's.
        self.shared: bool = backend == "postgresql" if shared is None else shared

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """Run one transaction function on the store lane. Cancellation waits for it to finish."""
        return await self._on(self._db, self._limiter, fn, *args)

    async def read(self, fn: Callable[..., T], *args: object) -> T:
        """Run a read-only function on the reader lane (the store lane when there is no reader).
        A write attempted there fails with StoreError; the store lane stays free meanwhile."""
        if self._reader is None:
            return await self.run(fn, *args)
        return await self._on(self._reader, self._read_limiter, fn, *args)

    async def _on(self, db: Db, limiter: trio.CapacityLimiter, fn: Callable[..., T], *args: object) -> T:
        call = self._call
        if self._inline:
            # Tests under autojump_clock keep real threads out (trio issue #456).
            async with limiter:
                result: T = call(fn, db, *args)
                return result
        done: T = await trio.to_thread.run_sync(call, fn, db, *args, limiter=limiter)
        return done

    async def prune(self, fn: Callable[[Db, float], int], before: float) -> int:
        """Run a `prune_*` function batch after batch until it deletes less than a batch; the total.
        Other transactions get the lane between batches."""
        total = 0
        while True:
            deleted = await self.run(fn, before)
            total += deleted
            if deleted < PRUNE_BATCH:
                return total


#: What the composition root opens its store with (`service.serve_control(open_store=...)`), given
#: the state dir and `[store]`: `open_store` itself, or a test's variant of it
#: (`functools.partial(open_store, inline=True)`).
StoreOpener: TypeAlias = Callable[[str | Path, StoreConfig], AbstractAsyncContextManager[Store]]


@contextlib.asynccontextmanager
async def open_store(
    state_dir: str | Path, config: StoreConfig | None = None, *, inline: bool = False, worker: bool = False
) -> AsyncIterator[Store]:
    """Lock the state dir, open and migrate the database, take a new epoch; close on exit.

    Opens no tasks. Raises StateDirLocked if another process holds the state dir. With
    `config.url`, the PostgreSQL database there instead (`pg.open_postgres`): no state-dir lock,
    since several controllers share it; ConfigError or StoreError (unreachable, not nexa's) at start.
    `worker`: a gateway worker's (`[http] workers`): the SQLite file is shared with the other
    workers (`Store.shared`) and the state dir is locked by the `nexa control` that supervises them.
    """
    if config is not None and config.url:
        from nexa.control.store import pg  # psycopg is loaded only for a PostgreSQL store

        async with pg.open_postgres(config, inline=inline) as store:
            yield store
        return
    sqlite.apply_best_practice()
    root = Path(state_dir)
    lock_fd = None if worker else await trio.to_thread.run_sync(lock_state_dir, root)
    try:
        db, epoch = await trio.to_thread.run_sync(partial(sqlite.open_db, root / DB_FILE, shared=worker))
        try:
            reader = await trio.to_thread.run_sync(partial(sqlite.open_reader, root / DB_FILE, shared=worker))
            try:
                yield Store(db, epoch=epoch, inline=inline, reader=reader, shared=worker)
            finally:
                reader.close()
        finally:
            db.close()
    finally:
        if lock_fd is not None:
            os.close(lock_fd)


def lock_state_dir(root: Path) -> int:
    """Lock `root` for this process (created 0700 if missing): the fd to close to release it.
    StateDirLocked if another process holds it."""
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(root / LOCK_FILE, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        raise StoreError(f"cannot use state directory {root}: {exc.strerror}") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise StateDirLocked(state_dir=str(root)) from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd
