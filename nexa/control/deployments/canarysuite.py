"""A canary's suite gate: a canary started with a suite (`CanaryCreate.suite`) is promoted only once
a measured run of that suite against its own replicas (the evaluation is the canary version's, on
deployment D) was recorded since the canary started, with every metric's pass rate at least the
gate's. The run is the controller's own once the canary is Ready (`control.operations.suitegate`,
where the gate is `run_by` the controller) or an operator's (`nexa eval run SUITE --deployment D
--canary`); the newest decides. Pure: reads the registry, never awaits."""

from __future__ import annotations

from nexa.contracts.deployments import Canary, CanarySuite
from nexa.contracts.models import EvaluationRecord
from nexa.control.registry.models import ModelRegistry
from nexa.errors import CanarySuiteUnmet


def unmet(models: ModelRegistry, deployment: str, canary: Canary) -> str | None:
    """Why the canary may not be promoted yet; None when it has no suite or passed it."""
    gate = canary.suite
    if gate is None:
        return None
    newest = newest_run(models, deployment, canary)
    what = f"suite {gate.suite} with every pass rate >= {gate.min_pass_rate:g}"
    if newest is None:
        return f"{what}: no measured run against the canary since it started ({waits_for(gate, deployment)})"
    if low := shortfall(newest, gate):
        return f"{what}: the newest run ({newest.run}) has " + ", ".join(f"{m} {v:g}" for m, v in sorted(low.items()))
    return None


def newest_run(models: ModelRegistry, deployment: str, canary: Canary) -> EvaluationRecord | None:
    """The newest measured run of the canary's suite against it since it started; None: none yet."""
    gate = canary.suite
    if gate is None:
        return None
    runs = [
        e
        for e in models.evaluations(canary.model.model, canary.model.version)
        if e.measured and e.suite == gate.suite and e.deployment == deployment and e.recorded_at >= canary.started_at
    ]
    return max(runs, key=lambda e: e.recorded_at) if runs else None


def waits_for(gate: CanarySuite, deployment: str, against: str = "canary") -> str:
    """Who runs a gate's suite against the deployment's `against` replicas (`canary`, or the
    `rollout`'s new ones), and how: the controller itself, or the operator's command."""
    command = f"nexa eval run {gate.suite} --deployment {deployment} --{against}"
    if against == "rollout":
        command += f" --min-pass-rate {gate.min_pass_rate:g}"
    if gate.by_controller:
        return f"the controller runs it as tenant {gate.tenant} (`nexa jobs list --kind eval`), or run `{command}`"
    return f"run `{command}`"


def shortfall(evaluation: EvaluationRecord, gate: CanarySuite) -> dict[str, float]:
    """Each metric of a measured run whose pass rate is below the gate's (the `.mean` figures are not rates)."""
    return {m: v for m, v in evaluation.metrics.items() if not m.endswith(".mean") and v < gate.min_pass_rate}


def check(models: ModelRegistry, deployment: str, canary: Canary) -> None:
    """Raise CanarySuiteUnmet (409) when `unmet` says why."""
    if (why := unmet(models, deployment, canary)) is not None:
        raise CanarySuiteUnmet(f"deployment {deployment}: canary {canary.model.key} cannot be promoted yet: {why}")
