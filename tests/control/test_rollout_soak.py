"""A rollout's watch, the pure part (`nexa.control.deployments.soak`), and the sim runtime's faults
by image that the end-to-end test (tests/e2e/test_rollout_watch.py) uses to make a bad image."""

from __future__ import annotations

from pathlib import Path

import pytest

from nexa.contracts.deployments import Replica, Rollout, RolloutPolicy, Soak
from nexa.contracts.evidence import ServiceObjectives
from nexa.contracts.models import ModelRef
from nexa.contracts.usage import WatchStats
from nexa.control.deployments.soak import breach, held, with_step
from nexa.errors import ConfigError
from nexa.simruntime.faults import Faults, FaultsSource, Phase

V1 = ModelRef(model="tiny", version="v1")
POLICY = RolloutPolicy(soak_s=5, min_requests=10)


def rollout(**over: object) -> Rollout:
    return Rollout(from_=V1, to=V1, reason="change", started_at=1.0, policy=POLICY, **over)  # type: ignore[arg-type]


def test_too_few_requests_decide_nothing_and_each_objective_is_named_when_broken() -> None:
    objectives = ServiceObjectives(ttft_p95_ms=100, tpot_p95_ms=20, max_error_rate=0.1)
    assert breach(objectives, POLICY, WatchStats(requests=9, errors=9)) is None
    assert breach(objectives, POLICY, WatchStats(requests=10, errors=1, ttft_p95_ms=100, tpot_p95_ms=20)) is None
    got = breach(objectives, POLICY, WatchStats(requests=10, errors=2, ttft_p95_ms=150, tpot_p95_ms=25))
    assert got == "error rate 0.2000 > 0.1 and TTFT p95 150.0 ms > 100 ms and TPOT p95 25.0 ms > 20 ms"
    # A figure not measured (no stream, no tokens) breaks nothing; an objective not set checks nothing.
    assert breach(ServiceObjectives(), POLICY, WatchStats(requests=10, errors=0, p95_ms=10_000)) is None


def test_a_rollout_is_held_while_paused_or_while_a_new_replica_has_not_passed_its_soak() -> None:
    new = [Replica(id="r1", node_id="n1"), Replica(id="r2", node_id="n2")]
    soaks = [Soak(replica_id="r1", node_ids=["n1"], ready_at=2.0, passed=True)]
    assert held(rollout(soaks=soaks), new)
    passed = [*soaks, Soak(replica_id="r2", node_ids=["n2"], ready_at=3.0, passed=True)]
    assert not held(rollout(soaks=passed), new)
    assert held(rollout(soaks=passed, paused=True), new)
    unwatched = Rollout(from_=V1, to=V1, reason="revert", started_at=1.0)
    assert not held(unwatched, new)


def test_steps_are_recorded_in_order_and_bounded() -> None:
    r = rollout()
    for i in range(120):
        r = with_step(r, "replaced", f"step {i}")
    assert len(r.steps) == 100 and r.steps[0].detail == "step 20" and r.steps[-1].detail == "step 119"


def test_faults_by_image_apply_to_that_image_only() -> None:
    faults = Faults.from_json({"images": {"sha256:bad": {"fail": "before", "status": 503}}, "queue_depth": 2})
    bad = faults.for_image("registry/sim@sha256:bad")
    assert bad.fail is Phase.BEFORE and bad.status == 503 and bad.queue_depth == 0
    assert faults.for_image("registry/sim@sha256:good") is faults
    assert faults.for_image("") is faults


@pytest.mark.parametrize(
    ("images", "problem"),
    [
        ([], "images: an object of texts -> faults"),
        ({"": {}}, "images: an object of texts -> faults"),
        ({"x": {"fail": "sometimes"}}, "images.x: invalid faults: fail: must be 'before', 'after' or null"),
        ({"x": {"images": {}}}, "images.x: faults without images or loras of their own"),
        ({"x": {"loras": {}}}, "images.x: faults without images or loras of their own"),
    ],
)
def test_bad_faults_by_image_are_refused_naming_the_entry(images: object, problem: str) -> None:
    with pytest.raises(ConfigError) as caught:
        Faults.from_json({"images": images})
    assert problem in caught.value.message


def test_faults_by_adapter_strike_requests_naming_an_adapter_loaded_from_a_matching_path(tmp_path: Path) -> None:
    path = tmp_path / "faults.json"
    path.write_text('{"loras": {"abc123": {"fail": "before"}}, "images": {"sha256:bad": {"slow_ms": 5}}}')
    source = FaultsSource(str(path), Faults(), image="r@sha256:bad")
    assert source.current("/cache/blobs/abc123").fail is Phase.BEFORE
    by_image = source.current("/cache/blobs/def456")
    assert by_image.fail is None and by_image.slow_ms == 5  # another adapter: the image's faults
    assert source.current().slow_ms == 5
    with pytest.raises(ConfigError) as caught:
        Faults.from_json({"loras": {"x": {"loras": {}}}})
    assert "loras.x: faults without images or loras of their own" in caught.value.message


def test_the_faults_file_is_read_for_this_runtimes_image(tmp_path: Path) -> None:
    path = tmp_path / "faults.json"
    path.write_text('{"images": {"sha256:bad": {"fail": "before"}}}')
    assert FaultsSource(str(path), Faults(), image="r@sha256:bad").current().fail is Phase.BEFORE
    assert FaultsSource(str(path), Faults(), image="r@sha256:good").current().fail is None
