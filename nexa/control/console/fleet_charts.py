"""The fleet charts of the overview and nodes pages: each GPU's utilisation, memory, temperature and
power, and each replica's runtime queue and KV-cache use, as the nodes last reported them.

Read from the Fleet (`NodeLive.inventory` from the signed heartbeats, `NodeLive.loads` for the
runtimes), never from the Prometheus collectors; one sample a second from the controller's start,
ten minutes kept. Series are keyed by node id, GPU index, deployment and replica id only.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable
from typing import Final

import attrs
import trio

from nexa.contracts.domain import NodeState
from nexa.contracts.node import Gpu
from nexa.control.console.charts import SAMPLES_KEPT, sample_each_second
from nexa.control.fleet.nodes import Fleet, NodeLive

#: The charts, in the order the pages show them, and the unit of their figures.
FLEET_CHARTS: Final = {
    "gpu_utilization": "%",
    "gpu_memory": "GiB",
    "gpu_temperature": "°C",
    "gpu_power": "W",
    "runtime_queue": "requests",
    "runtime_kv": "%",
}
#: Series one chart keeps at most (the first ones seen): a large fleet cannot grow a page unbounded.
MAX_SERIES: Final = 64
#: The GPU key of a unified memory pool (GB10): charted once per node, as in `/metrics`.
UNIFIED: Final = "unified"

#: (chart, node id, series label) → value
_Figures = dict[tuple[str, str, str], float]


@attrs.frozen
class _Sample:
    at: float  # trio clock
    figures: _Figures


class FleetCharts:
    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet
        self._samples: deque[_Sample] = deque(maxlen=SAMPLES_KEPT)

    async def sample_forever(self) -> None:
        """Sample once a second for as long as the controller serves."""
        await sample_each_second(self.sample)

    def sample(self, now: float) -> None:
        """Take a sample if a second has passed since the last one (the sampler, and the series view)."""
        if self._samples and now - self._samples[-1].at < 1.0:
            return
        figures: _Figures = {}
        for live in self._fleet:
            if not live.loads and (live.inventory is None or not live.inventory.gpus):
                continue  # nothing to chart (checked first: most of a large CPU fleet, every second)
            if live.state is not NodeState.UNREACHABLE and live.state is not NodeState.REVOKED:
                _node_figures(live, figures)
        self._samples.append(_Sample(now, figures))

    def series(self, node: str | None = None) -> dict[str, object]:
        """uPlot's columns: `t` (unix seconds) and per chart its unit, series labels and values
        (None where a series had no figure); `node` keeps that node's series only."""
        self.sample(trio.current_time())
        samples = list(self._samples)
        wall = time.time() - trio.current_time()
        keys: dict[str, dict[tuple[str, str], None]] = {chart: {} for chart in FLEET_CHARTS}
        for s in samples:
            for chart, of_node, label in s.figures:
                seen = keys[chart]
                if (node is None or of_node == node) and len(seen) < MAX_SERIES:
                    seen.setdefault((of_node, label), None)
        charts: dict[str, object] = {}
        for chart, unit in FLEET_CHARTS.items():
            order = list(keys[chart])
            charts[chart] = {
                "unit": unit,
                "labels": [f"{n} {label}" for n, label in order],
                "values": [[s.figures.get((chart, n, label)) for s in samples] for n, label in order],
            }
        return {"t": [round(s.at + wall, 3) for s in samples], "charts": charts}


def _node_figures(live: NodeLive, out: _Figures) -> None:
    node = live.node.id
    if live.inventory is not None:
        _gpu_figures(node, live.inventory.gpus, out)
    deployments = {a.id: a.deployment for a in live.desired.assignments}
    for replica, (load, _read_at) in live.loads.items():
        if not load.ok or replica not in deployments:
            continue  # a failed scrape carries no figures; a replica no longer assigned is gone
        label = f"{deployments[replica]}/{replica}"
        if load.queue_depth is not None:
            out["runtime_queue", node, label] = load.queue_depth
        if load.kv_cache_ratio is not None:
            out["runtime_kv", node, label] = round(100 * load.kv_cache_ratio, 2)


def _gpu_figures(node: str, gpus: Iterable[Gpu], out: _Figures) -> None:
    pool_done = False
    for gpu in gpus:
        label = f"gpu {gpu.index}"
        if gpu.utilization_pct is not None:
            out["gpu_utilization", node, label] = gpu.utilization_pct
        if gpu.temperature_c is not None:
            out["gpu_temperature", node, label] = gpu.temperature_c
        if gpu.power_draw_w is not None:
            out["gpu_power", node, label] = gpu.power_draw_w
        if gpu.unified_memory:
            if pool_done:
                continue  # the GPUs of one unified pool share it
            pool_done, label = True, UNIFIED
        used = gpu.memory_used_bytes
        if used is None and gpu.memory_total_bytes is not None and gpu.memory_free_bytes is not None:
            used = max(0, gpu.memory_total_bytes - gpu.memory_free_bytes)  # a pool: what is not free
        if used is not None:
            out["gpu_memory", node, label] = round(used / 2**30, 3)
