"""A watched rollout's suite gate (`RolloutPolicy.suite`), the pure part: a new replica that soaked
its time unbroken passes only once a measured run of the suite against the rollout's new replicas
(through the gateway to those replicas alone: the evaluation of the version D serves, marked with
D and `rollout`) was recorded since that replica became Ready. The run is the controller's own
(`control.operations.suitegate`, where the gate is `run_by` the controller, the default) or an
operator's (`nexa eval run SUITE --deployment D --rollout`). The newest such run decides: every
metric's pass rate at least the gate's passes the replica; anything less is a breach, and the
rollout reverts. No run yet holds the rollout, and `rollout status` says who runs it (and the
command). A run against the whole deployment (old replicas included) does not count.
`watch.ChangeWatcher` asks `verdict` with the served version's evaluations; never awaits."""

from __future__ import annotations

from collections.abc import Iterable

import attrs

from nexa.contracts.deployments import CanarySuite
from nexa.contracts.models import EvaluationRecord
from nexa.control.deployments.canarysuite import shortfall, waits_for


@attrs.frozen
class Verdict:
    """What the gate says of one new replica: `passed` None while no run decides; `detail` says why."""

    passed: bool | None
    detail: str


def verdict(evaluations: Iterable[EvaluationRecord], deployment: str, gate: CanarySuite, *, since: float) -> Verdict:
    """The gate's verdict on a replica of `deployment` Ready since `since`, from the evaluations of
    the version the deployment serves."""
    runs = [
        e
        for e in evaluations
        if e.measured and e.rollout and e.suite == gate.suite and e.deployment == deployment and e.recorded_at >= since
    ]
    what = f"suite {gate.suite} with every pass rate >= {gate.min_pass_rate:g}"
    if not runs:
        return Verdict(None, f"{what}: no measured run yet ({waits_for(gate, deployment, 'rollout')})")
    newest = max(runs, key=lambda e: e.recorded_at)
    rates = ", ".join(f"{m} {v:g}" for m, v in sorted(newest.metrics.items()) if not m.endswith(".mean"))
    if low := shortfall(newest, gate):
        below = ", ".join(f"{m} {v:g}" for m, v in sorted(low.items()))
        return Verdict(False, f"{what}: run {newest.run} has {below} (all: {rates})")
    return Verdict(True, f"{what}: run {newest.run} passed ({rates})")
