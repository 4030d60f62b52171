"""The body of a recorded benchmark run (`POST /api/v1/benchmarks`): a concurrency sweep 1, 2, 4, 8
whose TTFT p95 climbs 90 → 650 ms (the benchmark, evidence and console tests judge it)."""

from __future__ import annotations

from typing import Any

Json = dict[str, Any]


def bench_run(deployment: str = "chat-a", **over: Any) -> Json:
    run: Json = {
        "deployment": deployment,
        "model": "chat",
        "kind": "concurrency",
        "started_at": 1_700_000_000.0,
        "duration_s": 60.0,
        "seed": 7,
        "points": [
            {"concurrency": c, "duration_s": 10, "requests": 100, "ttft_ms": {"p95": ttft}, "e2e_ms": {"p95": 800}}
            for c, ttft in ((1, 90), (2, 120), (4, 300), (8, 650))
        ],
        "client_version": "test",
    }
    run.update(over)
    return run
