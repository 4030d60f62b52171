"""Usage records as metering writes them, for tests that seed or read the usage table."""

from __future__ import annotations

from typing import Any

import attrs

from nexa.contracts.domain import KeyId, TenantId
from nexa.contracts.gateway import Api, Capability, UsageRecord
from nexa.control import store as st

#: 2023-11-14 22:13:20 UTC: when `usage_record`'s request finished unless told otherwise.
FINISHED_AT = 1_700_000_000.0


def usage_record(**changes: Any) -> UsageRecord:
    """One finished chat request of tenant acme on llama:1, with `changes` over those fields."""
    base = UsageRecord(
        request_id="req0",
        workload_id=None,
        api=Api.OPENAI,
        tenant=TenantId("acme"),
        key_id=KeyId("k1"),
        capability=Capability.CHAT,
        alias="chat",
        model="llama",
        model_version="1",
        deployment="chat-prod",
        node_id="n1",
        status="ok",
        prompt_tokens=10,
        completion_tokens=20,
        queue_ms=1.0,
        ttft_ms=50.0,
        duration_ms=100.0,
        finished_at=FINISHED_AT,
    )
    return attrs.evolve(base, **changes)


async def stored_count(store: st.Store) -> int:
    """How many requests the usage table holds, over all time."""
    report = await store.run(st.usage_report, 0.0, 1e12, None, None)
    return sum(row.requests for row in report)
