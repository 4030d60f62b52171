"""Sleep-when-idle settings of a deployment (`contracts.deployments.idle_problems`): each bad value
is named, and the good ones pass (pure validation; the API refuses with 400 and changes nothing)."""

from __future__ import annotations

import math

import pytest

from nexa.contracts.deployments import DeploymentCreate, IdleSettings, deployment_problems, idle_problems


def test_sleep_when_idle_needs_both_fields_and_evictable_needs_both() -> None:
    assert idle_problems(IdleSettings()) == []
    assert idle_problems(IdleSettings(idle_after_s=2.5, min_replicas=0, evictable=True)) == []
    [alone] = idle_problems(IdleSettings(idle_after_s=60.0))
    assert alone.startswith("idle_after_s, min_replicas: give both")
    [zero] = idle_problems(IdleSettings(min_replicas=0))
    assert zero.startswith("idle_after_s, min_replicas")
    [evictable] = idle_problems(IdleSettings(evictable=True))
    assert evictable.startswith("evictable: only a deployment that may sleep")


@pytest.mark.parametrize("idle_after_s", [0.0, -1.0, math.nan, math.inf, 8 * 24 * 3600.0])
def test_an_idle_time_out_of_range_is_named(idle_after_s: float) -> None:
    problems = idle_problems(IdleSettings(idle_after_s=idle_after_s, min_replicas=0))
    assert [p.split(":")[0] for p in problems] == ["idle_after_s"]


def test_min_replicas_is_zero_or_unset() -> None:
    [problem] = idle_problems(IdleSettings(idle_after_s=60.0, min_replicas=1))
    assert problem.startswith("min_replicas: 0")


def test_a_deployment_spanning_nodes_never_sleeps() -> None:
    req = DeploymentCreate(
        name="big", runtime="vllm", alias="big", nodes_per_replica=2, idle_after_s=60.0, min_replicas=0
    )
    assert any(p.startswith("idle_after_s: a deployment whose replicas span nodes") for p in deployment_problems(req))
    ok = DeploymentCreate(name="small", runtime="vllm", alias="small", idle_after_s=60.0, min_replicas=0)
    assert deployment_problems(ok) == []
