"""The pure parts of `nexa bench`: percentiles, a step's figures, the saturation stop rule, the step flags."""

from __future__ import annotations

import pytest

from nexa.bench.stats import TRANSPORT, Sample, broken, percentile, percentiles, point, steps
from nexa.contracts.evidence import BenchPoint, Percentiles, ServiceObjectives
from nexa.errors import ConfigError


def test_percentiles_interpolate_between_closest_ranks() -> None:
    values = [float(v) for v in range(1, 101)]  # 1..100
    assert percentile(values, 50) == pytest.approx(50.5)
    assert percentile(values, 95) == pytest.approx(95.05)
    assert percentile(values, 99) == pytest.approx(99.01)
    assert percentile([7.0], 99) == 7.0
    assert percentile([], 50) is None
    assert percentiles([]) == Percentiles()
    assert percentile([3.0, 1.0, 2.0], 0) == 1.0 and percentile([3.0, 1.0, 2.0], 100) == 3.0


def test_a_step_counts_errors_by_code_and_times_only_what_succeeded() -> None:
    samples = [
        Sample(e2e_ms=100.0, ttft_ms=10.0, completion_tokens=10, overhead_ms=0.5),
        Sample(e2e_ms=200.0, ttft_ms=20.0, completion_tokens=10, overhead_ms=1.5),
        Sample(e2e_ms=5.0, error="runtime_failed", overhead_ms=0.2),
        Sample(e2e_ms=9000.0, error=TRANSPORT),
        Sample(e2e_ms=1.0, error="runtime_failed"),
    ]
    p = point(samples, 2.0, concurrency=4)
    assert p.concurrency == 4 and p.rate_rps is None and p.requests == 5
    assert p.errors == {"runtime_failed": 2, "transport": 1}
    assert p.e2e_ms.p50 == pytest.approx(150.0) and p.e2e_ms.p99 is not None and p.e2e_ms.p99 <= 200.0
    assert p.ttft_ms.p50 == pytest.approx(15.0)
    # (100 - 10) / 9 = 10 and (200 - 20) / 9 = 20 ms per token after the first
    assert p.tpot_ms.p50 == pytest.approx(15.0)
    assert p.overhead_ms.p50 == pytest.approx(0.5)  # every answer that said it, errors too
    assert p.tokens_per_s == pytest.approx(10.0) and p.requests_per_s == pytest.approx(2.5)


def test_tpot_needs_a_stream_of_two_tokens() -> None:
    assert Sample(e2e_ms=50.0, ttft_ms=10.0, completion_tokens=1).tpot_ms is None
    assert Sample(e2e_ms=50.0, completion_tokens=8).tpot_ms is None  # unary: no first token
    assert Sample(e2e_ms=50.0, ttft_ms=10.0, completion_tokens=5).tpot_ms == pytest.approx(10.0)


def _point(*, ttft_p95: float | None = None, errors: int = 0, requests: int = 100) -> BenchPoint:
    return BenchPoint(
        rate_rps=10.0,
        duration_s=1.0,
        requests=requests,
        errors={"overloaded": errors} if errors else {},
        ttft_ms=Percentiles(p50=1.0, p95=ttft_p95, p99=ttft_p95),
    )


def test_the_stop_rule_breaks_on_latency_or_errors_and_ignores_unset_objectives() -> None:
    loose = ServiceObjectives()
    assert broken(loose, _point(ttft_p95=10_000.0)) == []  # no latency objective set
    tight = ServiceObjectives(ttft_p95_ms=500, max_error_rate=0.05)
    assert broken(tight, _point(ttft_p95=400.0, errors=5)) == []  # 5 % is not above 5 %
    assert broken(tight, _point(ttft_p95=812.4)) == ["ttft p95 812 ms > 500 ms"]
    assert broken(tight, _point(ttft_p95=100.0, errors=6)) == ["error rate 6.0% > 5.0%"]
    assert broken(tight, _point(requests=0)) == ["no request finished"]
    assert broken(tight, _point(ttft_p95=None)) == []  # no sample of it: nothing to judge


def test_step_flags_take_positive_numbers_and_say_what_to_give() -> None:
    assert steps("1,2, 4,8", flag="--concurrency", whole=True) == [1.0, 2.0, 4.0, 8.0]
    assert steps("2.5,5", flag="--rates", whole=False) == [2.5, 5.0]
    for bad in ("", "0", "-1", "two", "1.5", "1,,x", "200000"):
        with pytest.raises(ConfigError, match="--concurrency"):
            steps(bad, flag="--concurrency", whole=True)
    with pytest.raises(ConfigError, match="at most 64"):
        steps(",".join(["1"] * 65), flag="--rates", whole=False)
    with pytest.raises(ConfigError, match="--rates"):
        steps("nan", flag="--rates", whole=False)
