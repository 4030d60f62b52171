"""Replica choice: least outstanding, rotation on ties, exclusion, a deterministic canary share,
prefix affinity that sticks and yields past its slack; scores on the runtimes' reported load
(queue, KV cache) with per-deployment weights, stale or failing reports ignored."""

from __future__ import annotations

from collections import Counter

import attrs
import hypothesis
import hypothesis.strategies as hs

from nexa.config import GatewayConfig
from nexa.contracts.deployments import RoutingWeights, ServingReplica, ServingSet, routing_problems
from nexa.contracts.models import ModelRef
from nexa.contracts.wire import RuntimeLoad
from nexa.control.datapath.routing import Router, for_data_class

STABLE = ModelRef(model="llama", version="1")
CANARY = ModelRef(model="llama", version="2")


def replicas(n: int, *, canary: int = 0) -> ServingSet:
    stable = [ServingReplica(replica_id=f"s{i}", node_id=f"n{i}", deployment="chat", model=STABLE) for i in range(n)]
    canaries = [
        ServingReplica(replica_id=f"c{i}", node_id=f"m{i}", deployment="chat", model=CANARY, canary=True)
        for i in range(canary)
    ]
    return ServingSet(model=STABLE, replicas=stable + canaries, deployments=["chat"])


def test_least_outstanding_wins() -> None:
    router = Router(GatewayConfig())
    serving = replicas(3)
    for _ in range(3):
        router.acquire("s0")
    router.acquire("s1")
    assert router.choose(serving, prefix=None).replica_id == "s2"  # type: ignore[union-attr]
    router.acquire("s2")
    router.acquire("s2")
    assert router.choose(serving, prefix=None).replica_id == "s1"  # type: ignore[union-attr]
    for _ in range(3):
        router.release("s0")
    router.release("s0")  # never below zero
    assert router.outstanding("s0") == 0
    assert router.choose(serving, prefix=None).replica_id == "s0"  # type: ignore[union-attr]


def test_ties_are_taken_in_turn() -> None:
    router = Router(GatewayConfig())
    serving = replicas(3)
    chosen = [router.choose(serving, prefix=None).replica_id for _ in range(9)]  # type: ignore[union-attr]
    assert Counter(chosen) == {"s0": 3, "s1": 3, "s2": 3}
    assert chosen[:3] == ["s0", "s1", "s2"]


def test_excluded_replicas_are_skipped_until_none_is_left() -> None:
    router = Router(GatewayConfig())
    serving = replicas(2, canary=1)
    tried: list[str] = []
    for _ in range(3):
        replica = router.choose(serving, prefix=None, exclude=tried)
        assert replica is not None and replica.replica_id not in tried
        tried.append(replica.replica_id)
    assert sorted(tried) == ["c0", "s0", "s1"]
    assert router.choose(serving, prefix=None, exclude=tried) is None
    assert router.choose(ServingSet(model=STABLE, replicas=[]), prefix=None) is None


def test_canary_share_is_deterministic_and_exact() -> None:
    router = Router(GatewayConfig())
    for weight in (0.1, 0.05, 0.25, 0.5):
        serving = attrs.evolve(replicas(3, canary=1), canary_weight=weight)
        picks = [router.choose(serving, prefix=None).canary for _ in range(1000)]  # type: ignore[union-attr]
        assert abs(sum(picks) / 1000 - weight) <= 0.01, weight
        # Smooth: every block of 100 gets its share, not a burst.
        assert abs(sum(picks[:100]) - weight * 100) <= 1
    first_hundred = attrs.evolve(replicas(3, canary=1), canary_weight=0.1, deployments=["other"])
    assert sum(router.choose(first_hundred, prefix=None).canary for _ in range(100)) == 10  # type: ignore[union-attr]


def test_canary_gets_everything_when_stable_is_excluded_and_nothing_at_weight_zero() -> None:
    router = Router(GatewayConfig())
    serving = replicas(2, canary=1)
    assert all(not router.choose(serving, prefix=None).canary for _ in range(50))  # type: ignore[union-attr]
    only_canary = router.choose(attrs.evolve(serving, canary_weight=0.1), prefix=None, exclude=["s0", "s1"])
    assert only_canary is not None and only_canary.canary


def test_prefix_affinity_sticks_and_yields_past_the_slack() -> None:
    router = Router(GatewayConfig(affinity_slack=2))
    serving = replicas(4)
    home = router.choose(serving, prefix="You are a helpful assistant.")
    assert home is not None
    for _ in range(20):
        assert router.choose(serving, prefix="You are a helpful assistant.") == home
    # Load the home replica up to the slack: it still keeps its prefix.
    router.acquire(home.replica_id)
    router.acquire(home.replica_id)
    assert router.choose(serving, prefix="You are a helpful assistant.") == home
    router.acquire(home.replica_id)  # 3 > 0 + 2: yields to the least loaded
    moved = router.choose(serving, prefix="You are a helpful assistant.")
    assert moved is not None and moved != home
    # Different prefixes spread over the replicas.
    homes = {router.choose(serving, prefix=f"system prompt {i}").replica_id for i in range(200)}  # type: ignore[union-attr]
    assert len(homes) >= 3


def test_affinity_off_ignores_the_prefix() -> None:
    router = Router(GatewayConfig(prefix_affinity=False))
    serving = replicas(3)
    chosen = {router.choose(serving, prefix="same").replica_id for _ in range(3)}  # type: ignore[union-attr]
    assert chosen == {"s0", "s1", "s2"}


@hypothesis.given(
    n=hs.integers(min_value=1, max_value=6),
    loads=hs.lists(hs.integers(min_value=0, max_value=20), min_size=6, max_size=6),
    excluded=hs.sets(hs.integers(min_value=0, max_value=5)),
)
def test_property_without_affinity_the_choice_is_a_least_loaded_candidate(
    n: int, loads: list[int], excluded: set[int]
) -> None:
    router = Router(GatewayConfig(prefix_affinity=False))
    serving = replicas(n)
    for i in range(n):
        for _ in range(loads[i]):
            router.acquire(f"s{i}")
    exclude = {f"s{i}" for i in excluded}
    left = [f"s{i}" for i in range(n) if f"s{i}" not in exclude]
    chosen = router.choose(serving, prefix=None, exclude=exclude)
    if not left:
        assert chosen is None
    else:
        assert chosen is not None and chosen.replica_id in left
        assert router.outstanding(chosen.replica_id) == min(router.outstanding(r) for r in left)


def test_a_data_class_keeps_only_the_replicas_on_nodes_allowed_it() -> None:
    serving = replicas(3, canary=1)
    allowed = {"n0": ("public",), "n1": ("public", "confidential"), "n2": (), "m0": ("confidential",)}
    kept = for_data_class(serving, "confidential", lambda node: allowed.get(node, ()))
    assert [r.replica_id for r in kept.replicas] == ["s1", "c0"]
    assert kept.model == serving.model and kept.deployments == serving.deployments
    assert for_data_class(serving, "restricted", lambda node: allowed.get(node, ())).replicas == []
    assert for_data_class(serving, "public", lambda node: ("public",)) is serving


# ---- scores on the runtimes' reported load ----------------------------------------------------


class Loads:
    """What `Fleet.replica_load` answers: (load, age_s) per replica id, None where absent."""

    def __init__(self) -> None:
        self.reports: dict[str, tuple[RuntimeLoad, float]] = {}

    def set(self, replica_id: str, *, age_s: float = 1.0, **figures: object) -> None:
        self.reports[replica_id] = (RuntimeLoad(ok=True, age_s=0.0, **figures), age_s)  # type: ignore[arg-type]

    def __call__(self, node_id: str, replica_id: str) -> tuple[RuntimeLoad, float] | None:
        return self.reports.get(replica_id)


def weighted(serving: ServingSet, weights: RoutingWeights) -> ServingSet:
    return attrs.evolve(serving, replicas=[attrs.evolve(r, routing=weights) for r in serving.replicas])


def picks(router: Router, serving: ServingSet, n: int = 40, prefix: str | None = None) -> Counter[str]:
    return Counter(router.choose(serving, prefix=prefix).replica_id for _ in range(n))  # type: ignore[union-attr]


def test_a_replica_reporting_a_long_queue_loses() -> None:
    loads = Loads()
    router = Router(GatewayConfig(), load=loads)
    serving = replicas(2)
    loads.set("s0", queue_depth=50.0, running=4.0)
    loads.set("s1", queue_depth=0.0, running=4.0)
    assert picks(router, serving) == {"s1": 40}
    # Even the prefix's own replica yields: 50 queued is far past the affinity slack (8).
    assert {router.choose(serving, prefix=f"p{i}").replica_id for i in range(40)} == {"s1"}  # type: ignore[union-attr]
    # The gateway's own in-flight requests count too: s1 with 51 in flight loses to s0's 50 queued.
    for _ in range(51):
        router.acquire("s1")
    assert picks(router, serving, 5) == {"s0": 5}


def test_stale_failing_and_absent_reports_fall_back_to_in_flight_counts() -> None:
    loads = Loads()
    cfg = GatewayConfig(load_max_age_s=15.0)
    router = Router(cfg, load=loads)
    serving = replicas(2)
    loads.set("s0", queue_depth=50.0, age_s=15.5)  # older than load_max_age_s: ignored
    assert picks(router, serving, 10) == {"s0": 5, "s1": 5}
    terms = router.terms("s0", "n0", RoutingWeights())
    assert terms.report == "stale" and terms.queue_term == 0.0 and terms.queue_reported == 50.0
    loads.reports["s0"] = (RuntimeLoad(ok=False, age_s=0.0, error="503 from /metrics"), 1.0)
    assert picks(router, serving, 10) == {"s0": 5, "s1": 5}
    terms = router.terms("s0", "n0", RoutingWeights())
    assert terms.report == "failing" and terms.metrics_error == "503 from /metrics" and terms.score == 0.0
    del loads.reports["s0"]
    router.acquire("s1")
    assert picks(router, serving, 5) == {"s0": 5}
    assert router.terms("s0", "n0", RoutingWeights()).report == "none"
    loads.set("s0", queue_depth=50.0, age_s=14.0)  # fresh again: counted
    assert picks(router, serving, 5) == {"s1": 5}


def test_kv_cache_near_full_is_avoided() -> None:
    loads = Loads()
    router = Router(GatewayConfig(prefix_affinity=False), load=loads)
    serving = replicas(2)
    loads.set("s0", queue_depth=0.0, kv_cache_ratio=0.98)
    loads.set("s1", queue_depth=3.0, kv_cache_ratio=0.2)
    assert picks(router, serving, 10) == {"s1": 10}  # 49 (kv) against 3 + 0.25
    terms = router.terms("s0", "n0", RoutingWeights())
    assert terms.report == "fresh" and round(terms.kv_term) == 49 and terms.score == terms.kv_term
    loads.set("s0", queue_depth=0.0, kv_cache_ratio=1.0)
    assert router.terms("s0", "n0", RoutingWeights()).kv_term == 100.0  # capped, never infinite
    # A half-full cache weighs like one queued request: s0 wins against s1's 3 queued.
    loads.set("s0", queue_depth=0.0, kv_cache_ratio=0.5)
    assert picks(router, serving, 10) == {"s0": 10}


def test_weights_are_respected() -> None:
    loads = Loads()
    router = Router(GatewayConfig(prefix_affinity=False), load=loads)
    loads.set("s0", queue_depth=4.0, kv_cache_ratio=0.0)
    loads.set("s1", queue_depth=0.0, kv_cache_ratio=0.9)
    assert picks(router, replicas(2), 10) == {"s0": 10}  # 4 against 9
    assert picks(router, weighted(replicas(2), RoutingWeights(kv_cache=0.1)), 10) == {"s1": 10}  # 4 against 0.9
    assert picks(router, weighted(replicas(2), RoutingWeights(queue=3.0)), 10) == {"s1": 10}  # 12 against 9
    # Weight 0 on both load terms: every replica ties; they are taken in turn.
    assert picks(router, weighted(replicas(2), RoutingWeights(queue=0.0, kv_cache=0.0)), 10) == {"s0": 5, "s1": 5}


def test_the_prefix_weight_scales_the_affinity_bonus() -> None:
    loads = Loads()
    router = Router(GatewayConfig(affinity_slack=2), load=loads)
    serving = replicas(2)
    home = router.choose(serving, prefix="system")
    assert home is not None
    other = next(r.replica_id for r in serving.replicas if r != home)
    loads.set(home.replica_id, queue_depth=5.0)
    loads.set(other, queue_depth=0.0)
    assert router.choose(serving, prefix="system").replica_id == other  # type: ignore[union-attr]  # 5 - 2 > 0
    strong = weighted(serving, RoutingWeights(prefix=3.0))
    assert router.choose(strong, prefix="system").replica_id == home.replica_id  # type: ignore[union-attr]  # 5 - 6
    none = weighted(serving, RoutingWeights(prefix=0.0))
    loads.set(home.replica_id, queue_depth=0.0)
    router.acquire(home.replica_id)
    assert router.choose(none, prefix="system").replica_id == other  # type: ignore[union-attr]  # no bonus at all
    assert router.terms(other, "n", RoutingWeights(prefix=3.0)).affinity_bonus == 6.0


def test_routing_weights_out_of_bounds_are_named() -> None:
    assert routing_problems(RoutingWeights()) == []
    assert routing_problems(RoutingWeights(queue=0.0, kv_cache=100.0, prefix=0.5)) == []
    bad = RoutingWeights(queue=-1.0, kv_cache=float("nan"), prefix=101.0)
    assert routing_problems(bad, "routing.") == [
        "routing.queue: from 0 to 100",
        "routing.kv_cache: from 0 to 100",
        "routing.prefix: from 0 to 100",
    ]
