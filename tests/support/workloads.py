"""Canonical workloads as the gateway begins and finishes them, for the tests of `nexa.control.datapath.workloads`."""

from __future__ import annotations

import time
from typing import Final

import attrs

from nexa.contracts.domain import KeyId, TenantId
from nexa.contracts.gateway import API_VERSION, Capability, Receipt, WorkloadCreate, WorkloadState
from nexa.control.datapath.workloads import ActiveWorkload, Workloads, new_receipt_id

ACME: Final = TenantId("acme")
KEY: Final = KeyId("k1")


def create(workload_id: str = "w1", key: str = "idem-1") -> WorkloadCreate:
    """A canonical chat workload of id `workload_id` under idempotency key `key`."""
    return WorkloadCreate(
        version=API_VERSION,
        idempotency_key=key,
        workload_id=workload_id,
        capability=Capability.CHAT,
        model="chat",
        payload={"messages": [{"role": "user", "content": "secret prompt"}]},
    )


def receipt_for(active: ActiveWorkload, state: WorkloadState = WorkloadState.SUCCEEDED, **changes: object) -> Receipt:
    """A receipt that finishes `active` in `state`, with `changes` over its fields."""
    a = active.accepted
    base = Receipt(
        receipt_id=new_receipt_id(),
        workload_id=a.workload_id,
        idempotency_key_sha256=a.idempotency_key_sha256,
        tenant=a.tenant,
        key_id=a.key_id,
        capability=a.capability,
        alias=a.alias,
        model="llama",
        model_version="1",
        deployment="chat-prod",
        node_id="n1",
        state=state,
        error=None if state is WorkloadState.SUCCEEDED else "cancelled",
        prompt_tokens=12,
        completion_tokens=34,
        queue_ms=1.5,
        ttft_ms=20.0,
        duration_ms=80.0,
        accepted_at=a.accepted_at,
        finished_at=a.accepted_at + 0.08,
        controller_epoch=1,
    )
    return attrs.evolve(base, **changes)


async def begin(workloads: Workloads, tenant: TenantId = ACME, **kw: str) -> ActiveWorkload:
    """Accept a workload and record it, as the gateway does once it is admitted."""
    active = await workloads.begin(tenant, KEY, create(**kw), alias="chat", accepted_at=time.time())
    await workloads.record(active)
    return active
