"""What replicas were measured to hold, kept per (runtime, model, settings) and used by placement.

Nodes report each replica's measured memory in their heartbeats (`wire.ReplicaMemory`). The
largest figure seen for a replica's (runtime name, model version, runtime settings) is kept in the
store; placement then reserves, for every replica of that triple, the larger of what was declared
(memory plus the engine's overhead) and what was measured (`assignment.reservation_bytes`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
from collections.abc import Mapping
from typing import Final

from nexa.contracts.deployments import Deployment
from nexa.contracts.models import ModelRef
from nexa.control import store as st
from nexa.control.deployments.records import all_replicas, model_of
from nexa.errors import StoreError

log = logging.getLogger(__name__)

#: A figure is written again only when it grows by more than this share (measurements wander).
GROWTH: Final = 0.05


def memory_key(runtime: str, model: ModelRef, settings: Mapping[str, object]) -> str:
    """The key of a (runtime, model version, settings) triple: a sha256 of their canonical JSON."""
    return _key(runtime, model.model, model.version, json.dumps(dict(settings), sort_keys=True, separators=(",", ":")))


@functools.lru_cache(maxsize=4096)
def _key(runtime: str, model: str, version: str, settings: str) -> str:
    # Placement asks once per assigned replica per decision: the hash is made once per triple.
    text = json.dumps([runtime, model, version], separators=(",", ":")) + settings
    return hashlib.sha256(text.encode()).hexdigest()


class MeasuredMemory:
    """The largest measured figure per triple, in memory and in the store."""

    def __init__(self, store: st.Store) -> None:
        self._store = store
        self._by_key: dict[str, int] = {}

    async def load(self) -> None:
        self._by_key = await self._store.run(st.load_measured_memory)

    def get(self, runtime: str, model: ModelRef, settings: Mapping[str, object]) -> int | None:
        return self._by_key.get(memory_key(runtime, model, settings))

    def of(self, dep: Deployment, model: ModelRef | None = None) -> int | None:
        """What a replica of `dep` (of `model`, else the deployment's) was measured to hold, if ever."""
        return self.get(dep.runtime, model or dep.model, dep.options.settings)

    async def observe(self, dep: Deployment, replica_id: str, measured_bytes: int) -> None:
        """A node reported `measured_bytes` for one of `dep`'s replicas: keep it when it is the largest."""
        replica = next((r for r in all_replicas(dep) if r.id == replica_id), None)
        if replica is None:
            return
        key = memory_key(dep.runtime, model_of(dep, replica), dep.options.settings)
        known = self._by_key.get(key)
        if known is not None and measured_bytes <= known * (1 + GROWTH):
            return
        self._by_key[key] = measured_bytes
        log.info("deployment %s: replica %s measured at %d bytes", dep.name, replica_id, measured_bytes)
        try:
            await self._store.run(st.save_measured_memory, key, measured_bytes)
        except StoreError as exc:
            # Kept in memory (placement uses it now); written again when a larger figure comes.
            log.warning("could not keep the measured memory of deployment %s: %s", dep.name, exc)
