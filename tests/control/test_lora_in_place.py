"""A new LoRA adapter version as a canary on the same replicas (issue 34, point 2), the pure part: when
an adapter change goes in place (`records.goes_in_place`), what the replicas are given meanwhile
(`records.given_loras`), that no replica stops being current, and how each request draws its version
(`lora.LoraRoute.pick`). tests/e2e/test_lora_rollout_watch.py runs it end to end with real agents."""

from __future__ import annotations

import attrs
import pytest

from nexa.contracts.deployments import (
    CanarySuite,
    Replica,
    RolloutPolicy,
    RuntimeOptions,
    SuiteRunBy,
    rollout_policy_problems,
)
from nexa.contracts.models import ModelRef
from nexa.control.datapath.lora import LoraRoute
from nexa.control.deployments.records import (
    given_loras,
    goes_in_place,
    is_current,
    pin_specs,
    with_loras,
)
from tests.support.adapters import PORT, deployment

A1 = ModelRef(model="poet", version="a1")
A2 = ModelRef(model="poet", version="a2")
C1 = ModelRef(model="coder", version="c1")
POLICY = RolloutPolicy(soak_s=5, min_requests=10, adapter_weight=0.25)


def serving(loras: dict[str, ModelRef]):  # type: ignore[no-untyped-def]
    dep = deployment(RuntimeOptions(port=PORT))
    replicas = [Replica(id=f"chat-r{i}", node_id=f"spark-{i}", model=dep.model) for i in (1, 2)]
    dep = attrs.evolve(dep, loras=loras, placed=replicas)
    return attrs.evolve(dep, placed=pin_specs(dep))  # as a replica records its spec once a rollout pins it


def test_only_versions_moving_on_a_run_time_runtime_without_a_suite_go_in_place() -> None:
    dep = serving({"poet": A1, "coder": C1})
    assert goes_in_place(dep, {"poet": A2, "coder": C1}, POLICY, live=True)
    assert not goes_in_place(dep, {"poet": A2, "coder": C1}, POLICY, live=False)  # loaded at start
    assert not goes_in_place(dep, {"poet": A1}, POLICY, live=True)  # an alias gone: the runtime's flags change
    assert not goes_in_place(dep, {"poet": A1, "coder": C1, "judge": A2}, POLICY, live=True)  # an alias more
    assert not goes_in_place(dep, {"poet": A1, "coder": C1}, POLICY, live=True)  # nothing moves
    gated = attrs.evolve(POLICY, suite=CanarySuite(suite="s", run_by=SuiteRunBy.OPERATOR))
    assert not goes_in_place(dep, {"poet": A2, "coder": C1}, gated, live=True)  # a suite measures new replicas
    assert not goes_in_place(attrs.evolve(dep, nodes_per_replica=2), {"poet": A2, "coder": C1}, POLICY, live=True)


def test_in_place_every_replica_stays_current_and_is_given_both_versions_until_it_ends() -> None:
    dep = serving({"poet": A1, "coder": C1})
    moved = with_loras(dep, {"poet": A2, "coder": C1}, POLICY, in_place=True)
    assert moved.rollout is not None and moved.rollout.in_place and moved.rollout.reason == "adapter"
    assert moved.rollout.good is not None and moved.rollout.good.loras == {"poet": A1, "coder": C1}
    assert all(is_current(moved, r) for r in moved.placed)  # nothing to replace
    assert given_loras(moved) == [("coder", C1), ("poet", A1), ("poet", A2)]
    assert given_loras(attrs.evolve(moved, rollout=None)) == [("coder", C1), ("poet", A2)]  # passed: a1 let go
    # The same change on a runtime that loads at start replaces every replica instead.
    rolled = with_loras(dep, {"poet": A2, "coder": C1}, POLICY)
    assert rolled.rollout is not None and not rolled.rollout.in_place
    assert not any(is_current(rolled, r) for r in rolled.placed)
    assert given_loras(rolled) == [("coder", C1), ("poet", A2)]


def test_a_request_draws_the_new_version_by_the_weight_and_retries_on_the_earlier_one() -> None:
    route = LoraRoute(version=A1, name="poet@a1", canary=(A2, "poet@a2"), weight=0.25)
    assert route.pick(0.1, canary_failed=False) == (A2, "poet@a2", True)
    assert route.pick(0.25, canary_failed=False) == (A1, "poet@a1", False)
    assert route.pick(0.1, canary_failed=True) == (A1, "poet@a1", False)  # its attempt failed: the earlier one
    draws = [i / 1000 for i in range(1000)]
    assert sum(route.pick(d, canary_failed=False)[2] for d in draws) == 250
    assert LoraRoute(version=A2, name="poet@a2").pick(0.0, canary_failed=False) == (A2, "poet@a2", False)


@pytest.mark.parametrize("weight", [0.0, 0.009, 1.5, float("nan")])
def test_an_adapter_weight_out_of_range_is_refused(weight: float) -> None:
    assert rollout_policy_problems(attrs.evolve(POLICY, adapter_weight=weight)) == [
        "rollout_policy.adapter_weight: from 0.01 to 1"
    ]
