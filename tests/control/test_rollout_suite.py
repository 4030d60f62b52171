"""A watched rollout's suite gate, the pure parts: the policy's shape (`rollout_policy_problems`),
the gate's verdict on a new replica from the served version's evaluations
(`nexa.control.deployments.rolloutsuite`), what `rollout status` says it waits for, and a posted
run's shape (`--canary` or `--rollout`, not both). The gate's model name reaching the new replicas
alone is in tests/control/test_serving_sets.py. The gate
end to end (a run that passes lets the rollout through, one that fails reverts it) is in
tests/e2e/test_rollout_watch.py."""

from __future__ import annotations

from typing import Any

import attrs

from nexa.contracts.deployments import (
    ROLLOUT_EVAL_PREFIX,
    CanarySuite,
    Rollout,
    RolloutPolicy,
    Soak,
    SuiteRunBy,
    rollout_policy_problems,
)
from nexa.contracts.evals import EvalRunCreate, run_problems
from nexa.contracts.models import EvaluationRecord, ModelRef
from nexa.control.deployments import rolloutsuite
from nexa.control.deployments.watch import suite_state

#: An operator runs it (`nexa eval run`); `BY_CONTROLLER` is the default: the controller, as a tenant.
GATE = CanarySuite(suite="qa", min_pass_rate=0.9, run_by=SuiteRunBy.OPERATOR)
BY_CONTROLLER = CanarySuite(suite="qa", min_pass_rate=0.9, tenant="evals")
READY_AT = 100.0


def run(at: float, **over: Any) -> EvaluationRecord:
    fields: dict[str, Any] = {
        "id": f"eval_{at:g}",
        "model": "tiny",
        "version": "v1",
        "suite": "qa",
        "metrics": {"exact": 1.0, "exact.mean": 0.2, "judge": 0.95},
        "passed": True,
        "evidence": "",
        "recorded_at": at,
        "recorded_by": None,
        "measured": True,
        "deployment": "chat-a",
        "run": f"evrun_{at:g}",
        "rollout": True,
    }
    return EvaluationRecord(**{**fields, **over})


def test_a_gate_out_of_range_is_named_with_the_policys_other_problems() -> None:
    assert rollout_policy_problems(RolloutPolicy(suite=GATE)) == []
    bad = RolloutPolicy(soak_s=-1, suite=CanarySuite(suite="Not A Name!", min_pass_rate=1.5))
    problems = rollout_policy_problems(bad)
    assert problems[0].startswith("rollout_policy.soak_s")
    assert any(p.startswith("rollout_policy.suite.suite") for p in problems), problems
    assert "rollout_policy.suite.min_pass_rate: from 0 to 1" in problems
    nan = rollout_policy_problems(RolloutPolicy(suite=attrs.evolve(GATE, min_pass_rate=float("nan"))))
    assert nan == ["rollout_policy.suite.min_pass_rate: from 0 to 1"]


def test_a_gate_the_controller_runs_names_an_existing_kind_of_tenant() -> None:
    assert rollout_policy_problems(RolloutPolicy(suite=BY_CONTROLLER)) == []
    assert BY_CONTROLLER.by_controller and not GATE.by_controller
    # The default is the controller's run, and it needs the tenant it runs as.
    [missing] = rollout_policy_problems(RolloutPolicy(suite=CanarySuite(suite="qa")))
    assert missing.startswith("rollout_policy.suite.tenant: the tenant the controller runs the suite as")
    assert missing.endswith("or rollout_policy.suite.run_by operator")
    [bad] = rollout_policy_problems(RolloutPolicy(suite=attrs.evolve(BY_CONTROLLER, tenant="Not A Name!")))
    assert bad.startswith("rollout_policy.suite.tenant:")
    # A gate kept before `run_by` existed names no tenant: an operator runs it.
    assert not CanarySuite(suite="qa").by_controller


def test_only_a_measured_run_of_the_suite_on_the_new_replicas_since_the_replica_was_ready_counts() -> None:
    others = [
        run(99.0),  # before the replica was Ready
        run(101.0, measured=False),  # an operator's word
        run(102.0, suite="other"),
        run(103.0, deployment="chat-b"),
        run(103.5, rollout=False),  # against the whole deployment, old replicas included
    ]
    waiting = rolloutsuite.verdict(others, "chat-a", GATE, since=READY_AT)
    assert waiting.passed is None
    assert "run `nexa eval run qa --deployment chat-a --rollout --min-pass-rate 0.9`" in waiting.detail

    passed = rolloutsuite.verdict([*others, run(104.0)], "chat-a", GATE, since=READY_AT)
    assert passed.passed is True
    assert passed.detail == "suite qa with every pass rate >= 0.9: run evrun_104 passed (exact 1, judge 0.95)"


def test_the_newest_run_decides_and_a_rate_below_the_gate_fails_naming_it() -> None:
    low = run(105.0, metrics={"exact": 0.5, "exact.mean": 0.5, "judge": 0.95})
    failed = rolloutsuite.verdict([run(104.0), low], "chat-a", GATE, since=READY_AT)
    assert failed.passed is False
    assert "run evrun_105 has exact 0.5 (all: exact 0.5, judge 0.95)" in failed.detail
    # A later passing run decides again (the mean figures are not rates: 0.2 fails nothing).
    assert rolloutsuite.verdict([low, run(106.0)], "chat-a", GATE, since=READY_AT).passed is True
    # Exactly at the gate passes.
    edge = run(107.0, metrics={"exact": 0.9})
    assert rolloutsuite.verdict([edge], "chat-a", GATE, since=READY_AT).passed is True


def test_status_says_what_the_gate_waits_for() -> None:
    v1 = ModelRef(model="tiny", version="v1")
    plain = Rollout(from_=v1, to=v1, reason="change", started_at=1.0, policy=RolloutPolicy())
    assert suite_state("chat-a", plain) is None
    assert suite_state("chat-a", None) is None
    gated = Rollout(from_=v1, to=v1, reason="change", started_at=1.0, policy=RolloutPolicy(suite=GATE))
    before = suite_state("chat-a", gated)
    assert before is not None and before.startswith("each new replica, once it soaked unbroken, waits for suite qa")
    soaks = [
        Soak(replica_id="r1", node_ids=["n1"], ready_at=2.0, suite_wait=True, passed=True),
        Soak(replica_id="r2", node_ids=["n2"], ready_at=3.0, suite_wait=True),
    ]
    waiting = suite_state("chat-a", attrs.evolve(gated, soaks=soaks))
    assert waiting == (
        "replica(s) r2 soaked unbroken and wait for suite qa (every pass rate >= 0.9): "
        "run `nexa eval run qa --deployment chat-a --rollout --min-pass-rate 0.9`"
    )
    by_controller = attrs.evolve(gated, soaks=soaks, policy=RolloutPolicy(suite=BY_CONTROLLER))
    assert suite_state("chat-a", by_controller) == (
        "replica(s) r2 soaked unbroken and wait for suite qa (every pass rate >= 0.9): the controller runs it "
        "as tenant evals (`nexa jobs list --kind eval`), or run "
        "`nexa eval run qa --deployment chat-a --rollout --min-pass-rate 0.9`"
    )


def test_a_run_posted_for_both_the_canary_and_the_rollout_is_refused() -> None:
    posted = EvalRunCreate(
        suite="qa",
        digest="0" * 64,
        deployment="chat-a",
        model=ROLLOUT_EVAL_PREFIX + "chat-a",
        started_at=1.0,
        duration_s=1.0,
        concurrency=1,
        cases=[],
        rollout=True,
    )
    assert run_problems(posted) == []
    both = run_problems(attrs.evolve(posted, canary=True))
    assert both == ["canary, rollout: one of them (a canary and a rollout never run together)"]
