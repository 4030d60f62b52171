"""The controller's durable state: one SQLite database through apsw. The only apsw importer.

Every transaction is one short sync function `_verb_noun(db, ...)` wrapped whole in `with _txn(db):`;
`Store.run` executes it on a single lane (one connection, CapacityLimiter(1)) off the event loop,
so no other task's SQL can interleave with a half-done transaction. Mutations append their audit
event inside the same transaction.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Final, TypeVar

import apsw
import apsw.bestpractice
import attrs
import trio

from nexa.contracts import codec
from nexa.contracts.api import AuditCheckpoint, AuditVerdict
from nexa.contracts.deployments import Deployment
from nexa.contracts.domain import (
    ApiKey,
    AuditDraft,
    AuditEvent,
    EnrollmentToken,
    EventId,
    KeyId,
    Node,
    Tenant,
    TenantId,
)
from nexa.contracts.gateway import (
    Capability,
    Priority,
    QuotaLimits,
    SignedReceipt,
    UsageRecord,
    UsageRow,
    WorkloadState,
)
from nexa.contracts.models import AliasReceipt, AliasRecord, EvaluationRecord, ModelRecord, ModelState, RuntimeRecord
from nexa.contracts.node import NodeInventory
from nexa.contracts.placement import PlacementDecision
from nexa.contracts.wire import DesiredAssignments
from nexa.errors import Conflict, NotFound, StateDirLocked, StoreError, StoreUnusable, Unauthenticated

T = TypeVar("T")

#: "NEXA" — marks the file as ours for `file(1)` and for a sanity check at open.
APPLICATION_ID: Final = 0x4E455841
DB_FILE: Final = "control.db"
LOCK_FILE: Final = "control.lock"
GENESIS_SHA256: Final = "0" * 64

# Each entry moves the schema from version i to i+1; never edit a released entry, append.
MIGRATIONS: Final[tuple[str, ...]] = (
    """
    CREATE TABLE meta (key TEXT PRIMARY KEY, value ANY) STRICT;
    INSERT INTO meta(key, value) VALUES ('epoch', 0), ('audit_head_seq', 0), ('audit_head_sha256', '');
    CREATE TABLE tenant (
        id TEXT PRIMARY KEY,
        display_name TEXT NOT NULL,
        created_at REAL NOT NULL
    ) STRICT;
    CREATE TABLE api_key (
        id TEXT PRIMARY KEY,
        name TEXT NOT NULL,
        role TEXT NOT NULL,
        tenant TEXT REFERENCES tenant(id),
        secret_sha256 TEXT NOT NULL UNIQUE,
        created_at REAL NOT NULL,
        created_by TEXT,
        revoked_at REAL
    ) STRICT;
    CREATE TABLE audit (
        seq INTEGER PRIMARY KEY,
        id TEXT NOT NULL UNIQUE,
        time REAL NOT NULL,
        actor_key_id TEXT,
        actor_role TEXT,
        action TEXT NOT NULL,
        target TEXT NOT NULL,
        prior_sha256 TEXT,
        next_sha256 TEXT,
        result TEXT NOT NULL,
        detail TEXT NOT NULL,
        prev_sha256 TEXT NOT NULL,
        sha256 TEXT NOT NULL
    ) STRICT;
    CREATE INDEX audit_action ON audit(action, seq);
    CREATE INDEX audit_actor ON audit(actor_key_id, seq);
    CREATE INDEX audit_target ON audit(target, seq);
    """,
    """
    CREATE TABLE enrollment_token (
        id TEXT PRIMARY KEY,
        token_sha256 TEXT NOT NULL UNIQUE,
        labels TEXT NOT NULL,
        created_at REAL NOT NULL,
        expires_at REAL NOT NULL,
        created_by TEXT,
        used_at REAL,
        used_by_node TEXT
    ) STRICT;
    CREATE TABLE node (
        id TEXT PRIMARY KEY,
        hostname TEXT NOT NULL,
        signing_public_key TEXT NOT NULL UNIQUE,
        curve_public_key TEXT NOT NULL UNIQUE,
        labels TEXT NOT NULL,
        enrolled_at REAL NOT NULL,
        admin_state TEXT NOT NULL,
        revoked_at REAL
    ) STRICT;
    CREATE TABLE node_inventory (
        node_id TEXT PRIMARY KEY REFERENCES node(id),
        body TEXT NOT NULL,
        reported_at REAL NOT NULL
    ) STRICT;
    CREATE TABLE node_desired (
        node_id TEXT PRIMARY KEY REFERENCES node(id),
        body TEXT NOT NULL
    ) STRICT;
    """,
    """
    CREATE TABLE runtime (
        name TEXT PRIMARY KEY,
        kind TEXT NOT NULL,
        image TEXT NOT NULL,
        body TEXT NOT NULL
    ) STRICT;
    CREATE TABLE model (
        name TEXT NOT NULL,
        version TEXT NOT NULL,
        state TEXT NOT NULL,
        sha256 TEXT NOT NULL,
        body TEXT NOT NULL,
        PRIMARY KEY (name, version)
    ) STRICT;
    CREATE INDEX model_sha256 ON model(sha256);
    CREATE TABLE evaluation (
        id TEXT PRIMARY KEY,
        model TEXT NOT NULL,
        version TEXT NOT NULL,
        passed INTEGER NOT NULL,
        recorded_at REAL NOT NULL,
        body TEXT NOT NULL,
        FOREIGN KEY (model, version) REFERENCES model(name, version)
    ) STRICT;
    CREATE INDEX evaluation_model ON evaluation(model, version, recorded_at);
    CREATE TABLE alias (
        name TEXT PRIMARY KEY,
        model TEXT NOT NULL,
        version TEXT NOT NULL,
        generation INTEGER NOT NULL,
        body TEXT NOT NULL,
        FOREIGN KEY (model, version) REFERENCES model(name, version)
    ) STRICT;
    CREATE TABLE alias_history (
        alias TEXT NOT NULL REFERENCES alias(name),
        generation INTEGER NOT NULL,
        body TEXT NOT NULL,
        PRIMARY KEY (alias, generation)
    ) STRICT;
    """,
    """
    CREATE TABLE deployment (
        name TEXT PRIMARY KEY,
        generation INTEGER NOT NULL,
        body TEXT NOT NULL,
        placement TEXT
    ) STRICT;
    """,
    # The gateway: tenant quotas, metered usage (metadata only, never payloads), canonical workloads.
    """
    CREATE TABLE quota (
        tenant TEXT PRIMARY KEY REFERENCES tenant(id),
        body TEXT NOT NULL,
        updated_at REAL NOT NULL,
        updated_by TEXT
    ) STRICT;
    CREATE TABLE usage (
        seq INTEGER PRIMARY KEY,
        request_id TEXT NOT NULL,
        workload_id TEXT,
        api TEXT NOT NULL,
        tenant TEXT NOT NULL,
        key_id TEXT NOT NULL,
        capability TEXT NOT NULL,
        alias TEXT NOT NULL,
        model TEXT NOT NULL,
        model_version TEXT NOT NULL,
        deployment TEXT NOT NULL,
        node_id TEXT NOT NULL,
        status TEXT NOT NULL,
        prompt_tokens INTEGER NOT NULL,
        completion_tokens INTEGER NOT NULL,
        queue_ms REAL NOT NULL,
        ttft_ms REAL,
        duration_ms REAL NOT NULL,
        finished_at REAL NOT NULL,
        canary INTEGER NOT NULL
    ) STRICT;
    CREATE INDEX usage_finished ON usage(finished_at);
    CREATE INDEX usage_tenant ON usage(tenant, finished_at);
    CREATE TABLE workload (
        tenant TEXT NOT NULL,
        workload_id TEXT NOT NULL,
        idempotency_key_sha256 TEXT NOT NULL,
        key_id TEXT NOT NULL,
        capability TEXT NOT NULL,
        alias TEXT NOT NULL,
        state TEXT NOT NULL,
        model TEXT NOT NULL,
        priority TEXT NOT NULL,
        accepted_at REAL NOT NULL,
        finished_at REAL,
        error TEXT,
        receipt TEXT,
        PRIMARY KEY (tenant, workload_id),
        UNIQUE (tenant, idempotency_key_sha256)
    ) STRICT;
    CREATE INDEX workload_unfinished ON workload(state) WHERE finished_at IS NULL;
    """,
    """
    CREATE INDEX workload_finished ON workload(finished_at) WHERE finished_at IS NOT NULL;
    """,
    # A digest of the envelope an idempotency key came with: a replay with another body is refused.
    """
    ALTER TABLE workload ADD COLUMN request_sha256 TEXT;
    """,
)

#: Rows one pruning transaction deletes at most, so the store lane is never held for long.
PRUNE_BATCH: Final = 5000


@contextlib.contextmanager
def _txn(db: apsw.Connection) -> Iterator[None]:
    """BEGIN … COMMIT, or ROLLBACK on error (apsw's `with db:`, typed as not swallowing errors)."""
    with db:
        yield


# bestpractice registers connection hooks, so it must run before any Connection is opened:
# WAL, busy timeout, foreign keys, no double-quoted strings, SQLite's log into `logging`.
apsw.bestpractice.apply(apsw.bestpractice.recommended)


class Store:
    """Async facade over one apsw connection: `await store.run(_txn_fn, *args)`.

    Long reads (`verify_audit`, audit pages) go to `store.read`: a second, read-only connection on
    its own lane. WAL lets it read a consistent snapshot while the writer commits, so a long read
    never holds the store lane.
    """

    def __init__(
        self, db: apsw.Connection, *, epoch: int, inline: bool = False, reader: apsw.Connection | None = None
    ) -> None:
        self._db = db
        self._limiter = trio.CapacityLimiter(1)
        self._reader = reader
        self._read_limiter = trio.CapacityLimiter(1)
        self._inline = inline
        #: The strictly increasing epoch this process took when it opened the store.
        self.epoch = epoch

    async def run(self, fn: Callable[..., T], *args: object) -> T:
        """Run one transaction function on the store lane. Cancellation waits for it to finish."""
        return await self._on(self._db, self._limiter, fn, *args)

    async def read(self, fn: Callable[..., T], *args: object) -> T:
        """Run a read-only function on the reader lane (the store lane when there is no reader).
        A write attempted there fails with StoreError; the store lane stays free meanwhile."""
        if self._reader is None:
            return await self.run(fn, *args)
        return await self._on(self._reader, self._read_limiter, fn, *args)

    async def _on(self, db: apsw.Connection, limiter: trio.CapacityLimiter, fn: Callable[..., T], *args: object) -> T:
        if self._inline:
            # Tests under autojump_clock keep real threads out (trio issue #456).
            async with limiter:
                return _translated(fn, db, *args)
        return await trio.to_thread.run_sync(_translated, fn, db, *args, limiter=limiter)

    async def prune(self, fn: Callable[[apsw.Connection, float], int], before: float) -> int:
        """Run a `prune_*` function batch after batch until it deletes less than a batch; the total.
        Other transactions get the lane between batches."""
        total = 0
        while True:
            deleted = await self.run(fn, before)
            total += deleted
            if deleted < PRUNE_BATCH:
                return total


def _translated(fn: Callable[..., T], db: apsw.Connection, *args: object) -> T:
    try:
        return fn(db, *args)
    except apsw.ConstraintError as exc:
        raise Conflict(f"conflicts with existing state ({_constraint(exc)})") from None
    except _UNUSABLE as exc:
        # The database itself is gone or damaged: retrying cannot help, the process ends (exit 3).
        raise StoreUnusable(f"the store is unusable: {type(exc).__name__}") from exc
    except apsw.Error as exc:
        raise StoreError(f"store failure: {type(exc).__name__}") from exc


_UNUSABLE: Final = (
    apsw.CorruptError,
    apsw.NotADBError,
    apsw.IOError,
    apsw.CantOpenError,
    apsw.ReadOnlyError,
    apsw.ConnectionClosedError,
)


def _constraint(exc: apsw.ConstraintError) -> str:
    text = str(exc)
    return text.split(":", 1)[-1].strip() if "UNIQUE" in text or "FOREIGN" in text else "constraint"


@contextlib.asynccontextmanager
async def open_store(state_dir: str | Path, *, inline: bool = False) -> AsyncIterator[Store]:
    """Lock the state dir, open and migrate the database, take a new epoch; close on exit.

    Opens no tasks. Raises StateDirLocked if another process holds the state dir.
    """
    root = Path(state_dir)
    lock_fd = await trio.to_thread.run_sync(_lock_state_dir, root)
    try:
        db, epoch = await trio.to_thread.run_sync(_open_db, root / DB_FILE)
        try:
            reader = await trio.to_thread.run_sync(_open_reader, root / DB_FILE)
            try:
                yield Store(db, epoch=epoch, inline=inline, reader=reader)
            finally:
                reader.close()
        finally:
            db.close()
    finally:
        os.close(lock_fd)


def _lock_state_dir(root: Path) -> int:
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


def _open_db(path: Path) -> tuple[apsw.Connection, int]:
    try:
        db = apsw.Connection(str(path))
    except apsw.Error as exc:
        raise StoreError(f"cannot open {path}: {exc}") from None
    try:
        db.execute("PRAGMA synchronous=FULL")
        _migrate(db)
        return db, _take_epoch(db)
    except apsw.Error as exc:
        db.close()
        raise StoreError(f"cannot prepare {path}: {type(exc).__name__}: {exc}") from None
    except BaseException:
        db.close()
        raise


def _open_reader(path: Path) -> apsw.Connection:
    """The read-only second connection; opened after `_open_db` migrated the schema and set WAL."""
    try:
        return apsw.Connection(str(path), flags=apsw.SQLITE_OPEN_READONLY)
    except apsw.Error as exc:
        raise StoreError(f"cannot open {path} for reading: {type(exc).__name__}") from None


def _migrate(db: apsw.Connection) -> None:
    with _txn(db):
        app_id = _pragma_int(db, "application_id")
        version = _pragma_int(db, "user_version")
        if version == 0 and app_id == 0:
            db.execute(f"PRAGMA application_id={APPLICATION_ID}")
        elif app_id != APPLICATION_ID:
            raise StoreError("the database in the state directory does not belong to nexa")
        if version > len(MIGRATIONS):
            raise StoreError(
                f"the state directory was written by a newer nexa (schema {version}, this build knows "
                f"{len(MIGRATIONS)}); refusing to downgrade"
            )
        for number in range(version, len(MIGRATIONS)):
            db.execute(MIGRATIONS[number])
            db.execute(f"PRAGMA user_version={number + 1}")


def _take_epoch(db: apsw.Connection) -> int:
    with _txn(db):
        db.execute("UPDATE meta SET value = value + 1 WHERE key = 'epoch'")
        epoch = _meta_int(db, "epoch")
    return epoch


def _meta_int(db: apsw.Connection, key: str) -> int:
    value = _meta(db, key)
    if not isinstance(value, int):
        raise StoreError(f"meta key {key} is not an integer")
    return value


def _meta(db: apsw.Connection, key: str) -> object:
    for (value,) in db.execute("SELECT value FROM meta WHERE key = ?", (key,)):
        return value
    raise StoreError(f"meta key {key} is missing")


def _pragma_int(db: apsw.Connection, name: str) -> int:
    value = db.execute(f"PRAGMA {name}").fetchall()[0][0]
    assert isinstance(value, int)
    return value


# ---- audit chain -------------------------------------------------------------------------------


def event_sha256(event: AuditEvent) -> str:
    """SHA-256 over every field but `sha256` itself, in canonical JSON."""
    data = codec.store.unstructure(event)
    del data["sha256"]
    return hashlib.sha256(codec.canonical_json(data).encode()).hexdigest()


def _append_audit(db: apsw.Connection, draft: AuditDraft) -> AuditEvent:
    """Append one event. Must be called inside the caller's `with _txn(db):` transaction."""
    seq = _meta_int(db, "audit_head_seq") + 1
    prev = str(_meta(db, "audit_head_sha256")) or GENESIS_SHA256
    unsigned = AuditEvent(
        seq=seq,
        id=EventId("ev_" + secrets.token_hex(8)),
        time=time.time(),
        actor_key_id=draft.actor_key_id,
        actor_role=draft.actor_role,
        action=draft.action,
        target=draft.target,
        prior_sha256=draft.prior_sha256,
        next_sha256=draft.next_sha256,
        result=draft.result,
        detail=draft.detail,
        prev_sha256=prev,
        sha256="",
    )
    event = attrs.evolve(unsigned, sha256=event_sha256(unsigned))
    db.execute(
        "INSERT INTO audit(seq, id, time, actor_key_id, actor_role, action, target, prior_sha256,"
        " next_sha256, result, detail, prev_sha256, sha256) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
        (
            event.seq,
            event.id,
            event.time,
            event.actor_key_id,
            event.actor_role,
            event.action,
            event.target,
            event.prior_sha256,
            event.next_sha256,
            event.result,
            event.detail,
            event.prev_sha256,
            event.sha256,
        ),
    )
    db.execute("UPDATE meta SET value = ? WHERE key = 'audit_head_seq'", (seq,))
    db.execute("UPDATE meta SET value = ? WHERE key = 'audit_head_sha256'", (event.sha256,))
    return event


_AUDIT_COLUMNS: Final = (
    "seq, id, time, actor_key_id, actor_role, action, target, prior_sha256, next_sha256, result, detail,"
    " prev_sha256, sha256"
)


def _event_from_row(row: tuple[object, ...]) -> AuditEvent:
    names = [f.name for f in attrs.fields(AuditEvent)]
    return codec.store.structure(dict(zip(names, row, strict=True)), AuditEvent)


def record_audit(db: apsw.Connection, draft: AuditDraft) -> AuditEvent:
    """A transaction that only appends an event (refusals, transitions without other state)."""
    with _txn(db):
        event = _append_audit(db, draft)
    return event


@attrs.frozen(kw_only=True)
class AuditQuery:
    after_seq: int = 0
    limit: int = 100
    action: str | None = None
    actor_key_id: str | None = None
    target: str | None = None
    since: float | None = None
    until: float | None = None


def list_audit(db: apsw.Connection, q: AuditQuery) -> list[AuditEvent]:
    where: list[str] = ["seq > ?"]
    args: list[str | float] = [q.after_seq]
    for column, value in (("action", q.action), ("actor_key_id", q.actor_key_id), ("target", q.target)):
        if value is not None:
            where.append(f"{column} = ?")
            args.append(value)
    if q.since is not None:
        where.append("time >= ?")
        args.append(q.since)
    if q.until is not None:
        where.append("time < ?")
        args.append(q.until)
    sql = f"SELECT {_AUDIT_COLUMNS} FROM audit WHERE {' AND '.join(where)} ORDER BY seq LIMIT ?"  # noqa: S608
    with _txn(db):
        rows = db.execute(sql, (*args, q.limit)).fetchall()
    return [_event_from_row(row) for row in rows]


def audit_head(db: apsw.Connection) -> tuple[int, str]:
    """The chain's head: the last event's seq and sha256 (0 and the genesis hash when empty)."""
    with _txn(db):
        seq = _meta_int(db, "audit_head_seq")
        sha = str(_meta(db, "audit_head_sha256"))
    return seq, sha or GENESIS_SHA256


def verify_audit(  # noqa: PLR0911 - one return per way the chain can be broken
    db: apsw.Connection, against: AuditCheckpoint | None = None
) -> AuditVerdict:
    """Recompute the chain; name the first event that was edited, deleted, inserted or reordered.

    With `against` (a checkpoint whose signature the caller checked), the event at its seq must
    still have its sha256: a chain rewritten after the checkpoint, hashes recomputed, fails here.
    """
    if against is not None and against.seq == 0 and against.sha256 != GENESIS_SHA256:
        return AuditVerdict(ok=False, checked=0, first_bad_seq=0, reason="the checkpoint's genesis hash is wrong")
    with _txn(db):
        head_seq = _meta_int(db, "audit_head_seq")
        head_sha = str(_meta(db, "audit_head_sha256"))
        prev, expected_seq, checked = GENESIS_SHA256, 1, 0
        for row in db.execute(f"SELECT {_AUDIT_COLUMNS} FROM audit ORDER BY seq"):  # noqa: S608
            try:
                event = _event_from_row(row)
            except Exception:
                return _bad(checked, row, "event does not parse (edited by hand?)")
            if event.seq != expected_seq:
                return _bad(checked, row, f"sequence gap: expected {expected_seq} (an event was deleted)")
            if event.prev_sha256 != prev:
                return _bad(checked, row, "prev_sha256 does not match the event before it")
            if event_sha256(event) != event.sha256:
                return _bad(checked, row, "content does not match its sha256 (edited)")
            if against is not None and event.seq == against.seq and event.sha256 != against.sha256:
                return _bad(
                    checked, row, "the event at the signed checkpoint has another sha256 (chain rewritten after it)"
                )
            prev, expected_seq, checked = event.sha256, expected_seq + 1, checked + 1
        if checked != head_seq or (checked and prev != head_sha):
            return AuditVerdict(
                ok=False,
                checked=checked,
                first_bad_seq=checked + 1,
                reason=f"chain ends at {checked} but the head records {head_seq} (tail deleted or head edited)",
            )
        if against is not None and against.seq > checked:
            return AuditVerdict(
                ok=False,
                checked=checked,
                first_bad_seq=checked + 1,
                reason=f"the chain ends at {checked} but the signed checkpoint records {against.seq} (events deleted)",
            )
        return AuditVerdict(ok=True, checked=checked)


def _bad(checked: int, row: tuple[object, ...], reason: str) -> AuditVerdict:
    seq, event_id = row[0], row[1]
    return AuditVerdict(
        ok=False,
        checked=checked,
        first_bad_seq=seq if isinstance(seq, int) else None,
        first_bad_id=str(event_id),
        reason=reason,
    )


# ---- keys and tenants --------------------------------------------------------------------------


def _load_all(db: apsw.Connection, cls: type[T], table: str) -> list[T]:
    names = [f.name for f in attrs.fields(cls)]  # type: ignore[arg-type]
    with _txn(db):
        rows = db.execute(f"SELECT {', '.join(names)} FROM {table}").fetchall()  # noqa: S608
    return [codec.store.structure(dict(zip(names, row, strict=True)), cls) for row in rows]


def load_keys(db: apsw.Connection) -> list[ApiKey]:
    return _load_all(db, ApiKey, "api_key")


def insert_key(db: apsw.Connection, key: ApiKey, draft: AuditDraft) -> AuditEvent:
    with _txn(db):
        db.execute(
            "INSERT INTO api_key(id, name, role, tenant, secret_sha256, created_at, created_by, revoked_at)"
            " VALUES (?,?,?,?,?,?,?,?)",
            (
                key.id,
                key.name,
                key.role.value,
                key.tenant,
                key.secret_sha256,
                key.created_at,
                key.created_by,
                key.revoked_at,
            ),
        )
        event = _append_audit(db, draft)
    return event


def revoke_key(db: apsw.Connection, key_id: KeyId, at: float, draft: AuditDraft) -> AuditEvent:
    with _txn(db):
        db.execute("UPDATE api_key SET revoked_at = ? WHERE id = ? AND revoked_at IS NULL", (at, key_id))
        if db.changes() != 1:
            raise NotFound(f"no active key {key_id}")
        event = _append_audit(db, draft)
    return event


def load_tenants(db: apsw.Connection) -> list[Tenant]:
    return _load_all(db, Tenant, "tenant")


def insert_tenant(db: apsw.Connection, tenant: Tenant, draft: AuditDraft) -> AuditEvent:
    with _txn(db):
        db.execute(
            "INSERT INTO tenant(id, display_name, created_at) VALUES (?,?,?)",
            (tenant.id, tenant.display_name, tenant.created_at),
        )
        event = _append_audit(db, draft)
    return event


# ---- enrollment and nodes ----------------------------------------------------------------------


def insert_token(db: apsw.Connection, token: EnrollmentToken, draft: AuditDraft) -> AuditEvent:
    with _txn(db):
        db.execute(
            "INSERT INTO enrollment_token(id, token_sha256, labels, created_at, expires_at, created_by)"
            " VALUES (?,?,?,?,?,?)",
            (
                token.id,
                token.token_sha256,
                codec.canonical_json(token.labels),
                token.created_at,
                token.expires_at,
                token.created_by,
            ),
        )
        event = _append_audit(db, draft)
    return event


def enroll_node(db: apsw.Connection, token_sha256: str, now: float, node: Node, draft: AuditDraft) -> Node:
    """Spend a one-time token and create the node, in one transaction; refusals change nothing.

    The node takes the token's labels. Raises Unauthenticated for an unknown, used or expired token.
    """
    with _txn(db):
        rows = db.execute(
            "SELECT labels, expires_at, used_at FROM enrollment_token WHERE token_sha256 = ?", (token_sha256,)
        ).fetchall()
        if not rows:
            raise Unauthenticated("unknown enrollment token")
        labels_json, expires_at, used_at = rows[0]
        if used_at is not None:
            raise Unauthenticated("this enrollment token was already used")
        if not isinstance(expires_at, float) or expires_at <= now:
            raise Unauthenticated("this enrollment token has expired")
        labels = json.loads(str(labels_json))
        node = attrs.evolve(node, labels=labels)
        db.execute(
            "UPDATE enrollment_token SET used_at = ?, used_by_node = ? WHERE token_sha256 = ?",
            (now, node.id, token_sha256),
        )
        db.execute(
            "INSERT INTO node(id, hostname, signing_public_key, curve_public_key, labels, enrolled_at, admin_state,"
            " revoked_at) VALUES (?,?,?,?,?,?,?,?)",
            (
                node.id,
                node.hostname,
                node.signing_public_key,
                node.curve_public_key,
                codec.canonical_json(node.labels),
                node.enrolled_at,
                node.admin_state.value,
                node.revoked_at,
            ),
        )
        _append_audit(db, attrs.evolve(draft, next_sha256=codec.sha256_of(codec.store, node)))
    return node


def load_nodes(db: apsw.Connection) -> list[tuple[Node, NodeInventory | None, DesiredAssignments | None]]:
    with _txn(db):
        rows = db.execute(
            "SELECT n.id, n.hostname, n.signing_public_key, n.curve_public_key, n.labels, n.enrolled_at,"
            " n.admin_state, n.revoked_at, i.body, d.body FROM node n"
            " LEFT JOIN node_inventory i ON i.node_id = n.id LEFT JOIN node_desired d ON d.node_id = n.id"
        ).fetchall()
    out = []
    for r in rows:
        node = codec.store.structure(
            {
                "id": r[0],
                "hostname": r[1],
                "signing_public_key": r[2],
                "curve_public_key": r[3],
                "labels": json.loads(str(r[4])),
                "enrolled_at": r[5],
                "admin_state": r[6],
                "revoked_at": r[7],
            },
            Node,
        )
        inventory = codec.loads(codec.store, str(r[8]), NodeInventory) if r[8] is not None else None
        desired = codec.loads(codec.store, str(r[9]), DesiredAssignments) if r[9] is not None else None
        out.append((node, inventory, desired))
    return out


def update_node(db: apsw.Connection, node: Node, draft: AuditDraft) -> AuditEvent:
    with _txn(db):
        db.execute(
            "UPDATE node SET admin_state = ?, revoked_at = ?, labels = ? WHERE id = ?",
            (node.admin_state.value, node.revoked_at, codec.canonical_json(node.labels), node.id),
        )
        if db.changes() != 1:
            raise NotFound(f"no node {node.id}")
        event = _append_audit(db, draft)
    return event


def save_inventory(db: apsw.Connection, node_id: str, inventory: NodeInventory, at: float) -> None:
    """Inventory is telemetry reported by the node itself: kept, not audited."""
    with _txn(db):
        db.execute(
            "INSERT INTO node_inventory(node_id, body, reported_at) VALUES (?,?,?)"
            " ON CONFLICT(node_id) DO UPDATE SET body = excluded.body, reported_at = excluded.reported_at",
            (node_id, codec.dumps(codec.store, inventory), at),
        )


def save_desired(db: apsw.Connection, desired: DesiredAssignments, draft: AuditDraft | None) -> None:
    with _txn(db):
        _upsert_desired(db, desired)
        if draft is not None:
            _append_audit(db, draft)


def _upsert_desired(db: apsw.Connection, desired: DesiredAssignments) -> None:
    # Never let an older generation overwrite a newer one: an ack recorded while a deployment
    # change for the same node is being committed may reach the store lane second.
    db.execute(
        "INSERT INTO node_desired(node_id, body) VALUES (?,?)"
        " ON CONFLICT(node_id) DO UPDATE SET body = excluded.body"
        " WHERE json_extract(node_desired.body, '$.generation') <= json_extract(excluded.body, '$.generation')",
        (desired.node_id, codec.dumps(codec.store, desired)),
    )


# ---- registry: runtimes, models, evaluations, aliases ------------------------------------------


def insert_runtime(db: apsw.Connection, runtime: RuntimeRecord, draft: AuditDraft) -> AuditEvent:
    with _txn(db):
        db.execute(
            "INSERT INTO runtime(name, kind, image, body) VALUES (?,?,?,?)",
            (runtime.name, runtime.kind.value, runtime.image, codec.dumps(codec.store, runtime)),
        )
        event = _append_audit(db, draft)
    return event


def load_runtimes(db: apsw.Connection) -> list[RuntimeRecord]:
    with _txn(db):
        rows = db.execute("SELECT body FROM runtime ORDER BY name").fetchall()
    return [codec.loads(codec.store, str(body), RuntimeRecord) for (body,) in rows]


def insert_model(db: apsw.Connection, model: ModelRecord, draft: AuditDraft) -> AuditEvent:
    with _txn(db):
        db.execute(
            "INSERT INTO model(name, version, state, sha256, body) VALUES (?,?,?,?,?)",
            (model.name, model.version, model.state.value, model.artifact.sha256, codec.dumps(codec.store, model)),
        )
        event = _append_audit(db, draft)
    return event


def _update_model(db: apsw.Connection, model: ModelRecord, expected: ModelState) -> None:
    """Compare-and-set on the state: a model changed by someone else meanwhile is a Conflict."""
    db.execute(
        "UPDATE model SET state = ?, body = ? WHERE name = ? AND version = ? AND state = ?",
        (model.state.value, codec.dumps(codec.store, model), model.name, model.version, expected.value),
    )
    if db.changes() != 1:
        raise Conflict(f"model {model.key} changed meanwhile; try again")


def update_model(db: apsw.Connection, model: ModelRecord, expected: ModelState, draft: AuditDraft) -> AuditEvent:
    with _txn(db):
        _update_model(db, model, expected)
        event = _append_audit(db, draft)
    return event


def insert_evaluation(
    db: apsw.Connection, evaluation: EvaluationRecord, model: ModelRecord, expected: ModelState, draft: AuditDraft
) -> AuditEvent:
    """Record an evaluation and the model state it leads to, in one transaction."""
    with _txn(db):
        db.execute(
            "INSERT INTO evaluation(id, model, version, passed, recorded_at, body) VALUES (?,?,?,?,?,?)",
            (
                evaluation.id,
                evaluation.model,
                evaluation.version,
                int(evaluation.passed),
                evaluation.recorded_at,
                codec.dumps(codec.store, evaluation),
            ),
        )
        _update_model(db, model, expected)
        event = _append_audit(db, draft)
    return event


def load_models(db: apsw.Connection) -> tuple[list[ModelRecord], list[EvaluationRecord]]:
    with _txn(db):
        models = db.execute("SELECT body FROM model ORDER BY name, version").fetchall()
        evaluations = db.execute("SELECT body FROM evaluation ORDER BY recorded_at, id").fetchall()
    return (
        [codec.loads(codec.store, str(body), ModelRecord) for (body,) in models],
        [codec.loads(codec.store, str(body), EvaluationRecord) for (body,) in evaluations],
    )


def save_alias(
    db: apsw.Connection, alias: AliasRecord, expected_generation: int, receipt: AliasReceipt, draft: AuditDraft
) -> AliasReceipt:
    """Move an alias to its next generation and keep the receipt; the receipt gets the audit event's id.

    `expected_generation` is the generation the caller read (0: the alias must not exist yet).
    """
    with _txn(db):
        if expected_generation == 0:
            db.execute(
                "INSERT INTO alias(name, model, version, generation, body) VALUES (?,?,?,?,?)",
                (
                    alias.name,
                    alias.target.model,
                    alias.target.version,
                    alias.generation,
                    codec.dumps(codec.store, alias),
                ),
            )
        else:
            db.execute(
                "UPDATE alias SET model = ?, version = ?, generation = ?, body = ? WHERE name = ? AND generation = ?",
                (
                    alias.target.model,
                    alias.target.version,
                    alias.generation,
                    codec.dumps(codec.store, alias),
                    alias.name,
                    expected_generation,
                ),
            )
            if db.changes() != 1:
                raise Conflict(f"alias {alias.name} changed meanwhile; try again")
        event = _append_audit(db, draft)
        receipt = attrs.evolve(receipt, event_id=event.id)
        db.execute(
            "INSERT INTO alias_history(alias, generation, body) VALUES (?,?,?)",
            (alias.name, alias.generation, codec.dumps(codec.store, receipt)),
        )
    return receipt


def load_aliases(db: apsw.Connection) -> tuple[list[AliasRecord], list[AliasReceipt]]:
    with _txn(db):
        aliases = db.execute("SELECT body FROM alias ORDER BY name").fetchall()
        history = db.execute("SELECT body FROM alias_history ORDER BY alias, generation").fetchall()
    return (
        [codec.loads(codec.store, str(body), AliasRecord) for (body,) in aliases],
        [codec.loads(codec.store, str(body), AliasReceipt) for (body,) in history],
    )


# ---- deployments -----------------------------------------------------------------------------


def save_deployment(  # noqa: PLR0917 - one transaction function, called through Store.run(fn, *args)
    db: apsw.Connection,
    name: str,
    deployment: Deployment | None,
    placement: PlacementDecision | None,
    desired: list[DesiredAssignments],
    draft: AuditDraft,
) -> AuditEvent:
    """Write a deployment (None: delete it), its last placement decision and the node sets it changed, audited.

    One transaction: a node's signed set never names a replica the deployment record does not.
    A `placement` of None keeps the decision stored before.
    """
    with _txn(db):
        if deployment is None:
            db.execute("DELETE FROM deployment WHERE name = ?", (name,))
        else:
            db.execute(
                "INSERT INTO deployment(name, generation, body, placement) VALUES (?,?,?,?)"
                " ON CONFLICT(name) DO UPDATE SET generation = excluded.generation, body = excluded.body,"
                " placement = COALESCE(excluded.placement, deployment.placement)",
                (
                    name,
                    deployment.generation,
                    codec.dumps(codec.store, deployment),
                    None if placement is None else codec.dumps(codec.store, placement),
                ),
            )
        for one in desired:
            save_desired(db, one, None)
        event = _append_audit(db, draft)
    return event


def load_deployments(db: apsw.Connection) -> list[tuple[Deployment, PlacementDecision | None]]:
    with _txn(db):
        rows = db.execute("SELECT body, placement FROM deployment ORDER BY name").fetchall()
    return [
        (
            codec.loads(codec.store, str(body), Deployment),
            None if placement is None else codec.loads(codec.store, str(placement), PlacementDecision),
        )
        for body, placement in rows
    ]


# ---- gateway: quotas ---------------------------------------------------------------------------


def _int(value: object) -> int:
    if not isinstance(value, int):
        raise StoreError(f"expected an integer column, got {type(value).__name__}")
    return value


def _float(value: object) -> float:
    if not isinstance(value, int | float):
        raise StoreError(f"expected a number column, got {type(value).__name__}")
    return float(value)


@attrs.frozen(kw_only=True)
class QuotaRecord:
    tenant: TenantId
    limits: QuotaLimits
    updated_at: float
    updated_by: KeyId | None


def load_quotas(db: apsw.Connection) -> list[QuotaRecord]:
    with _txn(db):
        rows = db.execute("SELECT tenant, body, updated_at, updated_by FROM quota ORDER BY tenant").fetchall()
    return [
        QuotaRecord(
            tenant=TenantId(str(tenant)),
            limits=codec.loads(codec.store, str(body), QuotaLimits),
            updated_at=_float(updated_at),
            updated_by=None if updated_by is None else KeyId(str(updated_by)),
        )
        for tenant, body, updated_at, updated_by in rows
    ]


def save_quota(db: apsw.Connection, record: QuotaRecord, draft: AuditDraft) -> AuditEvent:
    with _txn(db):
        db.execute(
            "INSERT INTO quota(tenant, body, updated_at, updated_by) VALUES (?,?,?,?)"
            " ON CONFLICT(tenant) DO UPDATE SET body = excluded.body, updated_at = excluded.updated_at,"
            " updated_by = excluded.updated_by",
            (record.tenant, codec.dumps(codec.store, record.limits), record.updated_at, record.updated_by),
        )
        event = _append_audit(db, draft)
    return event


# ---- gateway: usage ----------------------------------------------------------------------------

_USAGE_COLUMNS: Final = (
    "request_id, workload_id, api, tenant, key_id, capability, alias, model, model_version, deployment, node_id,"
    " status, prompt_tokens, completion_tokens, queue_ms, ttft_ms, duration_ms, finished_at, canary"
)
#: Usage rows of requests a quota refused: they never took a request slot, so a rebuild skips them.
QUOTA_REFUSED_STATUS: Final = "quota_exceeded"


def insert_usage(db: apsw.Connection, records: list[UsageRecord]) -> None:
    """Write one batch of usage records in one transaction (metadata only: never payloads)."""
    with _txn(db):
        db.executemany(
            f"INSERT INTO usage({_USAGE_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?,?)",  # noqa: S608
            [
                (
                    r.request_id,
                    r.workload_id,
                    r.api.value,
                    r.tenant,
                    r.key_id,
                    r.capability.value,
                    r.alias,
                    r.model,
                    r.model_version,
                    r.deployment,
                    r.node_id,
                    r.status,
                    r.prompt_tokens,
                    r.completion_tokens,
                    r.queue_ms,
                    r.ttft_ms,
                    r.duration_ms,
                    r.finished_at,
                    int(r.canary),
                )
                for r in records
            ],
        )


def usage_by_second(db: apsw.Connection, since: float) -> list[tuple[TenantId, int, int, int]]:
    """(tenant, whole second, requests, tokens) of the usage finished at or after `since`.

    What quotas rebuild their sliding minute from; quota refusals are not requests there.
    """
    with _txn(db):
        rows = db.execute(
            "SELECT tenant, CAST(finished_at AS INTEGER) AS second, count(*),"
            " sum(prompt_tokens + completion_tokens) FROM usage WHERE finished_at >= ? AND status != ?"
            " GROUP BY tenant, second ORDER BY second",
            (since, QUOTA_REFUSED_STATUS),
        ).fetchall()
    return [(TenantId(str(t)), _int(s), _int(n), _int(tok)) for t, s, n, tok in rows]


def usage_tokens_since(db: apsw.Connection, since: float) -> dict[TenantId, int]:
    """Tokens per tenant finished at or after `since` (the quota's day window)."""
    with _txn(db):
        rows = db.execute(
            "SELECT tenant, sum(prompt_tokens + completion_tokens) FROM usage WHERE finished_at >= ? GROUP BY tenant",
            (since,),
        ).fetchall()
    return {TenantId(str(t)): _int(tok) for t, tok in rows}


def usage_report(
    db: apsw.Connection, since: float, until: float, tenant: str | None, model: str | None
) -> list[UsageRow]:
    """Usage grouped by tenant, model (`name:version`; the alias when it never resolved) and UTC day.

    `model` filters on `name:version`, the model name or the alias the client asked for.
    """
    where = ["finished_at >= ?", "finished_at < ?"]
    args: list[str | float] = [since, until]
    if tenant is not None:
        where.append("tenant = ?")
        args.append(tenant)
    if model is not None:
        where.append("(model || ':' || model_version = ? OR model = ? OR alias = ?)")
        args.extend((model, model, model))
    sql = (
        "SELECT tenant, CASE WHEN model = '' THEN alias ELSE model || ':' || model_version END AS m,"  # noqa: S608
        " strftime('%Y-%m-%d', finished_at, 'unixepoch') AS day, count(*), sum(status != 'ok'),"
        " sum(prompt_tokens), sum(completion_tokens)"
        f" FROM usage WHERE {' AND '.join(where)} GROUP BY tenant, m, day ORDER BY day, tenant, m"
    )
    with _txn(db):
        rows = db.execute(sql, args).fetchall()
    return [
        UsageRow(
            tenant=TenantId(str(t)),
            model=str(m),
            day=str(day),
            requests=_int(n),
            errors=_int(errors),
            prompt_tokens=_int(prompt),
            completion_tokens=_int(completion),
        )
        for t, m, day, n, errors, prompt, completion in rows
    ]


# ---- gateway: canonical workloads --------------------------------------------------------------


@attrs.frozen(kw_only=True)
class WorkloadRow:
    """One canonical workload as stored: ids, state and its signed receipt once finished. Never payloads."""

    tenant: TenantId
    workload_id: str
    idempotency_key_sha256: str
    key_id: KeyId
    capability: Capability
    alias: str
    state: WorkloadState
    model: str
    priority: Priority
    accepted_at: float
    finished_at: float | None = None
    error: str | None = None
    receipt: SignedReceipt | None = None
    #: sha256 of the canonical envelope (`contracts.gateway.request_sha256`); None in older rows.
    request_sha256: str | None = None


_WORKLOAD_COLUMNS: Final = (
    "tenant, workload_id, idempotency_key_sha256, key_id, capability, alias, state, model, priority, accepted_at,"
    " finished_at, error, receipt, request_sha256"
)


def _workload_from_row(row: tuple[object, ...]) -> WorkloadRow:
    names = [f.name for f in attrs.fields(WorkloadRow)]
    data = dict(zip(names, row, strict=True))
    receipt = data.pop("receipt")
    out = codec.store.structure(data, WorkloadRow)
    if receipt is not None:
        out = attrs.evolve(out, receipt=codec.loads(codec.store, str(receipt), SignedReceipt))
    return out


def insert_workload(db: apsw.Connection, row: WorkloadRow) -> None:
    """Record an accepted workload. A workload id or idempotency key this tenant used before is a Conflict."""
    with _txn(db):
        for (key_sha,) in db.execute(
            "SELECT idempotency_key_sha256 FROM workload WHERE tenant = ? AND workload_id = ?",
            (row.tenant, row.workload_id),
        ):
            if key_sha == row.idempotency_key_sha256:
                raise Conflict(f"workload {row.workload_id} already ran with this idempotency key; fetch its receipt")
            raise Conflict(f"workload id {row.workload_id} was used before with another idempotency key")
        for (other,) in db.execute(
            "SELECT workload_id FROM workload WHERE tenant = ? AND idempotency_key_sha256 = ?",
            (row.tenant, row.idempotency_key_sha256),
        ):
            raise Conflict(f"this idempotency key was used before for workload {other}")
        db.execute(
            f"INSERT INTO workload({_WORKLOAD_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?,?)",  # noqa: S608
            (
                row.tenant,
                row.workload_id,
                row.idempotency_key_sha256,
                row.key_id,
                row.capability.value,
                row.alias,
                row.state.value,
                row.model,
                row.priority.value,
                row.accepted_at,
                row.finished_at,
                row.error,
                None if row.receipt is None else codec.dumps(codec.store, row.receipt),
                row.request_sha256,
            ),
        )


def finish_workloads(db: apsw.Connection, signed: list[SignedReceipt]) -> None:
    """Write the terminal state and signed receipt of workloads, in one transaction; each once only."""
    with _txn(db):
        for one in signed:
            r = one.receipt
            if not r.state.terminal:
                raise Conflict(f"workload {r.workload_id} cannot finish as {r.state.value}")
            db.execute(
                "UPDATE workload SET state = ?, finished_at = ?, error = ?, receipt = ?"
                " WHERE tenant = ? AND workload_id = ? AND finished_at IS NULL",
                (r.state.value, r.finished_at, r.error, codec.dumps(codec.store, one), r.tenant, r.workload_id),
            )
            if db.changes() != 1:
                raise Conflict(f"workload {r.workload_id} is not running")


def unfinished_workloads(db: apsw.Connection) -> list[WorkloadRow]:
    with _txn(db):
        rows = db.execute(
            f"SELECT {_WORKLOAD_COLUMNS} FROM workload WHERE finished_at IS NULL ORDER BY accepted_at"  # noqa: S608
        ).fetchall()
    return [_workload_from_row(row) for row in rows]


def get_workload(db: apsw.Connection, tenant: TenantId, workload_id: str) -> WorkloadRow | None:
    with _txn(db):
        rows = db.execute(
            f"SELECT {_WORKLOAD_COLUMNS} FROM workload WHERE tenant = ? AND workload_id = ?",  # noqa: S608
            (tenant, workload_id),
        ).fetchall()
    return _workload_from_row(rows[0]) if rows else None


def workload_by_key(db: apsw.Connection, tenant: TenantId, key_sha256: str) -> WorkloadRow | None:
    """This tenant's workload with that idempotency key (sha256), finished or not, if any. Read only."""
    with _txn(db):
        rows = db.execute(
            f"SELECT {_WORKLOAD_COLUMNS} FROM workload WHERE tenant = ? AND idempotency_key_sha256 = ?",  # noqa: S608
            (tenant, key_sha256),
        ).fetchall()
    return _workload_from_row(rows[0]) if rows else None


def workload_receipt_by_key(db: apsw.Connection, tenant: TenantId, key_sha256: str) -> SignedReceipt | None:
    """The receipt of this tenant's finished workload with that idempotency key (None if none finished)."""
    with _txn(db):
        rows = db.execute(
            "SELECT receipt FROM workload WHERE tenant = ? AND idempotency_key_sha256 = ? AND receipt IS NOT NULL",
            (tenant, key_sha256),
        ).fetchall()
    return codec.loads(codec.store, str(rows[0][0]), SignedReceipt) if rows else None


def prune_usage(db: apsw.Connection, before: float) -> int:
    """Delete up to PRUNE_BATCH usage records that finished before `before`; how many went."""
    with _txn(db):
        db.execute(
            "DELETE FROM usage WHERE seq IN (SELECT seq FROM usage WHERE finished_at < ? LIMIT ?)",
            (before, PRUNE_BATCH),
        )
        return db.changes()


def prune_workloads(db: apsw.Connection, before: float) -> int:
    """Delete up to PRUNE_BATCH finished workloads (and their receipts) older than `before`."""
    with _txn(db):
        db.execute(
            "DELETE FROM workload WHERE rowid IN (SELECT rowid FROM workload"
            " WHERE finished_at IS NOT NULL AND finished_at < ? LIMIT ?)",
            (before, PRUNE_BATCH),
        )
        return db.changes()
