"""The gateway's map of stored Responses API responses to the replica keeping each
(`control/datapath/stored.py`): per tenant, bounded in entries, forgotten after its TTL. Pure."""

from __future__ import annotations

import time

import attrs
import pytest

from nexa.contracts.deployments import ServingReplica, ServingSet
from nexa.contracts.domain import KeyId, TenantId
from nexa.contracts.gateway import Api, Capability
from nexa.contracts.models import ModelRef
from nexa.control.datapath.calls import Work
from nexa.control.datapath.gateway import _pinned
from nexa.control.datapath.stored import MAX_RESPONSE_ID_CHARS, Pin, StoredResponses
from nexa.errors import StoredResponseLost

ACME, GLOBEX = TenantId("acme"), TenantId("globex")


def pin(replica: str, at: float = 0.0) -> Pin:
    return Pin(deployment="chat", replica_id=replica, made_at=at)


def test_a_response_is_found_for_its_tenant_only() -> None:
    stored = StoredResponses()
    stored.remember(ACME, "resp_1", pin("r1"))
    assert stored.find(ACME, "resp_1", 1.0) == pin("r1")
    assert stored.find(GLOBEX, "resp_1", 1.0) is None  # another tenant's id: never routed
    assert stored.find(ACME, "resp_2", 1.0) is None
    stored.forget(ACME, "resp_1")
    assert stored.find(ACME, "resp_1", 1.0) is None


def test_a_response_is_forgotten_after_its_ttl() -> None:
    stored = StoredResponses(ttl_s=10.0)
    stored.remember(ACME, "old", pin("r1", at=0.0))
    stored.remember(ACME, "new", pin("r2", at=5.0))
    assert stored.find(ACME, "old", 9.9) is not None
    assert stored.find(ACME, "old", 10.0) is None and stored.find(ACME, "new", 10.0) == pin("r2", at=5.0)
    assert stored.find(ACME, "new", 15.0) is None and len(stored) == 0


def test_the_map_is_bounded_dropping_the_oldest_first() -> None:
    stored = StoredResponses(max_entries=2)
    for n in range(3):
        stored.remember(ACME, f"resp_{n}", pin(f"r{n}", at=float(n)))
    assert len(stored) == 2
    assert stored.find(ACME, "resp_0", 3.0) is None
    assert stored.find(ACME, "resp_2", 3.0) == pin("r2", at=2.0)
    # Ids no runtime makes are not kept (nor is an empty one).
    stored.remember(ACME, "x" * (MAX_RESPONSE_ID_CHARS + 1), pin("r9", at=3.0))
    stored.remember(ACME, "", pin("r9", at=3.0))
    assert len(stored) == 2


def test_a_pinned_request_goes_to_its_replica_alone_or_is_lost() -> None:
    ref = ModelRef(model="tiny", version="v1")
    replicas = [
        ServingReplica(replica_id=r, node_id=n, deployment="chat", model=ref, keeps_responses=True)
        for r, n in (("r1", "sim-1"), ("r2", "sim-2"))
    ]
    serving = ServingSet(model=ref, replicas=replicas, deployments=["chat"])
    work = Work(
        request_id="req-1",
        api=Api.RESPONSES,
        tenant=ACME,
        key_id=KeyId("k1"),
        capability=Capability.RESPONSES,
        model="chat",
        body={"input": "and then", "previous_response_id": "resp_1"},
        stream=False,
        deadline_at=time.time() + 30,
    )
    assert _pinned(work, serving) is serving  # not pinned: every replica
    assert [r.replica_id for r in _pinned(attrs.evolve(work, pin="r2"), serving).replicas] == ["r2"]
    with pytest.raises(StoredResponseLost) as lost:
        _pinned(attrs.evolve(work, pin="r3"), serving)  # its replica is gone: never another one
    assert lost.value.code == "stored_response_lost" and "send the whole conversation" in lost.value.message
