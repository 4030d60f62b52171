"""Per-request replica choice: canary share, least outstanding work, prefix affinity.

Pure and fast: no I/O, no awaits. The gateway calls `acquire`/`release` around each attempt, so
`outstanding` counts requests in flight per replica.

0. A request with a data class is routed only to replicas on nodes whose inventory allows it
   (`for_data_class`, before the steps below; `data_classes` in the node's inventory.json).

1. Candidates are the serving set's replicas minus those already tried (`exclude`).
2. While both canary and stable candidates exist, the canary group gets `canary_weight` of the
   requests, deterministically: per serving set a counter keeps the canary's share at
   floor(weight * n) over n requests (weight 0.1 gives exactly 10 of 100), restarting when the weight changes.
3. Within the group: least outstanding, ties taken in turn. With prefix affinity on and a prefix
   given, the replica that rendezvous hashing picks for the prefix keeps it unless it has more
   than `affinity_slack` requests beyond the least loaded one.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Collection, Sequence
from typing import Final

import attrs

from nexa.config import GatewayConfig
from nexa.contracts.deployments import ServingReplica, ServingSet

#: Slack for float rounding in the canary share (weights are like 0.1, which has no exact binary form).
_EPS: Final = 1e-9


@attrs.define
class _Split:
    """Canary bookkeeping of one serving set since its weight last changed."""

    weight: float
    total: int = 0
    canary: int = 0


class Router:
    """Chooses replicas; keeps outstanding counts, canary splits and tie rotations in memory."""

    def __init__(self, cfg: GatewayConfig) -> None:
        self._cfg = cfg
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
        return self._least_loaded(key, group, prefix)

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

    def _least_loaded(
        self, key: tuple[str, ...], group: Sequence[ServingReplica], prefix: str | None
    ) -> ServingReplica:
        loads = [self._outstanding.get(r.replica_id, 0) for r in group]
        least = min(loads)
        if self._cfg.prefix_affinity and prefix is not None:
            affine = max(range(len(group)), key=lambda i: _rendezvous(prefix, group[i].replica_id))
            if loads[affine] <= least + self._cfg.affinity_slack:
                return group[affine]
        ties = sorted((r for r, load in zip(group, loads, strict=True) if load == least), key=lambda r: r.replica_id)
        turn = self._turns.get(key, 0)
        self._turns[key] = turn + 1
        return ties[turn % len(ties)]

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


def _rendezvous(prefix: str, replica_id: str) -> bytes:
    """Highest-random-weight score: every router agrees, and losing a replica moves only its prefixes."""
    return hashlib.blake2b(f"{replica_id}\x00{prefix}".encode(), digest_size=8).digest()
