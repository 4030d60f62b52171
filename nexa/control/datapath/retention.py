"""Payload retention under an explicit policy (`nexa retention`, `/api/v1/retention/*`).

An admin defines policies (name, TTL, the tenants that may use it; audited). A request naming a
policy its tenant may use (the envelope's `retention`, the OpenAI routes' `x-nexa-retention`) has
its request body and its answer kept: once the answer is complete (a stream: after its last
event), a task in this module's nursery seals both, with AES-256-GCM under the tenant's data key,
into one object of the S3-compatible store (`[retention] bucket`/`prefix`, on `[artifacts]`'s
endpoint and credentials), then writes a record (ids, sizes, times: never a payload byte) to the
database. The token path only appends the chunks it sends to a list; nothing waits on the store.
At most `[retention] max_pending` answers wait to be written: a request asking for retention while
that many wait is refused (overloaded) before it runs, so what was promised is never dropped.

Keys: each tenant has a random 32-byte data key, stored in the database only wrapped (AES-GCM)
by the master key in `[retention] key_file` (32 bytes, base64 or hex, mode 0600). An object is
`NXR1 | nonce (12) | ciphertext+tag`, its object key bound in as associated data, so an object
copied under another name or tenant does not open.

The `retention-reader` role reads a record (decrypted here, in memory; audited `retention.read`).
Records past their TTL are purged by the leader every `[retention] purge_interval_s`, and on demand
by request id, tenant or policy (`POST /api/v1/retention/purge`, admin); each purge deletes the
objects first, then the records, audited `retention.purge`.
"""

from __future__ import annotations

import base64
import json
import logging
import secrets
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Final

import trio

from nexa import security
from nexa.config import RetentionConfig
from nexa.contracts.domain import SYSTEM, Actor, TenantId
from nexa.contracts.retention import (
    EPHEMERAL,
    RetainedPayload,
    RetainedRecord,
    RetentionPolicy,
    RetentionPolicyList,
    RetentionPolicySet,
    RetentionPurge,
    RetentionPurged,
    policy_name_problem,
    policy_problems,
    purge_problems,
)
from nexa.control import store as st
from nexa.control.access.accounts import audit_draft
from nexa.errors import (
    ArtifactRefused,
    ConfigError,
    ContractError,
    NexaError,
    NotFound,
    Overloaded,
    RetentionNotPermitted,
    RetentionUnavailable,
    Unavailable,
)
from nexa.s3.client import S3Client
from nexa.telemetry import Metrics

log = logging.getLogger(__name__)

#: A sealed object starts with this (the format's version).
MAGIC: Final = b"NXR1"
_NONCE_BYTES: Final = security.BACKUP_NONCE_BYTES
_WRAP_CONTEXT: Final = b"nexa.retention.data-key.v1\x00"
_SEAL_CONTEXT: Final = b"nexa.retention.payload.v1\x00"
#: An answer larger than this is not kept (counted as failed): one object is sealed in memory.
MAX_ANSWER_BYTES: Final = 64 * 2**20
#: Records one purge round handles at most (the next round takes the rest).
PURGE_BATCH: Final = 500
#: A shared store: how often the policies are re-read (another controller may have changed them).
REFRESH_S: Final = 2.0


# --- keys and sealing ------------------------------------------------------------------------------


def load_retention_key(key_file: str) -> bytes:
    """The master key in `key_file` (32 bytes, base64 or hex, mode 0600); ConfigError saying what to do."""
    raw = security.read_key_file(Path(key_file), private=True)
    try:
        return security.parse_backup_key(raw.decode("ascii", "replace"), source=key_file)
    except ConfigError:
        raise ConfigError(
            f"[retention] key_file {key_file} is not a retention key: it must hold"
            f" {security.BACKUP_KEY_BYTES} random bytes as base64 or hex (mode 0600);"
            " make one with `nexa keygen --backup --out FILE`"
        ) from None


def wrap_data_key(master: bytes, tenant: str, data_key: bytes) -> str:
    nonce = secrets.token_bytes(_NONCE_BYTES)
    sealed = security.seal(master, _WRAP_CONTEXT + tenant.encode(), nonce, data_key)
    return base64.b64encode(nonce + sealed).decode("ascii")


def unwrap_data_key(master: bytes, tenant: str, wrapped: str) -> bytes | None:
    """The data key, or None when `master` is not the key that wrapped it (or it was altered)."""
    try:
        raw = base64.b64decode(wrapped, validate=True)
    except ValueError:
        return None
    return security.unseal(master, _WRAP_CONTEXT + tenant.encode(), raw[:_NONCE_BYTES], raw[_NONCE_BYTES:])


def seal_payload(data_key: bytes, object_key: str, plaintext: bytes) -> bytes:
    nonce = secrets.token_bytes(_NONCE_BYTES)
    return MAGIC + nonce + security.seal(data_key, _SEAL_CONTEXT + object_key.encode(), nonce, plaintext)


def open_payload(data_key: bytes, object_key: str, blob: bytes) -> bytes | None:
    if not blob.startswith(MAGIC):
        return None
    body = blob[len(MAGIC) :]
    return security.unseal(data_key, _SEAL_CONTEXT + object_key.encode(), body[:_NONCE_BYTES], body[_NONCE_BYTES:])


# --- one request's capture ----------------------------------------------------------------------------


class Capture:
    """What one request asked to keep: its body now, its answer as it is sent. `keep` hands it to
    the writer once the answer is complete; `drop` (an error, a client gone) keeps nothing. Either
    frees its place among the pending writes, once."""

    __slots__ = ("_done", "_owner", "answer", "api", "policy", "request", "request_id", "size", "tenant")

    def __init__(
        self, owner: Retention, policy: RetentionPolicy, tenant: TenantId, *, request_id: str, api: str, request: bytes
    ) -> None:
        self._owner = owner
        self.policy = policy
        self.tenant = tenant
        self.request_id = request_id
        self.api = api
        self.request = request
        self.answer: list[bytes] = []
        self.size = 0
        self._done = False

    def add(self, chunk: bytes) -> None:
        """Append part of the answer (the bytes the client is sent); O(1). Past MAX_ANSWER_BYTES
        nothing more is held (the answer is then not kept)."""
        self.size += len(chunk)
        if self.size <= MAX_ANSWER_BYTES:
            self.answer.append(chunk)

    def keep(self) -> None:
        if not self._done:
            self._done = True
            self._owner._write_soon(self)

    def drop(self) -> None:
        if not self._done:
            self._done = True
            self._owner._release()


# --- the service -------------------------------------------------------------------------------------


class Retention:
    """Policies (in memory, written through to the store), the writer and the purges."""

    def __init__(
        self,
        cfg: RetentionConfig,
        store: st.Store,
        metrics: Metrics,
        *,
        s3: S3Client | None,
        master_key: bytes | None,
        policies: list[RetentionPolicy],
        tenant_exists: Callable[[TenantId], bool] | None = None,
    ) -> None:
        self._cfg = cfg
        self._store = store
        self._metrics = metrics
        self._s3 = s3
        self._master = master_key
        self._policies = {p.name: p for p in policies}
        self._tenant_exists = tenant_exists
        self._data_keys: dict[TenantId, bytes] = {}
        self._pending = 0
        self._nursery: trio.Nursery | None = None
        self._lock = trio.Lock()

    @property
    def enabled(self) -> bool:
        return self._master is not None and self._s3 is not None

    @classmethod
    def of(cls, retention: Retention | None) -> Retention:
        if retention is None:
            raise NotFound("this controller keeps no retention policies")
        return retention

    # ---- policies (admin) ------------------------------------------------------------------------

    def policies(self) -> RetentionPolicyList:
        return RetentionPolicyList(policies=[self._policies[n] for n in sorted(self._policies)])

    def policy(self, name: str) -> RetentionPolicy:
        policy = self._policies.get(name)
        if policy is None:
            raise NotFound(f"no retention policy {name}")
        return policy

    async def set_policy(self, actor: Actor, name: str, req: RetentionPolicySet) -> RetentionPolicy:
        """Create or replace policy `name`, audited `retention.policy.set`."""
        problems = [p for p in (policy_name_problem(name), *policy_problems(req)) if p is not None]
        exists = self._tenant_exists
        missing = [t for t in req.tenants if exists is not None and not exists(t)]
        if missing:
            problems.append("tenants: no tenant " + ", ".join(missing) + " (nexa tenants create first)")
        if problems:
            raise ContractError("invalid retention policy: " + "; ".join(problems), problems=tuple(problems))
        async with self._lock:
            before = self._policies.get(name)
            policy = RetentionPolicy(
                name=name,
                ttl_s=float(req.ttl_s),
                tenants=list(req.tenants),
                updated_at=time.time(),
                updated_by=actor.key_id,
            )
            detail = f"ttl_s={policy.ttl_s:g}, tenants={','.join(policy.tenants)}"
            draft = audit_draft(actor, "retention.policy.set", f"retention-policy/{name}", before, req, detail=detail)
            event = await self._store.run(st.save_retention_policy, policy, draft)
            self._metrics.audit_events.labels(event.result.value).inc()
            self._policies[name] = policy
        return policy

    async def delete_policy(self, actor: Actor, name: str) -> RetentionPolicy:
        """Delete policy `name` (audited `retention.policy.delete`); what it kept stays until its TTL."""
        async with self._lock:
            before = self.policy(name)
            draft = audit_draft(actor, "retention.policy.delete", f"retention-policy/{name}", before, None)
            event = await self._store.run(st.delete_retention_policy, name, draft)
            self._metrics.audit_events.labels(event.result.value).inc()
            self._policies.pop(name, None)
        return before

    async def refresh(self) -> None:
        """Re-read the policies (another controller on the store may have changed them)."""
        async with self._lock:
            self._policies = {p.name: p for p in await self._store.read(st.load_retention_policies)}

    # ---- the hot path ----------------------------------------------------------------------------

    def capture(self, tenant: TenantId, retention: str, request_id: str, api: str, request: bytes) -> Capture | None:
        """None for `ephemeral`; else a capture of this request, or the typed refusal (nothing kept):
        RetentionUnavailable (no `[retention]` configured), RetentionNotPermitted (no such policy, or
        not for this tenant), Overloaded (`max_pending` answers wait to be written)."""
        if retention == EPHEMERAL:
            return None
        if not self.enabled:
            raise RetentionUnavailable(
                f"retention {retention}: this controller has no retention store ([retention] key_file and bucket);"
                " send retention: ephemeral, or ask the operator to configure one"
            )
        policy = self._policies.get(retention)
        if policy is None or tenant not in policy.tenants:
            raise RetentionNotPermitted(
                f"retention policy {retention} is not open to tenant {tenant}: send retention: ephemeral,"
                " or ask an admin to add the tenant to that policy (nexa retention set-policy)"
            )
        if self._pending >= self._cfg.max_pending:
            self._metrics.retention_writes.labels("busy").inc()
            raise Overloaded("retained answers are waiting to be written; retry shortly", retry_after_s=1.0)
        self._pending += 1
        return Capture(self, policy, tenant, request_id=request_id, api=api, request=request)

    def _release(self) -> None:
        self._pending = max(0, self._pending - 1)

    def _write_soon(self, capture: Capture) -> None:
        if self._nursery is None:  # the writer is not running (stopping): nothing is kept
            self._metrics.retention_writes.labels("failed").inc()
            log.warning("a retained answer was not written: the retention writer is not running")
            self._release()
            return
        self._nursery.start_soon(self._write, capture)

    # ---- the writer and the purges (supervised loops) ---------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The writer: each kept capture is written in a task of this nursery. On a shared store the
        policies are re-read every REFRESH_S."""
        shared = getattr(self._store, "shared", False)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            try:
                task_status.started()
                while True:
                    await trio.sleep(REFRESH_S if shared else 3600.0)
                    if shared:
                        try:
                            await self.refresh()
                        except NexaError as exc:  # the writes go on; the next round re-reads
                            log.warning("re-reading retention policies failed (%s)", exc.code)
            finally:
                self._nursery = None

    async def _write(self, capture: Capture) -> None:
        try:
            # Shielded (bounded): an answer already given is written even while the controller stops.
            with trio.CancelScope(shield=True), trio.fail_after(self._cfg.write_timeout_s):
                record = await self._store_capture(capture)
        except (NexaError, trio.TooSlowError) as exc:
            self._metrics.retention_writes.labels("failed").inc()
            code = exc.code if isinstance(exc, NexaError) else "timeout"
            log.warning(
                "a retained answer was not written (%s)", code, extra={"fields": {"policy": capture.policy.name}}
            )
        else:
            if record is not None:
                self._metrics.retention_writes.labels("ok").inc()
        finally:
            self._release()

    async def _store_capture(self, capture: Capture) -> RetainedRecord | None:
        if capture.size > MAX_ANSWER_BYTES:
            raise Unavailable(f"an answer over {MAX_ANSWER_BYTES} bytes is not retained")
        answer = b"".join(capture.answer)
        capture.answer.clear()
        now = time.time()
        record = RetainedRecord(
            id="ret_" + secrets.token_hex(12),
            request_id=capture.request_id,
            tenant=capture.tenant,
            policy=capture.policy.name,
            api=capture.api,
            stored_at=now,
            expires_at=now + capture.policy.ttl_s,
            request_bytes=len(capture.request),
            answer_bytes=len(answer),
        )
        plaintext = json.dumps(
            {"request": capture.request.decode("utf-8", "replace"), "answer": answer.decode("utf-8", "replace")}
        ).encode()
        key = self._object_key(record)
        sealed = seal_payload(await self._data_key(capture.tenant), key, plaintext)
        await self._client().put_bytes(self._cfg.bucket, key, sealed)
        await self._store.run(st.insert_retained, record)
        return record

    def _client(self) -> S3Client:
        if self._s3 is None:
            raise RetentionUnavailable("this controller has no retention store")
        return self._s3

    def _object_key(self, record: RetainedRecord) -> str:
        return f"{self._cfg.prefix}{record.tenant}/{record.id}"

    async def _data_key(self, tenant: TenantId) -> bytes:
        key = self._data_keys.get(tenant)
        if key is not None:
            return key
        master = self._master
        if master is None:
            raise RetentionUnavailable("this controller has no retention key")
        fresh = wrap_data_key(master, tenant, secrets.token_bytes(security.BACKUP_KEY_BYTES))
        wrapped = await self._store.run(st.tenant_data_key, tenant, fresh, time.time())
        key = unwrap_data_key(master, tenant, wrapped)
        if key is None:
            raise ConfigError(
                f"[retention] key_file is not the key that wrapped tenant {tenant}'s data key:"
                " configure the retention key this store was used with"
            )
        self._data_keys[tenant] = key
        return key

    # ---- reads (retention-reader) -----------------------------------------------------------------

    async def page(
        self,
        *,
        request_id: str | None,
        tenant: str | None,
        policy: str | None,
        after: tuple[float, str] | None,
        limit: int,
    ) -> list[RetainedRecord]:
        select = partial(st.select_retained, request_id=request_id, tenant=tenant, policy=policy, after=after)
        return await self._store.read(partial(select, limit=limit))

    async def read(self, actor: Actor, record_id: str) -> RetainedPayload:
        """Record `record_id` with its request and answer, decrypted; audited `retention.read`."""
        record = await self._store.read(st.get_retained, record_id)
        if record is None:
            raise NotFound(f"no retained record {record_id}")
        key = self._object_key(record)
        blob = await self._fetch(key)
        if blob is None:
            raise NotFound(f"retained record {record_id} has no object in the store (purged meanwhile?)")
        plaintext = open_payload(await self._data_key(record.tenant), key, blob)
        if plaintext is None:
            raise Unavailable(f"retained record {record_id} does not open with its tenant's key (altered?)")
        draft = audit_draft(actor, "retention.read", f"retained/{record.id}", detail=f"tenant={record.tenant}")
        event = await self._store.run(st.record_audit, draft)
        self._metrics.audit_events.labels(event.result.value).inc()
        parts = json.loads(plaintext)
        return RetainedPayload(record=record, request=str(parts["request"]), answer=str(parts["answer"]))

    async def _fetch(self, key: str) -> bytes | None:
        """The sealed object `key`, whole (bounded), or None when the store has none."""
        parts, size = [], 0
        try:
            async with self._client().stream(self._cfg.bucket, key) as answer:
                async for chunk in answer.chunks():
                    size += len(chunk)
                    if size > 2 * MAX_ANSWER_BYTES:
                        raise Unavailable(f"retained object {key} is larger than any this controller writes")
                    parts.append(chunk)
        except ArtifactRefused as exc:
            if exc.status == 404:
                return None
            raise
        return b"".join(parts)

    # ---- purges -----------------------------------------------------------------------------------

    async def purge(self, actor: Actor, req: RetentionPurge) -> RetentionPurged:
        """Delete now what `req` selects (one request id, tenant or policy); audited `retention.purge`."""
        problems = purge_problems(req)
        if problems:
            raise ContractError("invalid purge: " + "; ".join(problems), problems=tuple(problems))
        what = (
            f"request_id={req.request_id}"
            if req.request_id is not None
            else f"tenant={req.tenant}"
            if req.tenant is not None
            else f"policy={req.policy}"
        )
        total = 0
        while True:
            select = partial(st.select_retained, request_id=req.request_id, tenant=req.tenant, policy=req.policy)
            records = await self._store.read(partial(select, limit=PURGE_BATCH))
            total += await self._purge(actor, records, what)
            if len(records) < PURGE_BATCH:
                break
        return RetentionPurged(purged=total)

    async def purge_expired(self, now: float | None = None) -> int:
        """Purge what is past its TTL (a batch at a time); the number purged."""
        now = time.time() if now is None else now
        total = 0
        while True:
            records = await self._store.read(partial(st.select_retained, expired_at=now, limit=PURGE_BATCH))
            total += await self._purge(SYSTEM, records, "expired")
            if len(records) < PURGE_BATCH:
                return total

    async def _purge(self, actor: Actor, records: list[RetainedRecord], what: str) -> int:
        if not records:
            return 0
        client = self._client()
        for record in records:  # the objects first: a failure leaves the record, and the next round retries
            await client.delete(self._cfg.bucket, self._object_key(record))
        ids = [r.id for r in records]
        draft = audit_draft(
            actor, "retention.purge", "retained", detail=f"{what}: {len(ids)} record(s): {', '.join(ids[:20])}"
        )
        deleted, event = await self._store.run(st.delete_retained, ids, draft)
        self._metrics.audit_events.labels(event.result.value).inc()
        self._metrics.retention_purged.inc(deleted)
        log.info("purged %d retained payload(s) (%s)", deleted, "at their TTL" if actor is SYSTEM else "on demand")
        return deleted

    async def run_purges(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """The leader's loop: purge what is past its TTL every `[retention] purge_interval_s`."""
        task_status.started()
        while True:
            if self.enabled:
                try:
                    await self.purge_expired()
                except NexaError as exc:
                    log.warning("purging retained payloads failed (%s); the next round retries", exc.code)
            await trio.sleep(self._cfg.purge_interval_s)
