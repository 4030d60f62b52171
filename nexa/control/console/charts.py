"""The request charts: one sample a second of the meter's `statistics()`, ten minutes kept.

The controller samples from its start (`sample_forever`, run by `register`), not only while a
console page is open, so the charts have history whenever one is opened. Latency quantiles are
Prometheus' `histogram_quantile` over the bucket increase between two samples.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from typing import Final

import attrs
import trio

from nexa.control.datapath.metering import Meter

#: Samples kept for the request charts: one a second, ten minutes.
SAMPLES_KEPT: Final = 600
#: A latency point covers the requests finished over this many samples.
QUANTILE_SPAN: Final = 10
#: The columns of `series` (uPlot's): time, throughput, errors/s, latency and TTFT quantiles (ms).
SERIES_COLUMNS: Final = ("t", "rps", "errors", "p50", "p95", "p99", "ttft50", "ttft95")


@attrs.frozen
class _Sample:
    at: float  # trio clock
    requests: int
    errors: int
    duration: tuple[int, ...]  # cumulative bucket counts, bounds ascending, +Inf last
    ttft: tuple[int, ...]


@attrs.frozen(kw_only=True)
class Summary:
    """Throughput (requests/s), error share and p95 (ms) over a recent span."""

    rps: float
    error_rate: float | None
    p95_ms: float | None


async def sample_each_second(sample: Callable[[float], None]) -> None:
    """Call `sample(now)` once a second, for as long as the controller serves (every chart's sampler)."""
    while True:
        sample(trio.current_time())
        await trio.sleep(1.0)


class RequestCharts:
    def __init__(self, meter: Meter) -> None:
        self._meter = meter
        self._samples: deque[_Sample] = deque(maxlen=SAMPLES_KEPT)
        self._bounds: tuple[float, ...] = ()

    async def sample_forever(self) -> None:
        """Sample once a second for as long as the controller serves."""
        await sample_each_second(self.sample)

    def sample(self, now: float) -> None:
        """Take a sample if a second has passed since the last one (the sampler, and the live views)."""
        if self._samples and now - self._samples[-1].at < 1.0:
            return
        stats = self._meter.statistics()
        self._bounds = stats.bounds_s
        self._samples.append(_Sample(now, stats.requests, stats.errors, stats.duration, stats.ttft))

    def summary(self, seconds: float) -> Summary:
        """Throughput, error share and p95 over the last `seconds` of samples."""
        self.sample(trio.current_time())
        if len(self._samples) < 2:
            return Summary(rps=0.0, error_rate=None, p95_ms=None)
        last = self._samples[-1]
        first = next((s for s in self._samples if s.at >= last.at - seconds), self._samples[0])
        if first is last:
            first = self._samples[-2]
        done = last.requests - first.requests
        return Summary(
            rps=done / max(1e-9, last.at - first.at),
            error_rate=(last.errors - first.errors) / done if done else None,
            p95_ms=quantile_ms(self._bounds, first.duration, last.duration, 0.95),
        )

    def series(self) -> dict[str, list[float | None]]:
        """Columns for uPlot: time, throughput, errors/s, p50/p95/p99 latency and p50/p95 TTFT (ms)."""
        self.sample(trio.current_time())
        out: dict[str, list[float | None]] = {k: [] for k in SERIES_COLUMNS}
        samples = list(self._samples)
        wall = time.time() - trio.current_time()
        for i in range(1, len(samples)):
            prev, cur, base = samples[i - 1], samples[i], samples[max(0, i - QUANTILE_SPAN)]
            dt = max(1e-9, cur.at - prev.at)
            out["t"].append(round(cur.at + wall, 3))
            out["rps"].append(round((cur.requests - prev.requests) / dt, 3))
            out["errors"].append(round((cur.errors - prev.errors) / dt, 3))
            for key, q in (("p50", 0.5), ("p95", 0.95), ("p99", 0.99)):
                out[key].append(quantile_ms(self._bounds, base.duration, cur.duration, q))
            for key, q in (("ttft50", 0.5), ("ttft95", 0.95)):
                out[key].append(quantile_ms(self._bounds, base.ttft, cur.ttft, q))
        return out


def quantile_ms(bounds: tuple[float, ...], before: tuple[int, ...], after: tuple[int, ...], q: float) -> float | None:
    """Prometheus-style histogram_quantile over the bucket increase between two samples (ms)."""
    if not bounds or len(before) != len(bounds) or len(after) != len(bounds):
        return None
    counts = [a - b for a, b in zip(after, before, strict=True)]
    total = counts[-1]
    if total <= 0:
        return None
    rank = q * total
    lower, below = 0.0, 0.0
    for bound, cum in zip(bounds, counts, strict=True):
        if cum >= rank:
            if math.isinf(bound):
                return round(lower * 1000, 3)
            inside = cum - below
            share = (rank - below) / inside if inside else 1.0
            return round((lower + (bound - lower) * share) * 1000, 3)
        lower, below = bound, cum
    return None
