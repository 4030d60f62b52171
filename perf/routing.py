"""Time of one `Router.choose` (it runs per request) over 2, 8, 32 and 128 replicas.

Each replica has a fresh load report (queue depth, KV-cache use) from a lookup shaped like
`Fleet.replica_load`, requests in flight, a prompt prefix for affinity and one canary; the old
least-outstanding router (no reports) is timed beside it as the baseline. Prints p50/p99 in µs.
Never part of the test run.

    .venv/bin/python perf/routing.py
    .venv/bin/python perf/routing.py --sizes 8 --runs 100000
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nexa.config import GatewayConfig
from nexa.contracts.deployments import ServingReplica, ServingSet
from nexa.contracts.models import ModelRef
from nexa.contracts.wire import RuntimeLoad
from nexa.control.datapath.routing import Router


def serving_set(n: int) -> ServingSet:
    stable, canary = ModelRef(model="llama", version="1"), ModelRef(model="llama", version="2")
    replicas = [
        ServingReplica(replica_id=f"r{i}", node_id=f"n{i}", deployment="chat", model=stable) for i in range(n - 1)
    ]
    replicas.append(ServingReplica(replica_id="canary", node_id="c", deployment="chat", model=canary, canary=True))
    return ServingSet(model=stable, replicas=replicas, canary_weight=0.1 if n > 1 else 0.0, deployments=["chat"])


def timings(router: Router, serving: ServingSet, runs: int, rng: random.Random) -> list[float]:
    prefixes = [f"system prompt {i} " * 8 for i in range(64)]
    out = []
    for _ in range(runs):
        prefix = rng.choice(prefixes)
        start = time.perf_counter_ns()
        router.choose(serving, prefix=prefix)
        out.append((time.perf_counter_ns() - start) / 1000.0)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[2, 8, 32, 128])
    parser.add_argument("--runs", type=int, default=20000)
    args = parser.parse_args()
    rng = random.Random(18)
    print(f"{'replicas':>8} {'router':>10} {'p50 µs':>8} {'p99 µs':>8}")
    for n in args.sizes:
        serving = serving_set(n)
        reports = {
            r.replica_id: (
                RuntimeLoad(ok=True, age_s=1.0, queue_depth=rng.randint(0, 20), kv_cache_ratio=rng.random()),
                2.0,
            )
            for r in serving.replicas
        }
        scored = Router(GatewayConfig(), load=lambda node, replica, reports=reports: reports.get(replica))
        plain = Router(GatewayConfig())
        for router in (scored, plain):
            for r in serving.replicas:
                for _ in range(rng.randint(0, 5)):
                    router.acquire(r.replica_id)
        for name, router in (("load", scored), ("in-flight", plain)):
            got = timings(router, serving, args.runs, rng)
            q = statistics.quantiles(got, n=100)
            print(f"{n:>8} {name:>10} {q[49]:>8.1f} {q[98]:>8.1f}")


if __name__ == "__main__":
    main()
