"""The fleet's series: GPUs, node memory and cache disk, heartbeat age and each replica's runtime load.

A prometheus_client custom collector. At each scrape it asks the controller for a snapshot
(`NodeFigures`, pure data made from the signed heartbeats) and turns it into metric families, so
a node that goes away (revoked, removed) leaves no stale series behind. It never imports
`nexa.control`. Label values are bounded: node ids, GPU indexes, GPU model names (cut to
`MODEL_LABEL_MAX`), deployment names and replica ids; nothing a client sent.
"""

from __future__ import annotations

import contextlib
import math
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Final, cast

import attrs
from prometheus_client.core import GaugeMetricFamily, HistogramMetricFamily, Metric, Sample
from prometheus_client.utils import floatToGoString

from nexa.contracts.node import Gpu, NodeInventory
from nexa.contracts.wire import CacheDisk, LatencyHistogram, MemoryPressure, ReplicaMemory, RuntimeLoad

#: The longest GPU model name kept as a label value (nvidia-smi names are far shorter).
MODEL_LABEL_MAX: Final = 64
#: The `gpu` label of a unified memory pool (GB10): reported once per node, not once per GPU.
UNIFIED_GPU: Final = "unified"

_GPU: Final = ("node", "gpu", "model")
_NODE: Final = ("node",)
_REPLICA: Final = ("deployment", "replica", "node")
#: How prometheus_client writes an `le` bound (its own histograms' way; the function is untyped).
_le: Final = cast("Callable[[float], str]", floatToGoString)


@attrs.frozen(kw_only=True)
class ReplicaFigures:
    """One replica's last load report, as its node relayed it."""

    deployment: str
    replica: str
    load: RuntimeLoad
    #: Seconds since the runtime's figures were read (at the scrape).
    age_s: float


@attrs.frozen(kw_only=True)
class ReplicaMemoryFigures:
    """What one replica was measured to hold, as its node reported it."""

    deployment: str
    replica: str
    memory: ReplicaMemory


@attrs.frozen(kw_only=True)
class NodeFigures:
    """What one node's heartbeats say, at the scrape. `inventory` None: no live figures (the node is
    unreachable, or has not sent its inventory): only the heartbeat age is exported."""

    node: str
    #: Seconds since its last good message; None when not heard from since the controller started.
    heartbeat_age_s: float | None
    inventory: NodeInventory | None = None
    cache_disk: CacheDisk | None = None
    replicas: tuple[ReplicaFigures, ...] = ()
    memory_pressure: MemoryPressure | None = None
    memory_pressure_stops: int = 0
    replica_memory: tuple[ReplicaMemoryFigures, ...] = ()


#: The gauges: (name, labels, help). A unified pool (GB10) is reported once per node, gpu="unified".
_GAUGES: Final = (
    ("nexa_gpu_utilization_ratio", _GPU, "GPU utilisation, 0..1, as nvidia-smi last reported it."),
    ("nexa_gpu_memory_used_bytes", _GPU, 'GPU memory in use; a unified pool once per node with gpu="unified".'),
    ("nexa_gpu_memory_total_bytes", _GPU, 'GPU memory; a unified pool (shared with the host) once, gpu="unified".'),
    ("nexa_gpu_temperature_celsius", _GPU, "GPU temperature."),
    ("nexa_gpu_power_watts", _GPU, "GPU power draw."),
    ("nexa_node_memory_total_bytes", _NODE, "The node's host memory."),
    ("nexa_node_memory_available_bytes", _NODE, "The node's host memory available (MemAvailable)."),
    ("nexa_node_artifact_cache_used_bytes", _NODE, "What the node's artifact cache holds."),
    ("nexa_node_artifact_cache_free_bytes", _NODE, "Room left on the artifact cache's filesystem."),
    (
        "nexa_node_heartbeat_age_seconds",
        _NODE,
        "Seconds since the node's last good message (nodes heard since the controller started, not revoked).",
    ),
    ("nexa_runtime_queue_depth", _REPLICA, "Requests the replica's runtime holds waiting."),
    ("nexa_runtime_running_requests", _REPLICA, "Requests the replica's runtime is working on."),
    ("nexa_runtime_kv_cache_usage_ratio", _REPLICA, "The runtime's KV-cache use, 0..1."),
    (
        "nexa_runtime_prefix_cache_hit_ratio",
        _REPLICA,
        "Share of prompt tokens the runtime served from its prefix cache, 0..1 (its lifetime).",
    ),
    (
        "nexa_runtime_metrics_up",
        _REPLICA,
        "1 when the node's last scrape of the runtime's metrics endpoint worked, 0 when it failed.",
    ),
    ("nexa_runtime_metrics_age_seconds", _REPLICA, "Seconds since the runtime's figures were read."),
    (
        "nexa_node_gpu_figures_stale",
        _NODE,
        "1 while the node's GPU figures are its last good ones (nvidia-smi stopped answering), else 0.",
    ),
    ("nexa_node_nvidia_smi_timeouts", _NODE, "Runs of nvidia-smi that hung and were killed since the agent started."),
    (
        "nexa_node_memory_pressure",
        _NODE,
        "1 while a unified-memory node's MemAvailable is under its [memory] pressure_floor_bytes, else 0.",
    ),
    ("nexa_node_memory_pressure_floor_bytes", _NODE, "The floor a node under memory pressure reported."),
    (
        "nexa_node_memory_pressure_stops",
        _NODE,
        "Replicas the node's memory-pressure guard stopped since the agent started.",
    ),
    (
        "nexa_runtime_memory_measured_bytes",
        _REPLICA,
        "The memory the node measured the replica to hold (cgroup, GPU processes, MemAvailable drop).",
    ),
)
_TTFT: Final = "nexa_runtime_time_to_first_token_seconds"
_TPOT: Final = "nexa_runtime_time_per_output_token_seconds"
_HISTOGRAM_HELP: Final = "The runtime's own {} histogram (its buckets, counted since it started)."

#: Every family this collector exports (what `describe` yields, without samples).
NAMES: Final = (*(name for name, _, _ in _GAUGES), _TTFT, _TPOT)

_Labels = dict[str, str]
_Add = Callable[[str, _Labels, float | None], None]
_BucketLabels = dict[tuple[str, str, str, str], tuple[tuple[float, ...], list[_Labels]]]


class _Scrape:
    """The families of one scrape. Samples are appended as prometheus_client's `add_metric` would
    make them, but with one label dict shared by a node's (or a replica's) series: at a thousand
    nodes that is most of the scrape's cost."""

    def __init__(self, bucket_labels: _BucketLabels | None = None) -> None:
        self.gauges = {name: GaugeMetricFamily(name, doc, labels=labels) for name, labels, doc in _GAUGES}
        self.ttft = HistogramMetricFamily(_TTFT, _HISTOGRAM_HELP.format("time-to-first-token"), labels=_REPLICA)
        self.tpot = HistogramMetricFamily(_TPOT, _HISTOGRAM_HELP.format("time-per-output-token"), labels=_REPLICA)
        #: Bucket label dicts by (family, deployment, replica, node), for the next scrape to reuse.
        self.bucket_labels: _BucketLabels = {}
        self._before: _BucketLabels = bucket_labels or {}

    def families(self) -> list[Metric]:
        return [*self.gauges.values(), self.ttft, self.tpot]

    def add(self, name: str, labels: _Labels, value: float | None) -> None:
        # Unknown figures are left out, never exported as 0; the contracts already refuse
        # non-finite ones, and a snapshot made otherwise must not break the exposition either.
        if value is not None and math.isfinite(value):
            self.gauges[name].samples.append(Sample(name, labels, value))

    def histogram(self, family: HistogramMetricFamily, labels: _Labels, hist: LatencyHistogram | None) -> None:
        """The runtime's cumulative buckets as they came (validated: increasing, finite), then +Inf."""
        if hist is None:
            return
        key = (family.name, labels["deployment"], labels["replica"], labels["node"])
        got = self._before.get(key)
        if got is None or got[0] != hist.bounds:
            # A replica's buckets rarely change: their label dicts are made once, not per scrape.
            got = (hist.bounds, [{**labels, "le": _le(b)} for b in hist.bounds] + [{**labels, "le": "+Inf"}])
        self.bucket_labels[key] = got
        out, bucket, le = family.samples, family.name + "_bucket", got[1]
        out.extend(Sample(bucket, at, count) for at, count in zip(le[:-1], hist.counts, strict=False))
        out.append(Sample(bucket, le[-1], hist.count))
        out.append(Sample(family.name + "_count", labels, hist.count))
        out.append(Sample(family.name + "_sum", labels, hist.sum))


class FleetCollector:
    """Exports `figures()` at each scrape, or the snapshot `pinned` gives the scraping thread.
    `figures` must not block; it reads the controller's state, so it runs on the event loop."""

    def __init__(self, figures: Callable[[], Iterable[NodeFigures]]) -> None:
        self._figures = figures
        self._bucket_labels: _BucketLabels = {}
        self._pinned = threading.local()

    @contextlib.contextmanager
    def pinned(self, figures: Sequence[NodeFigures]) -> Iterator[None]:
        """Within it, scrapes on this thread export `figures` instead of asking for them: a snapshot
        taken on the event loop, so the text (the long part with a large fleet) is written on a
        worker thread while the loop goes on serving."""
        self._pinned.figures = figures
        try:
            yield
        finally:
            del self._pinned.figures

    def describe(self) -> Iterator[Metric]:
        yield from _Scrape().families()

    def collect(self) -> Iterator[Metric]:
        scrape = _Scrape(self._bucket_labels)
        add = scrape.add
        pinned: Sequence[NodeFigures] | None = getattr(self._pinned, "figures", None)
        for figures in self._figures() if pinned is None else pinned:
            node = {"node": figures.node}
            add("nexa_node_heartbeat_age_seconds", node, figures.heartbeat_age_s)
            inv = figures.inventory
            if inv is None:
                continue
            add("nexa_node_memory_total_bytes", node, inv.memory_total_bytes)
            add("nexa_node_memory_available_bytes", node, inv.memory_available_bytes)
            if (disk := figures.cache_disk) is not None:
                add("nexa_node_artifact_cache_used_bytes", node, disk.used_bytes)
                add("nexa_node_artifact_cache_free_bytes", node, disk.free_bytes)
            _gpus(add, figures.node, inv.gpus)
            add("nexa_node_gpu_figures_stale", node, 1.0 if inv.gpus_stale else 0.0)
            add("nexa_node_nvidia_smi_timeouts", node, inv.nvidia_smi_timeouts)
            pressure = figures.memory_pressure
            add("nexa_node_memory_pressure", node, 0.0 if pressure is None else 1.0)
            add("nexa_node_memory_pressure_floor_bytes", node, None if pressure is None else pressure.floor_bytes)
            add("nexa_node_memory_pressure_stops", node, figures.memory_pressure_stops)
            for measured in figures.replica_memory:
                labels = {"deployment": measured.deployment, "replica": measured.replica, "node": figures.node}
                add("nexa_runtime_memory_measured_bytes", labels, measured.memory.measured_bytes)
            for replica in figures.replicas:
                labels = {"deployment": replica.deployment, "replica": replica.replica, "node": figures.node}
                load = replica.load
                add("nexa_runtime_metrics_up", labels, 1.0 if load.ok else 0.0)
                add("nexa_runtime_metrics_age_seconds", labels, replica.age_s)
                if not load.ok:
                    continue  # a failed scrape sends no figures
                add("nexa_runtime_queue_depth", labels, load.queue_depth)
                add("nexa_runtime_running_requests", labels, load.running)
                add("nexa_runtime_kv_cache_usage_ratio", labels, load.kv_cache_ratio)
                add("nexa_runtime_prefix_cache_hit_ratio", labels, load.prefix_cache_hit_ratio)
                scrape.histogram(scrape.ttft, labels, load.ttft)
                scrape.histogram(scrape.tpot, labels, load.tpot)
        self._bucket_labels = scrape.bucket_labels  # the replicas of this scrape only: no leak
        yield from scrape.families()


def _gpus(add: _Add, node: str, gpus: Iterable[Gpu]) -> None:
    seen: set[int] = set()
    pool_done = False
    for gpu in gpus:
        if gpu.index in seen:
            continue  # a node that repeats an index: its first report only (one series per label set)
        seen.add(gpu.index)
        model = gpu.name[:MODEL_LABEL_MAX]
        labels = {"node": node, "gpu": str(gpu.index), "model": model}
        add("nexa_gpu_utilization_ratio", labels, None if gpu.utilization_pct is None else gpu.utilization_pct / 100)
        add("nexa_gpu_temperature_celsius", labels, gpu.temperature_c)
        add("nexa_gpu_power_watts", labels, gpu.power_draw_w)
        if gpu.unified_memory:
            if pool_done:
                continue  # the GPUs of a unified pool share it: reported once
            pool_done = True
            labels = {"node": node, "gpu": UNIFIED_GPU, "model": model}
        add("nexa_gpu_memory_total_bytes", labels, gpu.memory_total_bytes)
        add("nexa_gpu_memory_used_bytes", labels, _used(gpu))


def _used(gpu: Gpu) -> int | None:
    """Memory in use; where the driver does not say (a unified pool), the total less what is free."""
    if gpu.memory_used_bytes is not None:
        return gpu.memory_used_bytes
    if gpu.memory_total_bytes is None or gpu.memory_free_bytes is None:
        return None
    return max(0, gpu.memory_total_bytes - gpu.memory_free_bytes)
