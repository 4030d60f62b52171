"""What one benchmark step measured: per-request samples, their percentiles, the step's `BenchPoint`,
and the client's own stop rule for open-loop steps. Pure: no I/O, no trio."""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs

from nexa.contracts.bounds import MAX_MS
from nexa.contracts.evidence import MAX_POINTS, BenchPoint, Percentiles, ServiceObjectives
from nexa.errors import ConfigError

#: The error code of a request that never got an HTTP answer, and of one that ran past its deadline.
TRANSPORT: str = "transport"
TIMEOUT: str = "timeout"


@attrs.frozen(kw_only=True)
class Sample:
    """One request as the client saw it; times in ms from just before it was sent."""

    e2e_ms: float
    #: The first content token of a stream; None for a unary answer or a stream without one.
    ttft_ms: float | None = None
    completion_tokens: int = 0
    #: `x-nexa-overhead-ms` of the answer, when it carried a usable one.
    overhead_ms: float | None = None
    #: The envelope's `error.code` (or `transport`, `timeout`, `http_<status>`); None: it succeeded.
    error: str | None = None

    @property
    def tpot_ms(self) -> float | None:
        """Time per output token after the first (a stream of two tokens or more)."""
        if self.error is not None or self.ttft_ms is None or self.completion_tokens < 2:
            return None
        return max(0.0, self.e2e_ms - self.ttft_ms) / (self.completion_tokens - 1)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The `q`-th percentile (0..100) by linear interpolation between closest ranks; None: no value."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def percentiles(values: Sequence[float]) -> Percentiles:
    def bounded(q: float) -> float | None:
        v = percentile(values, q)
        return None if v is None else min(max(v, 0.0), MAX_MS)

    return Percentiles(p50=bounded(50), p95=bounded(95), p99=bounded(99))


def point(
    samples: Sequence[Sample], duration_s: float, *, concurrency: int | None = None, rate_rps: float | None = None
) -> BenchPoint:
    """The step's figures: latency percentiles of the requests that succeeded, errors by code over all."""
    ok = [s for s in samples if s.error is None]
    errors: dict[str, int] = {}
    for s in samples:
        if s.error is not None:
            errors[s.error] = errors.get(s.error, 0) + 1
    seconds = max(duration_s, 1e-9)
    return BenchPoint(
        concurrency=concurrency,
        rate_rps=rate_rps,
        duration_s=duration_s,
        requests=len(samples),
        errors=errors,
        ttft_ms=percentiles([s.ttft_ms for s in ok if s.ttft_ms is not None]),
        tpot_ms=percentiles([t for s in ok if (t := s.tpot_ms) is not None]),
        e2e_ms=percentiles([s.e2e_ms for s in ok]),
        overhead_ms=percentiles([s.overhead_ms for s in samples if s.overhead_ms is not None]),
        tokens_per_s=sum(s.completion_tokens for s in ok) / seconds,
        requests_per_s=len(samples) / seconds,
    )


def broken(objectives: ServiceObjectives, p: BenchPoint) -> list[str]:
    """What of `objectives` the step broke, in the controller's words ("ttft p95 812 ms > 500 ms")."""
    out = []
    for name, limit, got in (
        ("ttft", objectives.ttft_p95_ms, p.ttft_ms.p95),
        ("tpot", objectives.tpot_p95_ms, p.tpot_ms.p95),
        ("e2e", objectives.e2e_p95_ms, p.e2e_ms.p95),
    ):
        if limit is not None and got is not None and got > limit:
            out.append(f"{name} p95 {got:.0f} ms > {limit:g} ms")
    failed = sum(p.errors.values())
    if p.requests and failed / p.requests > objectives.max_error_rate:
        out.append(f"error rate {failed / p.requests:.1%} > {objectives.max_error_rate:.1%}")
    elif not p.requests:
        out.append("no request finished")
    return out


def steps(text: str, *, flag: str, whole: bool) -> list[float]:
    """`1,2,4,8` → the step values, each positive, at most `MAX_POINTS`; ConfigError saying what to give."""
    values: list[float] = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        try:
            value = float(int(part)) if whole else float(part)
        except ValueError:
            kind = "whole numbers" if whole else "numbers"
            raise ConfigError(f"{flag}: {part!r} is not a number (give {kind}, e.g. {flag} 1,2,4,8)") from None
        if not math.isfinite(value) or value <= 0 or value > 100_000:
            raise ConfigError(f"{flag}: {part} is out of range (each step is above 0 and at most 100000)")
        values.append(value)
    if not values:
        raise ConfigError(f"{flag}: give at least one step, e.g. {flag} 1,2,4")
    if len(values) > MAX_POINTS:
        raise ConfigError(f"{flag}: at most {MAX_POINTS} steps")
    return values
