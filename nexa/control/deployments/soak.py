"""A rollout's watch, the pure part: whether it may take its next step (`held`), what in a new
replica's figures breaks the deployment's objectives (`breach`), and the record of what happened
(`with_step`). `watch` runs it against the meter; `reconciler` asks `held` before each step."""

from __future__ import annotations

import time

import attrs

from nexa.contracts.deployments import MAX_ROLLOUT_STEPS, Replica, Rollout, RolloutPolicy, RolloutStep
from nexa.contracts.evidence import ServiceObjectives
from nexa.contracts.usage import WatchStats


def held(rollout: Rollout, new: list[Replica]) -> bool:
    """Whether the rollout must wait before replacing another replica: it is paused, or one of its
    `new` replicas (each Ready) has not passed its soak yet (`Rollout.policy` set)."""
    if rollout.paused:
        return True
    if rollout.policy is None:
        return False
    passed = {s.replica_id for s in rollout.soaks if s.passed}
    return any(r.id not in passed for r in new)


def breach(objectives: ServiceObjectives, policy: RolloutPolicy, stats: WatchStats) -> str | None:
    """What in `stats` breaks `objectives`; None when they hold, or with fewer than
    `policy.min_requests` requests (too few decide nothing)."""
    if stats.requests < policy.min_requests:
        return None
    broken = []
    if stats.error_rate > objectives.max_error_rate:
        broken.append(f"error rate {stats.error_rate:.4f} > {objectives.max_error_rate:g}")
    for name, got, limit in (
        ("TTFT p95", stats.ttft_p95_ms, objectives.ttft_p95_ms),
        ("TPOT p95", stats.tpot_p95_ms, objectives.tpot_p95_ms),
        ("end-to-end p95", stats.p95_ms, objectives.e2e_p95_ms),
    ):
        if got is not None and limit is not None and got > limit:
            broken.append(f"{name} {got:.1f} ms > {limit:g} ms")
    return " and ".join(broken) or None


def figures(stats: WatchStats, seconds: float) -> str:
    """A new replica's figures as audited and shown in the rollout's steps."""

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:.1f} ms"

    return (
        f"over {seconds:.1f} s: requests {stats.requests}, errors {stats.errors}, error rate {stats.error_rate:.4f}, "
        f"TTFT p95 {ms(stats.ttft_p95_ms)}, TPOT p95 {ms(stats.tpot_p95_ms)}, p95 {ms(stats.p95_ms)}"
    )


def with_step(rollout: Rollout, what: str, detail: str = "") -> Rollout:
    """`rollout` with one more step recorded now (the oldest dropped past `MAX_ROLLOUT_STEPS`)."""
    steps = [*rollout.steps, RolloutStep(at=time.time(), what=what, detail=detail[:500])][-MAX_ROLLOUT_STEPS:]
    return attrs.evolve(rollout, steps=steps)
