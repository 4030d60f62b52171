"""Per-request replica choice: canary share, then the lowest load score, with prefix affinity.

Pure and fast: no I/O, no awaits. The gateway calls `acquire`/`release` around each attempt, so
`outstanding` counts requests in flight per replica; the runtimes' own load comes from the `load`
lookup the composition root passes (`Fleet.replica_load`: what each node last sent in its
heartbeat, and how old it is).

0. A request with a data class is routed only to replicas on nodes that may process it
   (`for_data_class`, before the steps below; the node's inventory.json `data_classes` that the
   admin granted, `control.fleet.grants`).

1. Candidates are the serving set's replicas minus those already tried (`exclude`).
2. While both canary and stable candidates exist, the canary group gets `canary_weight` of the
   requests, deterministically: per serving set a counter keeps the canary's share at
   floor(weight * n) over n requests (weight 0.1 gives exactly 10 of 100), restarting when the weight changes.
3. Within the group each replica gets a score, lower is better, with its deployment's weights
   (`RoutingWeights`, default 1 each):
   `queue * (queue_depth + outstanding) + kv_cache * kv/(1 - kv)` where `queue_depth` and `kv` are
   the runtime's reported waiting requests and KV-cache use (the KV term grows sharply near full:
   0.5 → 1, 0.9 → 9, at most 100). `running` is not added: those requests are the gateway's own
   in flight, already in `outstanding`, and they do not delay a new one the way waiting ones do.
   A report older than `gateway.load_max_age_s`, a failing one (`ok` false) or none at all counts
   as queue 0 and KV 0: the replica is then scored on its in-flight count only.
4. The lowest score wins, ties taken in turn. With prefix affinity on and a prefix given, the
   replica that rendezvous hashing picks for the prefix keeps it while its score, less
   `prefix * affinity_slack`, is still no higher than the lowest (with default weights and no
   reports: while it has at most `affinity_slack` requests beyond the least loaded one).

`terms` explains one replica's score the same way, for the deployment views.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Sequence
from typing import Final

import attrs

from nexa.config import GatewayConfig
from nexa.contracts.deployments import ReplicaScore, RoutingWeights, ServingReplica, ServingSet
from nexa.contracts.wire import RuntimeLoad

#: Slack for float rounding in the canary share (weights are like 0.1, which has no exact binary form).
_EPS: Final = 1e-9
#: Keeps the KV-cache term finite: kv/(1 - kv) with 1 - kv at least 0.01 (99 at 99 % use, 100 when full).
_KV_FLOOR: Final = 0.01

#: (node id, replica id) → the runtime's last load report and its age in seconds, or None.
LoadLookup = Callable[[str, str], tuple[RuntimeLoad, float] | None]


def _no_load(node_id: str, replica_id: str) -> None:
    return None


@attrs.define
class _Split:
    """Canary bookkeeping of one serving set since its weight last changed."""

    weight: float
    total: int = 0
    canary: int = 0


class Router:
    """Chooses replicas; keeps outstanding counts, canary splits and tie rotations in memory."""

    def __init__(self, cfg: GatewayConfig, *, load: LoadLookup = _no_load) -> None:
        self._cfg = cfg
        self._load = load
        self._outstanding: dict[str, int] = {}
        self._splits: dict[tuple[str, ...], _Split] = {}
        self._turns: dict[tuple[str, ...], int] = {}

    def choose(
        self, serving: ServingSet, *, prefix: str | None, exclude: Collection[str] = ()
    ) -> ServingReplica | None:
        """The replica for the next attempt, or None when every replica was tried already."""
        candidates = [r for r in serving.replicas if r.replica_id not in exclude]
        if not candidates:
            return None
        key = _set_key(serving)
        canaries = [r for r in candidates if r.canary]
        stable = [r for r in candidates if not r.canary]
        if canaries and stable:
            group = canaries if self._canary_turn(key, serving.canary_weight) else stable
        else:
            group = candidates
        return self._best(key, group, prefix)

    def _canary_turn(self, key: tuple[str, ...], weight: float) -> bool:
        weight = min(1.0, max(0.0, weight))
        split = self._splits.get(key)
        if split is None or split.weight != weight:
            split = self._splits[key] = _Split(weight=weight)
        split.total += 1
        # Keep canary == floor(weight * total): a smooth, deterministic share.
        if split.canary + 1 <= weight * split.total + _EPS:
            split.canary += 1
            return True
        return False

    def _best(self, key: tuple[str, ...], group: Sequence[ServingReplica], prefix: str | None) -> ServingReplica:
        scores = [self._score(r) for r in group]
        least = min(scores)
        if self._cfg.prefix_affinity and prefix is not None:
            affine = max(range(len(group)), key=lambda i: _rendezvous(prefix, group[i].replica_id))
            if scores[affine] - group[affine].routing.prefix * self._cfg.affinity_slack <= least:
                return group[affine]
        ties = sorted((r for r, score in zip(group, scores, strict=True) if score == least), key=lambda r: r.replica_id)
        turn = self._turns.get(key, 0)
        self._turns[key] = turn + 1
        return ties[turn % len(ties)]

    def _score(self, r: ServingReplica) -> float:
        w = r.routing
        queue = self._outstanding.get(r.replica_id, 0)
        load = self._fresh(self._load(r.node_id, r.replica_id))
        if load is None:
            return w.queue * queue
        return w.queue * (queue + (load.queue_depth or 0.0)) + w.kv_cache * _kv_term(load.kv_cache_ratio)

    def _fresh(self, got: tuple[RuntimeLoad, float] | None) -> RuntimeLoad | None:
        """The report when it counts: sent, scraped fine, and not older than `load_max_age_s`."""
        if got is None or not got[0].ok or got[1] > self._cfg.load_max_age_s:
            return None
        return got[0]

    def terms(self, replica_id: str, node_id: str, weights: RoutingWeights, *, canary: bool = False) -> ReplicaScore:
        """One replica's score terms now, as `choose` weighs them (for the deployment views)."""
        in_flight = self._outstanding.get(replica_id, 0)
        got = self._load(node_id, replica_id)
        load = self._fresh(got)
        queued = (load.queue_depth or 0.0) if load is not None else 0.0
        queue_term = weights.queue * (in_flight + queued)
        kv_term = weights.kv_cache * _kv_term(load.kv_cache_ratio) if load is not None else 0.0
        reported, age = got if got is not None else (RuntimeLoad(ok=True, age_s=0.0), None)
        if got is None:
            report = "none"
        elif not reported.ok:
            report = "failing"
        else:
            report = "fresh" if load is not None else "stale"
        return ReplicaScore(
            replica_id=replica_id,
            node_id=node_id,
            canary=canary,
            report=report,
            report_age_s=age,
            metrics_error=(reported.error or "no reason given") if report == "failing" else None,
            queue_reported=reported.queue_depth,
            running_reported=reported.running,
            kv_cache_ratio=reported.kv_cache_ratio,
            in_flight=in_flight,
            queue_term=queue_term,
            kv_term=kv_term,
            affinity_bonus=weights.prefix * self._cfg.affinity_slack if self._cfg.prefix_affinity else 0.0,
            score=queue_term + kv_term,
        )

    def acquire(self, replica_id: str) -> None:
        self._outstanding[replica_id] = self._outstanding.get(replica_id, 0) + 1

    def release(self, replica_id: str) -> None:
        left = self._outstanding.get(replica_id, 0) - 1
        if left > 0:
            self._outstanding[replica_id] = left
        else:
            self._outstanding.pop(replica_id, None)

    def outstanding(self, replica_id: str) -> int:
        return self._outstanding.get(replica_id, 0)


def for_data_class(
    serving: ServingSet, data_class: str, node_data_classes: Callable[[str], Collection[str]]
) -> ServingSet:
    """The serving set less the replicas whose node may not process `data_class`."""
    allowed = [r for r in serving.replicas if data_class in node_data_classes(r.node_id)]
    if len(allowed) == len(serving.replicas):
        return serving
    return attrs.evolve(serving, replicas=allowed)


def _set_key(serving: ServingSet) -> tuple[str, ...]:
    """What identifies a serving set across calls: the model it serves and its deployments."""
    return (serving.model.model, serving.model.version, *serving.deployments)


def _kv_term(ratio: float | None) -> float:
    """KV-cache pressure in queued requests' worth: kv/(1 - kv), 0 without a figure, at most 100."""
    if ratio is None:
        return 0.0
    return ratio / max(1.0 - ratio, _KV_FLOOR)


def _rendezvous(prefix: str, replica_id: str) -> bytes:
    """Highest-random-weight score: every router agrees, and losing a replica moves only its prefixes."""
    return hashlib.blake2b(f"{replica_id}\x00{prefix}".encode(), digest_size=8).digest()
