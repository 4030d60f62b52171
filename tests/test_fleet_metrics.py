"""The fleet collector (`nexa.telemetry.fleet`): GPU, node and runtime series from heartbeat figures.

Pure: snapshots made by hand from the recorded nvidia-smi fixtures, rendered through `Metrics` the
way `/metrics` renders them, read back with prometheus_client's parser and checked by promtool.
"""

from __future__ import annotations

import subprocess
import threading
import time

import attrs
from prometheus_client.parser import text_string_to_metric_families

from nexa.contracts.node import DiscoveredHost, InventoryFile, NodeInventory
from nexa.contracts.wire import CacheDisk, LatencyHistogram, RuntimeLoad
from nexa.node.inventory import merge, parse_nvidia_smi_csv
from nexa.telemetry import Metrics
from nexa.telemetry.fleet import NAMES, FleetCollector, NodeFigures, ReplicaFigures
from tests.conftest import FIXTURES, gb10_inventory, require_tool

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]
#: The recorded GB10's pool (MemTotal) and what was available (MemAvailable), bytes.
GB10 = gb10_inventory("spark-1")


def _l40s_x2() -> NodeInventory:
    gpus = parse_nvidia_smi_csv((FIXTURES / "nvidia-smi" / "l40s_48g_x2.csv").read_text())
    host = DiscoveredHost(
        hostname="l40s",
        arch="amd64",
        cpu_count=64,
        memory_total_bytes=512 << 30,
        memory_available_bytes=400 << 30,
        gpus=tuple(gpus),
        discovered_at=time.time(),
    )
    return merge(host, InventoryFile())


def _render(*nodes: NodeFigures) -> str:
    metrics = Metrics()
    metrics.export_fleet(lambda: nodes)
    return metrics.render().decode()


def _samples(text: str, prefix: str = "nexa_") -> Samples:
    out: Samples = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name.startswith(prefix):
                out[s.name, tuple(sorted(s.labels.items()))] = s.value
    return out


def _of(samples: Samples, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {labels: value for (n, labels), value in samples.items() if n == name}


def _gpu(node: str, gpu: str, model: str) -> tuple[tuple[str, str], ...]:
    return (("gpu", gpu), ("model", model), ("node", node))


def test_a_gb10_reports_its_unified_pool_once_and_its_gpu_by_index() -> None:
    got = _samples(_render(NodeFigures(node="spark-1", heartbeat_age_s=1.5, inventory=GB10)))
    [gpu] = GB10.gpus
    assert gpu.unified_memory
    assert gpu.memory_total_bytes is not None
    assert gpu.memory_free_bytes is not None
    pool = _gpu("spark-1", "unified", "NVIDIA GB10")
    assert _of(got, "nexa_gpu_memory_total_bytes") == {pool: gpu.memory_total_bytes}
    assert _of(got, "nexa_gpu_memory_used_bytes") == {pool: gpu.memory_total_bytes - gpu.memory_free_bytes}
    by_index = _gpu("spark-1", "0", "NVIDIA GB10")
    assert _of(got, "nexa_gpu_temperature_celsius") == {by_index: 41.0}
    assert _of(got, "nexa_gpu_power_watts") == {by_index: 4.71}
    assert _of(got, "nexa_gpu_utilization_ratio") == {by_index: 0.0}
    node = (("node", "spark-1"),)
    assert _of(got, "nexa_node_memory_total_bytes") == {node: GB10.memory_total_bytes}
    assert _of(got, "nexa_node_memory_available_bytes") == {node: GB10.memory_available_bytes}
    assert _of(got, "nexa_node_heartbeat_age_seconds") == {node: 1.5}
    assert not _of(got, "nexa_node_artifact_cache_used_bytes")  # not reported: left out


def test_two_unified_gpus_share_one_pool_series() -> None:
    [gpu] = GB10.gpus
    twin = attrs.evolve(GB10, gpus=(gpu, attrs.evolve(gpu, index=1, uuid="GPU-twin")))
    got = _samples(_render(NodeFigures(node="spark-1", heartbeat_age_s=0.0, inventory=twin)))
    assert len(_of(got, "nexa_gpu_memory_total_bytes")) == 1
    assert len(_of(got, "nexa_gpu_temperature_celsius")) == 2


def test_discrete_gpus_are_reported_per_index() -> None:
    inv = _l40s_x2()
    got = _samples(_render(NodeFigures(node="l40s", heartbeat_age_s=0.2, inventory=inv)))
    g0, g1 = _gpu("l40s", "0", "NVIDIA L40S"), _gpu("l40s", "1", "NVIDIA L40S")
    mib = 1 << 20
    assert _of(got, "nexa_gpu_memory_total_bytes") == {g0: 46068 * mib, g1: 46068 * mib}
    assert _of(got, "nexa_gpu_memory_used_bytes") == {g0: 1 * mib, g1: 39222 * mib}
    assert _of(got, "nexa_gpu_utilization_ratio") == {g0: 0.0, g1: 0.72}
    assert _of(got, "nexa_gpu_temperature_celsius") == {g0: 28.0, g1: 55.0}
    assert _of(got, "nexa_gpu_power_watts") == {g0: 33.55, g1: 281.2}


def test_unknown_figures_are_left_out_not_zero() -> None:
    inv = _l40s_x2()
    blind = attrs.evolve(
        inv.gpus[1],
        utilization_pct=None,
        temperature_c=None,
        power_draw_w=None,
        memory_used_bytes=None,
        memory_free_bytes=None,
    )
    inv = attrs.evolve(inv, gpus=(inv.gpus[0], blind))
    load = RuntimeLoad(ok=True, age_s=0.5, queue_depth=3)
    replica = ReplicaFigures(deployment="chat-a", replica="r1", load=load, age_s=0.5)
    got = _samples(_render(NodeFigures(node="l40s", heartbeat_age_s=0.2, inventory=inv, replicas=(replica,))))
    g1 = _gpu("l40s", "1", "NVIDIA L40S")
    for name in ("nexa_gpu_utilization_ratio", "nexa_gpu_temperature_celsius", "nexa_gpu_power_watts"):
        assert g1 not in _of(got, name), name
    assert g1 not in _of(got, "nexa_gpu_memory_used_bytes")
    assert g1 in _of(got, "nexa_gpu_memory_total_bytes")
    labels = (("deployment", "chat-a"), ("node", "l40s"), ("replica", "r1"))
    assert _of(got, "nexa_runtime_queue_depth") == {labels: 3.0}
    for name in ("nexa_runtime_running_requests", "nexa_runtime_kv_cache_usage_ratio"):
        assert not _of(got, name), name
    assert not _of(got, "nexa_runtime_time_to_first_token_seconds_count")


def _loaded_node() -> NodeFigures:
    ttft = LatencyHistogram(bounds=(0.001, 0.05, 1.0), counts=(2.0, 5.0, 9.0), count=10.0, sum=4.25)
    tpot = LatencyHistogram(bounds=(0.01, 0.1), counts=(40.0, 90.0), count=100.0, sum=3.5)
    good = RuntimeLoad(
        ok=True,
        age_s=1.0,
        queue_depth=7,
        running=2,
        kv_cache_ratio=0.25,
        prefix_cache_hit_ratio=0.5,
        ttft=ttft,
        tpot=tpot,
    )
    failing = RuntimeLoad(ok=False, age_s=12.0, error="connection refused")
    return NodeFigures(
        node="spark-1",
        heartbeat_age_s=0.1,
        inventory=GB10,
        cache_disk=CacheDisk(used_bytes=3 << 30, free_bytes=500 << 30, total_bytes=1 << 40),
        replicas=(
            ReplicaFigures(deployment="chat-a", replica="r1", load=good, age_s=1.25),
            ReplicaFigures(deployment="chat-b", replica="r2", load=failing, age_s=12.5),
        ),
    )


def test_runtime_series_and_their_histograms_render_right() -> None:
    got = _samples(_render(_loaded_node()))
    r1 = (("deployment", "chat-a"), ("node", "spark-1"), ("replica", "r1"))
    r2 = (("deployment", "chat-b"), ("node", "spark-1"), ("replica", "r2"))
    assert _of(got, "nexa_runtime_metrics_up") == {r1: 1.0, r2: 0.0}
    assert _of(got, "nexa_runtime_metrics_age_seconds") == {r1: 1.25, r2: 12.5}
    # A failing endpoint sends no figures: none exported for it.
    assert _of(got, "nexa_runtime_queue_depth") == {r1: 7.0}
    assert _of(got, "nexa_runtime_running_requests") == {r1: 2.0}
    assert _of(got, "nexa_runtime_kv_cache_usage_ratio") == {r1: 0.25}
    assert _of(got, "nexa_runtime_prefix_cache_hit_ratio") == {r1: 0.5}
    buckets = _of(got, "nexa_runtime_time_to_first_token_seconds_bucket")
    assert {dict(k)["le"]: v for k, v in buckets.items()} == {"0.001": 2.0, "0.05": 5.0, "1.0": 9.0, "+Inf": 10.0}
    assert _of(got, "nexa_runtime_time_to_first_token_seconds_count") == {r1: 10.0}
    assert _of(got, "nexa_runtime_time_to_first_token_seconds_sum") == {r1: 4.25}
    assert _of(got, "nexa_runtime_time_per_output_token_seconds_count") == {r1: 100.0}
    node = (("node", "spark-1"),)
    assert _of(got, "nexa_node_artifact_cache_used_bytes") == {node: 3 << 30}
    assert _of(got, "nexa_node_artifact_cache_free_bytes") == {node: 500 << 30}


def test_an_unreachable_node_keeps_only_its_heartbeat_age() -> None:
    got = _samples(_render(NodeFigures(node="gone", heartbeat_age_s=90.0)))
    assert {name for name, _ in got if name.startswith(("nexa_gpu_", "nexa_node_", "nexa_runtime_"))} == {
        "nexa_node_heartbeat_age_seconds"
    }


def test_odd_figures_never_break_the_exposition() -> None:
    """Labels are cut and escaped, a repeated GPU index is reported once, non-finite values left out."""
    [gpu] = GB10.gpus
    odd = attrs.evolve(gpu, name='GB10 "x"\n' + "y" * 200, unified_memory=False, memory_used_bytes=1)
    inv = attrs.evolve(GB10, gpus=(odd, attrs.evolve(odd, uuid="GPU-dup")))
    # Built outside the contracts' validators (as no heartbeat can be): the collector still copes.
    nan = object.__new__(RuntimeLoad)
    for field, value in (("ok", True), ("age_s", 0.0), ("error", ""), ("queue_depth", float("nan"))):
        object.__setattr__(nan, field, value)
    for field in ("running", "kv_cache_ratio", "prefix_cache_hit_ratio", "ttft", "tpot"):
        object.__setattr__(nan, field, None)
    replica = ReplicaFigures(deployment="d", replica="r", load=nan, age_s=float("inf"))
    got = _samples(_render(NodeFigures(node="n", heartbeat_age_s=0.0, inventory=inv, replicas=(replica,))))
    [temperature] = _of(got, "nexa_gpu_temperature_celsius")
    assert dict(temperature)["model"] == ('GB10 "x"\n' + "y" * 200)[:64]
    assert not _of(got, "nexa_runtime_queue_depth")
    assert not _of(got, "nexa_runtime_metrics_age_seconds")


def test_promtool_accepts_the_exposition() -> None:
    text = _render(_loaded_node(), NodeFigures(node="l40s", heartbeat_age_s=3.0, inventory=_l40s_x2()))
    checked = subprocess.run(
        [require_tool("promtool"), "check", "metrics"],
        input=text,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_describe_names_every_family_without_samples() -> None:
    described = list(FleetCollector(tuple).describe())
    assert tuple(f.name for f in described) == NAMES
    assert all(not f.samples for f in described)
    assert len(NAMES) == 24
    assert all(name.startswith(("nexa_gpu_", "nexa_node_", "nexa_runtime_")) for name in NAMES)


def test_a_snapshot_pinned_on_a_worker_thread_is_what_that_scrape_exports() -> None:
    # `/metrics` reads the fleet on the event loop and writes the text on a worker thread: the
    # scrape there exports the snapshot it was given, and other threads still ask for theirs.
    live = [NodeFigures(node="asked", heartbeat_age_s=1.0)]
    metrics = Metrics()
    metrics.export_fleet(lambda: live)
    pinned = [NodeFigures(node="pinned", heartbeat_age_s=2.0)]
    out: list[bytes] = []
    worker = threading.Thread(target=lambda: out.append(metrics.render(pinned)))
    worker.start()
    worker.join(timeout=60)
    ages = _of(_samples(out[0].decode()), "nexa_node_heartbeat_age_seconds")
    assert ages == {(("node", "pinned"),): 2.0}
    assert _of(_samples(metrics.render().decode()), "nexa_node_heartbeat_age_seconds") == {(("node", "asked"),): 1.0}
