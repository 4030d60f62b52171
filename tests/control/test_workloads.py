"""Canonical workloads on a real store: idempotent receipts, one active run per id and key,
single-use ids, status/cancel/receipt, tenant isolation, restart recovery, receipt signatures."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from pathlib import Path

import attrs
import pytest
import trio
import trio.testing

from nexa import security
from nexa.config import StoreConfig
from nexa.contracts.domain import TenantId
from nexa.contracts.gateway import (
    UNRESOLVED_MODEL,
    Api,
    CallOutcome,
    Receipt,
    WorkloadState,
    request_sha256,
)
from nexa.contracts.models import ModelRef
from nexa.control import store as st
from nexa.control.datapath.workloads import RESTARTED, ActiveWorkload, Workloads
from nexa.errors import (
    BadSignature,
    Cancelled,
    Conflict,
    IdempotencyKeyReused,
    NexaError,
    NotFound,
    QuotaExceeded,
    RuntimeFailed,
    WorkloadAlreadyActive,
)
from nexa.security import SigningKey, generate_signing_key, sign_receipt, verify_receipt
from tests.support.postgres import pg_url_fixture, postgres_fixture, store_cfg_fixture  # noqa: F401
from tests.support.workloads import ACME, KEY, begin, create, receipt_for

BETA = TenantId("beta")


@pytest.fixture
def signer() -> SigningKey:
    return generate_signing_key()


@pytest.fixture
async def store(tmp_path: Path, store_cfg: StoreConfig) -> AsyncIterator[st.Store]:
    async with st.open_store(tmp_path / "state", store_cfg) as opened:
        yield opened


@pytest.fixture
async def workloads(store: st.Store, signer: SigningKey) -> Workloads:
    return await Workloads.load(store, signer)


async def test_a_finished_workload_answers_its_key_with_the_stored_receipt(
    workloads: Workloads, signer: SigningKey
) -> None:
    assert await workloads.lookup(ACME, "idem-1") is None
    active = await begin(workloads)
    assert await workloads.lookup(ACME, "idem-1") is None  # not finished yet
    signed = await workloads.finish(active, receipt_for(active))
    verify_receipt(signer.public, signed)
    again = await workloads.lookup(ACME, "idem-1")
    assert again == signed
    assert await workloads.lookup(BETA, "idem-1") is None  # keys are per tenant


async def test_an_active_id_or_key_is_409(workloads: Workloads) -> None:
    active = await begin(workloads)
    with pytest.raises(WorkloadAlreadyActive):
        await begin(workloads, key="idem-2")  # same id
    with pytest.raises(WorkloadAlreadyActive):
        await begin(workloads, workload_id="w2")  # same key
    await workloads.finish(active, receipt_for(active))
    # Another tenant may use the same id and key at the same time.
    await begin(workloads, tenant=BETA)


async def test_ids_and_keys_of_finished_workloads_are_single_use(workloads: Workloads) -> None:
    active = await begin(workloads)
    await workloads.finish(active, receipt_for(active))
    with pytest.raises(Conflict, match="another idempotency key"):
        await begin(workloads, key="idem-2")
    with pytest.raises(Conflict, match="used before for workload w1"):
        await begin(workloads, workload_id="w2")
    with pytest.raises(Conflict, match="fetch its receipt"):
        await begin(workloads)
    # Refusals leave nothing active behind.
    assert workloads.active_count() == 0
    fresh = await begin(workloads, workload_id="w3", key="idem-3")
    assert fresh.state is WorkloadState.QUEUED


async def test_status_follows_the_live_state_then_the_record(workloads: Workloads) -> None:
    active = await begin(workloads)
    assert (await workloads.status(ACME, "w1")).state is WorkloadState.QUEUED
    active.set_state(WorkloadState.STREAMING)
    view = await workloads.status(ACME, "w1")
    assert (view.state, view.model, view.receipt, view.usage) == (WorkloadState.STREAMING, "chat", None, None)
    with pytest.raises(ValueError, match="terminal"):
        active.set_state(WorkloadState.SUCCEEDED)
    with pytest.raises(NotFound):
        await workloads.receipt(ACME, "w1")  # not until finished
    signed = await workloads.finish(active, receipt_for(active))
    view = await workloads.status(ACME, "w1")
    assert view.state is WorkloadState.SUCCEEDED
    assert view.usage is not None and view.usage.total_tokens == 46
    assert view.receipt == signed
    assert view.finished_at == signed.receipt.finished_at
    assert await workloads.receipt(ACME, "w1") == signed
    with pytest.raises(NotFound):
        await workloads.status(ACME, "nope")


async def test_cancel_cancels_the_scope_the_work_runs_under(workloads: Workloads, nursery: trio.Nursery) -> None:
    active = await begin(workloads)
    finished = trio.Event()

    async def run() -> None:
        with active.scope:
            active.set_state(WorkloadState.RUNNING)
            await trio.sleep_forever()
        state = WorkloadState.CANCELLED if active.cancel_requested else WorkloadState.FAILED
        await workloads.finish(active, receipt_for(active, state))
        finished.set()

    nursery.start_soon(run)
    await trio.testing.wait_all_tasks_blocked()
    await workloads.cancel(ACME, "w1")
    with trio.fail_after(5):
        await finished.wait()
    view = await workloads.status(ACME, "w1")
    assert (view.state, view.error) == (WorkloadState.CANCELLED, "cancelled")
    with pytest.raises(Conflict, match="finished already"):
        await workloads.cancel(ACME, "w1")
    with pytest.raises(NotFound):
        await workloads.cancel(ACME, "never")


async def test_cancel_before_the_work_starts_still_cancels_it(workloads: Workloads) -> None:
    active = await begin(workloads)
    await workloads.cancel(ACME, "w1")
    with active.scope:
        await trio.sleep_forever()
    assert active.scope.cancelled_caught and active.cancel_requested


async def test_one_tenant_cannot_see_or_touch_anothers_workloads(workloads: Workloads) -> None:
    active = await begin(workloads)
    for call in (workloads.status, workloads.cancel, workloads.receipt):
        with pytest.raises(NotFound):
            await call(BETA, "w1")
    assert not active.scope.cancel_called
    await workloads.finish(active, receipt_for(active))
    for call in (workloads.status, workloads.cancel, workloads.receipt):
        with pytest.raises(NotFound):
            await call(BETA, "w1")
    assert workloads.get_active(ACME, "w1") is None


async def test_a_restart_marks_unfinished_workloads_failed_with_a_signed_receipt(
    tmp_path: Path, signer: SigningKey, store_cfg: StoreConfig
) -> None:
    state = tmp_path / "state"
    async with st.open_store(state, store_cfg) as store:
        workloads = await Workloads.load(store, signer)
        done = await begin(workloads, workload_id="done", key="k-done")
        signed_done = await workloads.finish(done, receipt_for(done))
        await begin(workloads, workload_id="crashed", key="k-crashed")
        # The process dies here: "crashed" never finishes.
    async with st.open_store(state, store_cfg) as store:
        workloads = await Workloads.load(store, signer)
        view = await workloads.status(ACME, "crashed")
        assert (view.state, view.error) == (WorkloadState.FAILED, RESTARTED)
        receipt = await workloads.receipt(ACME, "crashed")
        verify_receipt(signer.public, receipt)
        # The store epoch of this start: SQLite takes one per start; a shared store's opens take none.
        assert receipt.receipt.controller_epoch == store.epoch == (0 if store_cfg.url else 2)
        assert await workloads.lookup(ACME, "k-crashed") == receipt
        assert await workloads.receipt(ACME, "done") == signed_done
        assert workloads.active_count() == 0


async def test_a_tampered_receipt_does_not_verify(workloads: Workloads, signer: SigningKey) -> None:
    active = await begin(workloads)
    signed = await workloads.finish(active, receipt_for(active))
    verify_receipt(signer.public, signed)
    more_tokens = attrs.evolve(signed, receipt=attrs.evolve(signed.receipt, completion_tokens=1))
    with pytest.raises(BadSignature):
        verify_receipt(signer.public, more_tokens)
    with pytest.raises(BadSignature):
        verify_receipt(generate_signing_key().public, signed)


async def test_the_store_never_holds_the_payload(store: st.Store, workloads: Workloads) -> None:
    active = await begin(workloads)
    await workloads.finish(active, receipt_for(active))

    def dump(db: object) -> str:
        return repr(db.execute("SELECT * FROM workload").fetchall())  # type: ignore[attr-defined]

    assert "secret prompt" not in await store.run(dump)


async def test_the_stored_state_finished_at_and_error_are_the_receipts(store: st.Store, workloads: Workloads) -> None:
    active = await begin(workloads)
    assert (await store.run(st.get_workload, ACME, "w1")) == st.WorkloadRow(
        accepted=active.accepted, state=WorkloadState.QUEUED
    )
    signed = await workloads.finish(active, receipt_for(active, WorkloadState.CANCELLED))

    def columns(db: object) -> list[tuple[object, ...]]:
        sql = "SELECT state, finished_at, error FROM workload"
        return list(db.execute(sql).fetchall())  # type: ignore[attr-defined]

    r = signed.receipt
    assert await store.run(columns) == [("cancelled", r.finished_at, "cancelled")]
    row = await store.run(st.get_workload, ACME, "w1")
    assert row is not None and row.accepted == active.accepted and row.receipt == signed
    assert (row.state, row.finished_at, row.error) == (WorkloadState.CANCELLED, r.finished_at, "cancelled")


async def test_finish_refuses_a_receipt_of_another_workload(workloads: Workloads) -> None:
    active = await begin(workloads)
    with pytest.raises(ValueError, match="does not finish"):
        await workloads.finish(active, receipt_for(active, workload_id="other"))
    with pytest.raises(ValueError, match="does not finish"):
        await workloads.finish(active, receipt_for(active, WorkloadState.RUNNING))
    assert workloads.get_active(ACME, "w1") is active


async def test_finished_workloads_past_their_retention_are_pruned(store: st.Store, workloads: Workloads) -> None:
    """Their receipts and keys go; a recent one and one still running stay."""
    old = await begin(workloads, workload_id="old", key="k-old")
    await workloads.finish(old, receipt_for(old, finished_at=time.time() - 3 * 86400))
    recent = await begin(workloads, workload_id="recent", key="k-recent")
    await workloads.finish(recent, receipt_for(recent))
    running = await begin(workloads, workload_id="running", key="k-running")
    with trio.move_on_after(1):
        await workloads.run(86400.0, interval_s=3600.0)  # one pass, then it sleeps
    assert await workloads.lookup(ACME, "k-old") is None
    with pytest.raises(NotFound):
        await workloads.receipt(ACME, "old")
    assert await workloads.lookup(ACME, "k-recent") is not None
    assert (await workloads.status(ACME, "running")).state is running.state


async def test_a_workload_refused_before_admission_writes_nothing(store: st.Store, workloads: Workloads) -> None:
    def rows(db: object) -> int:
        return int(db.execute("SELECT count(*) FROM workload").fetchall()[0][0])  # type: ignore[attr-defined]

    active = await workloads.begin(ACME, KEY, create(), alias="chat", accepted_at=time.time())
    # Never recorded (the gateway refused it: quota, queue full, model not served).
    signed = await workloads.finish(active, receipt_for(active, WorkloadState.FAILED, error="quota_exceeded"))
    assert signed.receipt.state is WorkloadState.FAILED
    assert await store.run(rows) == 0
    assert workloads.active_count() == 0
    # Its id and key are still free: the retry runs.
    again = await begin(workloads)
    assert again.recorded and await store.run(rows) == 1


async def test_an_idempotency_key_replayed_with_another_body_is_refused(workloads: Workloads) -> None:
    first, other = request_sha256(create()), request_sha256(attrs.evolve(create(), payload={"messages": []}))
    assert first != other
    active = await workloads.begin(ACME, KEY, create(), alias="chat", accepted_at=time.time(), request_sha256=first)
    await workloads.record(active)
    # While it runs, and once it finished: the same body answers as before; another is a 422.
    with pytest.raises(IdempotencyKeyReused):
        await workloads.lookup(ACME, "idem-1", other)
    assert await workloads.lookup(ACME, "idem-1", first) is None  # running: no receipt yet
    signed = await workloads.finish(active, receipt_for(active))
    with pytest.raises(IdempotencyKeyReused) as refused:
        await workloads.lookup(ACME, "idem-1", other)
    assert refused.value.code == "idempotency_key_reused"
    assert await workloads.lookup(ACME, "idem-1", first) == signed
    assert await workloads.lookup(BETA, "idem-1", other) is None  # keys are per tenant
    # Nothing changed: the stored workload is the first one.
    assert (await workloads.status(ACME, "w1")).receipt == signed


def outcome_of(active: ActiveWorkload, *, opened: bool = True, status: str = "ok") -> CallOutcome:
    a = active.accepted
    return CallOutcome(
        request_id="rid-1",
        workload_id=a.workload_id,
        api=Api.WORKLOADS,
        tenant=a.tenant,
        key_id=a.key_id,
        capability=a.capability,
        alias="chat",
        model=ModelRef(model="llama", version="1"),
        deployment="chat-prod",
        node_id="n1",
        canary=False,
        status=status,
        prompt_tokens=12,
        completion_tokens=34,
        queue_ms=1.5,
        ttft_ms=20.0,
        duration_ms=80.0,
        finished_at=time.time(),
        attempts=1,
        opened=opened,
    )


@pytest.mark.parametrize(
    ("error", "state"),
    [
        (None, WorkloadState.SUCCEEDED),
        (Cancelled("the client went away"), WorkloadState.CANCELLED),
        (RuntimeFailed("the runtime failed"), WorkloadState.FAILED),
        (QuotaExceeded("used up", limit="concurrent", retry_after_s=1.0), WorkloadState.FAILED),
    ],
    ids=["ok", "cancelled", "runtime failed", "refused"],
)
async def test_end_decides_the_terminal_state_from_how_the_call_ended(
    workloads: Workloads, signer: SigningKey, error: NexaError | None, state: WorkloadState
) -> None:
    active = await begin(workloads)
    signed = await workloads.end(active, outcome_of(active, status="ok" if error is None else error.code), error)
    verify_receipt(signer.public, signed)
    r = signed.receipt
    assert (r.state, r.error) == (state, None if error is None else error.code)
    assert (r.model, r.model_version, r.prompt_tokens, r.completion_tokens) == ("llama", "1", 12, 34)
    assert (await workloads.status(ACME, "w1")).state is state


async def test_a_call_no_replica_answered_gives_a_receipt_naming_no_model(workloads: Workloads) -> None:
    active = await begin(workloads)
    error = QuotaExceeded("used up", limit="concurrent", retry_after_s=1.0)
    for outcome in (outcome_of(active, opened=False, status=error.code), None):
        again = await begin(workloads, workload_id=f"w-{outcome is None}", key=f"k-{outcome is None}")
        r = (await workloads.end(again, outcome, error)).receipt
        assert (r.alias, r.model, r.model_version, r.deployment, r.node_id) == ("", UNRESOLVED_MODEL, "", "", "")
        assert (r.prompt_tokens, r.completion_tokens, r.queue_ms, r.ttft_ms, r.duration_ms) == (0, 0, 0.0, None, 0.0)
    await workloads.finish(active, receipt_for(active))


async def test_a_receipt_from_an_outcome_signs_the_same_bytes_as_the_field_by_field_one(
    workloads: Workloads, signer: SigningKey
) -> None:
    """The receipt's fields (what is signed) are unchanged but for the LoRA adapter, last and left out
    of the signed bytes when empty, so receipts made before still verify."""
    assert [f.name for f in attrs.fields(Receipt)] == [
        "receipt_id", "workload_id", "idempotency_key_sha256", "tenant", "key_id", "capability", "alias",
        "model", "model_version", "deployment", "node_id", "state", "error", "prompt_tokens",
        "completion_tokens", "queue_ms", "ttft_ms", "duration_ms", "accepted_at", "finished_at", "controller_epoch",
        "adapter",
    ]  # fmt: skip
    active = await begin(workloads)
    outcome = outcome_of(active)
    by_hand = receipt_for(active, finished_at=outcome.finished_at)  # as the adapter copied it, field by field
    derived = Receipt.from_outcome(
        outcome,
        accepted=active.accepted,
        receipt_id=by_hand.receipt_id,
        state=WorkloadState.SUCCEEDED,
        error=None,
        finished_at=outcome.finished_at,
        controller_epoch=1,
    )
    assert attrs.evolve(derived, alias="chat") == by_hand
    old = sign_receipt(signer, by_hand)
    verify_receipt(signer.public, old)
    assert sign_receipt(signer, attrs.evolve(derived, alias="chat")).signature == old.signature
    # Without an adapter the signed bytes are those of a receipt from before adapters; with one, it is signed.
    served = attrs.evolve(by_hand, adapter="poet:a1")
    assert b'"adapter"' not in security._receipt_bytes(by_hand)
    assert b'"adapter":"poet:a1"' in security._receipt_bytes(served)
    verify_receipt(signer.public, sign_receipt(signer, served))
