"""Canonical workloads: idempotency, live status, cancellation and signed receipts.

A workload is claimed in memory when it is accepted, recorded durably (`record`) once the
gateway admits it (it holds an admission slot), and recorded again, with its signed receipt,
when it finishes; its live state in between (queued, running, streaming) is in memory only. A
workload refused before admission (model not served, quota, queue full, deadline while queued)
writes nothing: its key and id stay free, and a retry with the same key runs it. Payloads are
never recorded. Every lookup is keyed by tenant first: one tenant can never see,
cancel or collide with another tenant's workloads. A workload left unfinished by a crash is
marked failed (`controller_restarted`) with a signed receipt when the controller loads.

Several controllers on one store (DESIGN §5): each row names the controller that runs it
(`controller`, its `[cluster] controller_id`; None on the embedded store, whose one controller runs
them all). A controller that starts fails only its own leftovers, never the live work of the
others; the leader fails those of a controller gone for good (`fail_orphaned`, from
`follow.Orphans`: `controller_lost`). Receipts carry the epoch of the leadership (`epoch`).

How a workload ended is decided here (`end`): succeeded when its call ended without an error,
cancelled when it ended with Cancelled (the client, an operator, or the client going away),
failed otherwise; its receipt is derived from the call's one outcome (`Receipt.from_outcome`).

Workload ids and idempotency keys are single-use per tenant: a finished workload's key answers
with its stored receipt (`lookup`); reusing its id under another key is a Conflict. A key comes
with the digest of the envelope it was first sent with: sent again with another body, it is
refused with IdempotencyKeyReused (422), whether the first is still running or finished.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import time
from collections.abc import Callable, Collection
from functools import partial
from typing import Final

import attrs
import trio

from nexa.contracts.domain import KeyId, TenantId
from nexa.contracts.gateway import (
    AcceptedWorkload,
    CallOutcome,
    Receipt,
    SignedReceipt,
    WorkloadCreate,
    WorkloadState,
    WorkloadView,
)
from nexa.control import store as st
from nexa.errors import Cancelled, Conflict, IdempotencyKeyReused, NexaError, NotFound, WorkloadAlreadyActive
from nexa.security import SigningKey, sign_receipt

log = logging.getLogger(__name__)

#: The error code of workloads a controller restart interrupted.
RESTARTED: Final = "controller_restarted"
#: The error code of workloads whose controller stopped for good while they ran (another one,
#: the leader, failed them: `fail_orphaned`).
LOST: Final = "controller_lost"
#: How long writing a finished workload (its terminal state and receipt, one row in one
#: transaction) may take, shielded from the caller's cancellation: it must be written even when
#: the client went away. A write takes milliseconds; 10 s covers a store briefly busy with a
#: large batch (the usage flush, a prune) and still bounds a store that hangs. Past it the
#: receipt is returned unstored, and logged; the row stays unfinished, and is marked failed
#: (`controller_restarted`) at the next load.
FINISH_WRITE_TIMEOUT_S: Final = 10.0


def idempotency_sha256(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def new_receipt_id() -> str:
    return "rcpt_" + secrets.token_hex(12)


@attrs.define(eq=False)
class ActiveWorkload:
    """A workload being served. The gateway runs its work inside `scope` and reports `set_state`."""

    accepted: AcceptedWorkload
    state: WorkloadState = WorkloadState.QUEUED
    #: Written to the store (`Workloads.record`, at admission); only then is its end written too.
    recorded: bool = False
    #: Cancelled by `Workloads.cancel` (the client or an operator), not by a deadline or shutdown.
    cancel_requested: bool = False
    scope: trio.CancelScope = attrs.Factory(trio.CancelScope)

    def set_state(self, state: WorkloadState) -> None:
        """Live state while active (queued → running → streaming); the terminal one comes with `finish`."""
        if state.terminal:
            raise ValueError("a terminal state is set by Workloads.finish, with the receipt")
        self.state = state

    def view(self) -> WorkloadView:
        return WorkloadView.of(self.accepted, self.state)


class Workloads:
    """Active canonical workloads in memory; finished ones in the store."""

    def __init__(
        self,
        store: st.Store,
        signing_key: SigningKey,
        *,
        controller: str | None = None,
        epoch: Callable[[], int] | None = None,
    ) -> None:
        """`controller`: this controller's id on a shared store, written with each workload it
        records (None: the only controller). `epoch`: what receipts carry, read at each receipt
        (the leadership's; None: the store's), since a recovery's end or a new lease moves it."""
        self._store = store
        self._key = signing_key
        self._controller = controller
        self._epoch = epoch if epoch is not None else lambda: store.epoch
        self._active: dict[tuple[TenantId, str], ActiveWorkload] = {}
        self._active_keys: dict[tuple[TenantId, str], ActiveWorkload] = {}
        #: Finished workloads whose receipt write timed out (FINISH_WRITE_TIMEOUT_S).
        self._unstored = 0

    def use_signing_key(self, key: SigningKey) -> None:
        """Sign receipts with `key` from now on (`nexa keys rotate-controller`)."""
        self._key = key

    async def run(
        self,
        retention_s: float,
        *,
        interval_s: float = 3600.0,
        task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Delete finished workloads (idempotency keys, receipts) older than `retention_s`, every `interval_s`."""
        task_status.started()
        while True:
            try:
                deleted = await self._store.prune(st.prune_workloads, time.time() - retention_s)
            except NexaError as exc:
                log.warning("pruning finished workloads failed (%s)", exc.code)
            else:
                if deleted:
                    log.info("pruned %d finished workloads older than %.0f days", deleted, retention_s / 86400)
            await trio.sleep(interval_s)

    @classmethod
    async def load(
        cls,
        store: st.Store,
        signing_key: SigningKey,
        *,
        controller: str | None = None,
        epoch: Callable[[], int] | None = None,
        unowned: bool = False,
    ) -> Workloads:
        """Mark what a crash left unfinished as failed (`controller_restarted`), with signed
        receipts: every unfinished workload (the only controller), or only this controller's own,
        and with `unowned` (no other controller runs) those no controller is named on (written
        before controllers were named)."""
        workloads = cls(store, signing_key, controller=controller, epoch=epoch)
        mine = None if controller is None else ((controller, None) if unowned else (controller,))
        failed = await workloads._fail(await store.run(st.unfinished_workloads, mine), RESTARTED)
        if failed:
            log.warning("marked %d workloads failed: the controller restarted while they ran", failed)
        return workloads

    async def fail_orphaned(self, controllers: Collection[str | None]) -> int:
        """Mark the unfinished workloads of `controllers` (gone for good: `follow.Orphans`, on the
        leader; None: no controller named) failed (`controller_lost`), with receipts signed here;
        how many. They will never finish: their controller held their calls. One finished
        meanwhile keeps its receipt."""
        return await self._fail(await self._store.run(st.unfinished_workloads, tuple(controllers)), LOST)

    async def _fail(self, rows: list[st.WorkloadRow], error: str) -> int:
        if not rows:
            return 0
        now = time.time()
        signed = [sign_receipt(self._key, self._interrupted_receipt(row, now, error)) for row in rows]
        written: int = await self._store.run(partial(st.finish_workloads, skip_finished=True), signed)
        return written

    def _interrupted_receipt(self, row: st.WorkloadRow, now: float, error: str) -> Receipt:
        # No call outcome survived the restart: the receipt names the alias asked for, no model.
        a = row.accepted
        receipt = Receipt.from_outcome(
            None,
            accepted=a,
            receipt_id=new_receipt_id(),
            state=WorkloadState.FAILED,
            error=error,
            finished_at=now,
            controller_epoch=self._epoch(),  # read now: a recovery's end moves it
        )
        return attrs.evolve(receipt, alias=a.alias, model="", duration_ms=max(0.0, (now - a.accepted_at) * 1000))

    async def lookup(
        self, tenant: TenantId, idempotency_key: str, request_sha256: str | None = None
    ) -> SignedReceipt | None:
        """The stored receipt of this tenant's finished workload with that idempotency key, if any.

        With `request_sha256`: IdempotencyKeyReused when the key came with another envelope
        (running or finished). Async, and read only: finished workloads are in the store.
        """
        key_sha = idempotency_sha256(idempotency_key)
        active = self._active_keys.get((tenant, key_sha))
        if active is not None and _differs(active.accepted.request_sha256, request_sha256):
            raise _reused()
        row = await self._store.run(st.workload_by_key, tenant, key_sha)
        if row is None:
            return None
        if _differs(row.accepted.request_sha256, request_sha256):
            raise _reused()
        return row.receipt

    async def begin(
        self,
        tenant: TenantId,
        key_id: KeyId,
        req: WorkloadCreate,
        *,
        alias: str,
        accepted_at: float,
        request_sha256: str | None = None,
    ) -> ActiveWorkload:
        """Make an accepted workload active (claimed in memory; `record` writes it once admitted).

        WorkloadAlreadyActive when the tenant has that workload id or idempotency key active;
        Conflict when either was used before by a finished workload. Writes nothing.
        """
        key_sha = idempotency_sha256(req.idempotency_key)
        by_id, by_key = (tenant, req.workload_id), (tenant, key_sha)
        if by_id in self._active:
            raise WorkloadAlreadyActive(f"workload {req.workload_id} is still running")
        if by_key in self._active_keys:
            other = self._active_keys[by_key].accepted.workload_id
            raise WorkloadAlreadyActive(f"a workload with this idempotency key ({other}) is still running")
        used = await self._store.run(st.get_workload, tenant, req.workload_id)
        if used is not None:
            if used.accepted.idempotency_key_sha256 == key_sha:
                raise Conflict(f"workload {req.workload_id} already ran with this idempotency key; fetch its receipt")
            raise Conflict(f"workload id {req.workload_id} was used before with another idempotency key")
        other_row = await self._store.run(st.workload_by_key, tenant, key_sha)
        if other_row is not None:
            raise Conflict(f"this idempotency key was used before for workload {other_row.accepted.workload_id}")
        # The reads above awaited: check the claims again before taking them.
        if by_id in self._active or by_key in self._active_keys:
            raise WorkloadAlreadyActive(f"workload {req.workload_id} (or its idempotency key) is already running")
        accepted = AcceptedWorkload(
            tenant=tenant,
            workload_id=req.workload_id,
            idempotency_key_sha256=key_sha,
            key_id=key_id,
            capability=req.capability,
            alias=alias,
            model=req.model,
            priority=req.admission_priority,
            accepted_at=accepted_at,
            request_sha256=request_sha256,
        )
        active = ActiveWorkload(accepted)
        # Claimed in memory, so a concurrent duplicate is refused until it ends.
        self._active[by_id] = self._active_keys[by_key] = active
        return active

    async def record(self, active: ActiveWorkload) -> None:
        """Write an admitted workload (state queued) durably: from now on its id and key are used,
        and a crash before it finishes leaves a failed receipt (`load`). The gateway calls this once
        the workload holds its admission slot (`Gateway.call(admitted=...)`), never before: a
        request refused before admission costs no store write."""
        row = st.WorkloadRow(accepted=active.accepted, state=WorkloadState.QUEUED, controller=self._controller)
        await self._store.run(st.insert_workload, row)
        active.recorded = True

    def get_active(self, tenant: TenantId, workload_id: str) -> ActiveWorkload | None:
        return self._active.get((tenant, workload_id))

    def _forget(self, active: ActiveWorkload) -> None:
        a = active.accepted
        self._active.pop((a.tenant, a.workload_id), None)
        self._active_keys.pop((a.tenant, a.idempotency_key_sha256), None)

    async def end(self, active: ActiveWorkload, outcome: CallOutcome | None, error: NexaError | None) -> SignedReceipt:
        """Finish a workload whose call ended with `outcome` (None: no call was made) and `error`
        (None: it succeeded): its terminal state is decided here, its receipt derived from the
        outcome, then signed and stored (`finish`). Safe to call from a cancelled task."""
        if error is None:
            state = WorkloadState.SUCCEEDED
        elif isinstance(error, Cancelled):
            state = WorkloadState.CANCELLED
        else:
            state = WorkloadState.FAILED
        receipt = Receipt.from_outcome(
            outcome,
            accepted=active.accepted,
            receipt_id=new_receipt_id(),
            state=state,
            error=None if error is None else error.code,
            finished_at=time.time(),
            controller_epoch=self._epoch(),  # read now: a recovery's end or a new lease moves it
        )
        return await self.finish(active, receipt)

    async def finish(self, active: ActiveWorkload, receipt: Receipt) -> SignedReceipt:
        """Sign the receipt and record it with the terminal state, in one transaction; no longer active.
        A workload never recorded (refused before admission) writes nothing: its receipt is returned only.
        The write is shielded from the caller's cancellation, for at most FINISH_WRITE_TIMEOUT_S.

        The receipt must be this workload's and terminal (ValueError otherwise: a gateway bug).
        """
        a = active.accepted
        if (receipt.tenant, receipt.workload_id) != (a.tenant, a.workload_id) or not receipt.state.terminal:
            raise ValueError("the receipt does not finish this workload")
        signed = sign_receipt(self._key, receipt)
        try:
            if active.recorded:
                written = 1
                with trio.move_on_after(FINISH_WRITE_TIMEOUT_S, shield=True) as write:
                    written = await self._store.run(partial(st.finish_workloads, skip_finished=True), [signed])
                if not written:
                    # Failed meanwhile by the leader, which took this controller for gone
                    # (`fail_orphaned`): that receipt is the stored one; this one is returned only.
                    log.warning("workload %s: marked failed by the leader before it finished here", a.workload_id)
                if write.cancelled_caught:
                    self._unstored += 1
                    log.error(
                        "workload %s: its receipt was not stored within %.0f s (%d so far); it is marked"
                        " failed at the next start",
                        a.workload_id,
                        FINISH_WRITE_TIMEOUT_S,
                        self._unstored,
                    )
        finally:
            # Even if the store failed: an active entry that never ends would block the id forever.
            self._forget(active)
        active.state = receipt.state
        return signed

    async def status(self, tenant: TenantId, workload_id: str) -> WorkloadView:
        """Live state while active, else the stored record. NotFound for ids this tenant never used."""
        active = self._active.get((tenant, workload_id))
        if active is not None:
            return active.view()
        row = await self._store.run(st.get_workload, tenant, workload_id)
        if row is None:
            raise NotFound(f"no workload {workload_id}")
        # A row never finished and no longer active is one whose receipt write failed.
        return WorkloadView.of(row.accepted, row.state, row.receipt)

    async def page(self, tenant: TenantId, after: st.WorkloadKey | None, limit: int) -> list[WorkloadView]:
        """At most `limit` of this tenant's recorded workloads (admitted: one still waiting for
        admission is listed once admitted), oldest accepted first, after the one `after` names
        (`accepted_at`, `workload_id`); each as `status` tells it. Read only."""
        # Active before the read or after it: one that finished meanwhile has its live state (or receipt).
        live = dict(self._active)
        rows = await self._store.run(st.list_workloads, tenant, after, limit)
        live.update(self._active)
        views = []
        for row in rows:
            active = live.get((tenant, row.accepted.workload_id))
            if row.receipt is None and active is not None:
                views.append(active.view())
            else:
                views.append(WorkloadView.of(row.accepted, row.state, row.receipt))
        return views

    async def cancel(self, tenant: TenantId, workload_id: str) -> None:
        """Cancel an active workload's scope. Conflict when it finished already; NotFound when unknown.

        Async: telling "finished" from "never existed" reads the store.
        """
        active = self._active.get((tenant, workload_id))
        if active is not None:
            active.cancel_requested = True
            active.scope.cancel()
            return
        row = await self._store.run(st.get_workload, tenant, workload_id)
        if row is None:
            raise NotFound(f"no workload {workload_id}")
        if row.receipt is None and row.controller not in (None, self._controller):
            # A shared store: another controller runs it, and its call lives there.
            raise Conflict(f"workload {workload_id} runs on another controller of this store: cancel it there")
        # Only a finished row can be inactive (unfinished ones are failed at load).
        raise Conflict(f"workload {workload_id} has finished already ({row.state.value})")

    async def receipt(self, tenant: TenantId, workload_id: str) -> SignedReceipt:
        """The signed receipt of a finished workload. NotFound while it runs or for unknown ids."""
        if (tenant, workload_id) in self._active:
            raise NotFound(f"workload {workload_id} has not finished yet; its receipt comes when it does")
        row = await self._store.run(st.get_workload, tenant, workload_id)
        if row is None or row.receipt is None:
            raise NotFound(f"no receipt for workload {workload_id}")
        return row.receipt

    def active_count(self) -> int:
        return len(self._active)


def _differs(stored: str | None, presented: str | None) -> bool:
    return stored is not None and presented is not None and stored != presented


def _reused() -> IdempotencyKeyReused:
    return IdempotencyKeyReused(
        "this idempotency key was sent before with another request body; use a new key for a new request",
        problems=("idempotency_key: reused with another body",),
    )
