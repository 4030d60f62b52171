"""The runtimes' own load figures, for the heartbeat: each Ready replica's metrics endpoint read on
an interval, and the artifact cache's disk. Never decides readiness, never fails a replica.

`RuntimeMetrics` stands between the agent and the supervisor (the agent's `Runtimes`): `update`
passes the assignment set on and remembers which adapter each replica runs (the node knows only
the signed spec, so `adapters.metrics_for` tells it from the kind and the command); `statuses`
adds to each Ready replica the last `RuntimeLoad` read from it, aged to the heartbeat. `run`
scrapes every `interval_s` (0: no scrape) on the replica's loopback port, the address the relay
uses; a failed read (no answer in time, a status other than 200, text that is not the format)
is a load with `ok` False and a short reason, and the next read tries again.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Final, NoReturn, Protocol

import attrs
import trio

from nexa.adapters import metrics_for
from nexa.adapters.base import Metrics
from nexa.contracts import wire
from nexa.errors import MetricsUnreadable
from nexa.node.artifacts import ArtifactStatistics
from nexa.node.http1 import RuntimeClient, RuntimeHTTPError
from nexa.telemetry.runtime_text import MAX_METRICS_BYTES, parse_runtime_metrics

log = logging.getLogger(__name__)

#: Longest wait for one replica's whole metrics answer (vLLM's is about 100 KiB).
SCRAPE_TIMEOUT_S: Final = 5.0
#: Connecting to a runtime on loopback.
CONNECT_TIMEOUT_S: Final = 2.0
#: With the scrape off, the cache's disk is still measured this often.
DISK_INTERVAL_S: Final = 10.0


class Replicas(Protocol):
    """What this needs of the supervisor: the agent's `Runtimes`, and each Ready replica's port."""

    def update(self, generation: int, assignments: Sequence[wire.Assignment]) -> None: ...

    def statuses(self) -> list[wire.AssignmentStatus]: ...

    def endpoint(self, assignment_id: str) -> int | None: ...


class Cache(Protocol):
    """The artifact cache: its directory, and the bytes of verified files it holds (kept in memory)."""

    @property
    def directory(self) -> Path: ...

    def statistics(self) -> ArtifactStatistics: ...


@attrs.frozen(kw_only=True)
class RuntimeMetricsStatistics:
    scrapes: int
    failures: int
    replicas: int


class RuntimeMetrics:
    """The supervisor as the agent sees it, with each Ready replica's load; `run` keeps it fresh."""

    def __init__(
        self,
        replicas: Replicas,
        cache: Cache,
        interval_s: float,
        *,
        host: str,
    ) -> None:
        self._replicas = replicas
        self._cache = cache
        self._interval_s = interval_s
        self._host = host
        self._specs: dict[str, Metrics] = {}
        #: assignment id → (its last load, the trio time it was read).
        self._loads: dict[str, tuple[wire.RuntimeLoad, float]] = {}
        self._disk: tuple[int, int] | None = None
        self._scrapes = self._failures = 0

    # --- what the agent calls

    def update(self, generation: int, assignments: Sequence[wire.Assignment]) -> None:
        self._specs = {a.id: metrics_for(a.runtime.kind, a.runtime.process) for a in assignments}
        self._replicas.update(generation, assignments)

    def statuses(self) -> list[wire.AssignmentStatus]:
        """The supervisor's statuses, each Ready one with its runtime's last load (aged to now)."""
        now = trio.current_time()
        out = []
        for status in self._replicas.statuses():
            got = self._loads.get(status.assignment_id)
            if got is not None and status.state is wire.RuntimeState.READY:
                load, read_at = got
                out.append(attrs.evolve(status, load=attrs.evolve(load, age_s=max(0.0, now - read_at))))
            else:
                out.append(status)
        return out

    def cache_disk(self) -> wire.CacheDisk | None:
        """The artifact cache: the bytes it holds, its filesystem's free and total (last measured)."""
        if self._disk is None:
            return None
        free, total = self._disk
        used = max(0, self._cache.statistics().cache_bytes)
        return wire.CacheDisk(used_bytes=used, free_bytes=free, total_bytes=total)

    def statistics(self) -> RuntimeMetricsStatistics:
        return RuntimeMetricsStatistics(scrapes=self._scrapes, failures=self._failures, replicas=len(self._loads))

    # --- the loop

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> NoReturn:
        client = RuntimeClient(connect_timeout_s=CONNECT_TIMEOUT_S, max_idle=1)
        task_status.started()
        try:
            while True:
                started = trio.current_time()
                self._disk = await trio.to_thread.run_sync(_disk, self._cache.directory)
                if self._interval_s > 0:
                    await self._scrape_all(client)
                else:
                    self._loads.clear()
                await trio.sleep_until(started + (self._interval_s or DISK_INTERVAL_S))
        finally:
            await client.aclose()  # each connection's close is shielded (and bounded) in http1

    async def _scrape_all(self, client: RuntimeClient) -> None:
        ready = {}
        for aid, spec in self._specs.items():
            port = self._replicas.endpoint(aid)
            if port is not None and spec.path is not None:
                ready[aid] = (port, spec)
        for gone in self._loads.keys() - ready.keys():
            del self._loads[gone]
        async with trio.open_nursery() as nursery:
            for aid, (port, spec) in ready.items():
                nursery.start_soon(self._scrape, client, aid, port, spec)

    async def _scrape(self, client: RuntimeClient, aid: str, port: int, spec: Metrics) -> None:
        assert spec.path is not None
        self._scrapes += 1
        try:
            load = await self._read(client, port, spec.path, spec)
        except (RuntimeHTTPError, MetricsUnreadable) as exc:
            self._failures += 1
            previous = self._loads.get(aid)
            if previous is None or previous[0].ok:
                log.info("replica %s: its metrics could not be read: %s", aid, exc)
            load = wire.RuntimeLoad(ok=False, age_s=0.0, error=str(exc)[: wire.METRICS_ERROR_MAX])
        if self._replicas.endpoint(aid) == port:  # still the same Ready replica
            self._loads[aid] = (load, trio.current_time())

    async def _read(self, client: RuntimeClient, port: int, path: str, spec: Metrics) -> wire.RuntimeLoad:
        status, body = await client.get(self._host, port, path, timeout_s=SCRAPE_TIMEOUT_S, max_bytes=MAX_METRICS_BYTES)
        if status != 200:
            raise RuntimeHTTPError(f"the metrics endpoint answered HTTP {status}")
        return await trio.to_thread.run_sync(parse_runtime_metrics, body, spec)


def _disk(directory: Path) -> tuple[int, int] | None:
    """(free, total) bytes of the filesystem holding `directory`; None when it cannot be read."""
    try:
        st = os.statvfs(directory)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize
