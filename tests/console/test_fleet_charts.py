"""The console's GPU and runtime charts (overview and nodes pages): their data endpoint answers what a
GB10 node (fake nvidia-smi) reports, the pages carry the chart containers, and the role guard of the
nodes view holds, against a real controller and a real `nexa node` process; the runtime figures'
sampling (queue, KV cache from `NodeLive.loads`) on a fleet made here."""

from __future__ import annotations

import types
from pathlib import Path
from typing import Any, cast

import attrs
import httpx
import pytest
import trio
import trio.testing

from nexa.contracts import wire
from nexa.contracts.domain import NodeState
from nexa.contracts.node import Gpu, NodeInventory
from nexa.control.console.fleet_charts import FLEET_CHARTS, MAX_SERIES, FleetCharts
from nexa.control.fleet.nodes import Fleet
from tests.conftest import gb10_inventory, sample_runtime
from tests.realparts import BuiltImages, S3Store
from tests.support.cluster import new_key, sim_cluster, wait_until
from tests.support.console import sign_in
from tests.support.models import registry_config


def _last(chart: dict[str, Any], label: str) -> Any:
    values = chart["values"][chart["labels"].index(label)]
    return next((v for v in reversed(values) if v is not None), None)


@pytest.mark.slow
async def test_the_fleet_charts_show_a_gb10_nodes_gpu_and_runtime_figures(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> None:
    cfg = registry_config(tmp_path, s3_store)
    async with sim_cluster(nursery, tmp_path, cfg, s3_store, test_images, nodes=1, gb10=True) as cluster:
        audit_key = await new_key(cluster, "audit")
        async with httpx.AsyncClient(base_url=cluster.controller.url, timeout=10) as http:
            refused = await http.get("/console/fleet/series")  # not signed in: to the sign-in page
            assert (refused.status_code, refused.headers["location"]) == (303, "/console/login")
            assert (await sign_in(http, cluster.controller.admin_key)).status_code in {200, 303}
            for page in ("/console/overview", "/console/nodes"):
                html = (await http.get(page)).text
                for chart in FLEET_CHARTS:
                    assert f'id="chart-{chart}"' in html, (page, chart)

            async def series(node: str | None = None) -> dict[str, Any]:
                resp = await http.get("/console/fleet/series", params={"node": node} if node else None)
                assert resp.status_code == 200
                got: dict[str, Any] = resp.json()
                return got

            async def reported() -> dict[str, Any] | None:
                s = await series()
                charts = s["charts"]
                return s if "sim-1 gpu 0" in charts["gpu_temperature"]["labels"] else None

            s = await wait_until("the GB10's figures", reported)
            charts = s["charts"]
            assert {name: c["unit"] for name, c in charts.items()} == FLEET_CHARTS
            assert all(len(v) == len(s["t"]) for c in charts.values() for v in c["values"])
            # The recorded nvidia-smi answer of a DGX Spark: 0 %, 41 °C, 4.71 W, its pool once.
            assert _last(charts["gpu_utilization"], "sim-1 gpu 0") == 0
            assert _last(charts["gpu_temperature"], "sim-1 gpu 0") == 41
            assert _last(charts["gpu_power"], "sim-1 gpu 0") == pytest.approx(4.71)
            assert charts["gpu_memory"]["labels"] == ["sim-1 unified"]
            assert _last(charts["gpu_memory"], "sim-1 unified") > 0
            # One node's series only; an unknown node has none.
            assert (await series("sim-1"))["charts"]["gpu_temperature"]["labels"] == ["sim-1 gpu 0"]
            assert all(not c["labels"] for c in (await series("sim-9"))["charts"].values())
        async with httpx.AsyncClient(base_url=cluster.controller.url, timeout=10) as viewer:
            assert (await sign_in(viewer, audit_key)).status_code in {200, 303}
            assert (await viewer.get("/console/fleet/series")).status_code == 403  # the nodes view's roles


# ---- the sampling itself, on a fleet made here ---------------------------------------------------


@attrs.define
class _Live:
    """What `FleetCharts` reads of a `NodeLive`."""

    node: Any
    state: NodeState
    inventory: NodeInventory | None
    desired: wire.DesiredAssignments
    loads: dict[str, tuple[wire.RuntimeLoad, float]] = attrs.Factory(dict)


def _live(node_id: str, gpus: tuple[Gpu, ...], *replicas: str, state: NodeState = NodeState.READY) -> _Live:
    inventory = attrs.evolve(gb10_inventory(node_id), gpus=gpus)
    assigned = [wire.Assignment(id=r, deployment="chat-a", runtime=sample_runtime()) for r in replicas]
    desired = wire.DesiredAssignments(node_id=node_id, generation=1, assignments=assigned)
    return _Live(node=types.SimpleNamespace(id=node_id), state=state, inventory=inventory, desired=desired)


async def test_the_runtime_figures_come_from_the_replicas_loads() -> None:
    spark = _live("spark-1", gb10_inventory().gpus, "r1", "r2", "r3")
    spark.loads = {
        "r1": (wire.RuntimeLoad(ok=True, age_s=0.1, queue_depth=7, kv_cache_ratio=0.25), 0.0),
        "r2": (wire.RuntimeLoad(ok=False, age_s=0.1, error="503"), 0.0),  # a failed scrape: no figures
        "r3": (wire.RuntimeLoad(ok=True, age_s=0.1, queue_depth=0), 0.0),  # no KV figure sent
        "gone": (wire.RuntimeLoad(ok=True, age_s=0.1, queue_depth=99), 0.0),  # no longer assigned
    }
    [gpu] = gb10_inventory().gpus
    # A discrete two-GPU node: memory per index; an unreachable node: nothing.
    discrete = tuple(
        attrs.evolve(gpu, index=i, unified_memory=False, memory_used_bytes=2**30 * (i + 1)) for i in (0, 1)
    )
    lost = _live("lost", gb10_inventory().gpus, state=NodeState.UNREACHABLE)
    charts = FleetCharts(cast("Fleet", [spark, _live("box", discrete), lost]))
    s: Any = charts.series()
    queue, kv, memory = (s["charts"][k] for k in ("runtime_queue", "runtime_kv", "gpu_memory"))
    assert queue["labels"] == ["spark-1 chat-a/r1", "spark-1 chat-a/r3"]
    assert [v[-1] for v in queue["values"]] == [7, 0]
    assert kv["labels"] == ["spark-1 chat-a/r1"] and kv["values"] == [[25.0]]
    assert memory["labels"] == ["spark-1 unified", "box gpu 0", "box gpu 1"]
    assert [v[-1] for v in memory["values"][1:]] == [1.0, 2.0]
    assert s["charts"]["gpu_temperature"]["labels"] == ["spark-1 gpu 0", "box gpu 0", "box gpu 1"]
    assert len(s["t"]) == 1
    only: Any = charts.series("box")
    assert only["charts"]["runtime_queue"]["labels"] == []
    assert only["charts"]["gpu_power"]["labels"] == ["box gpu 0", "box gpu 1"]


async def test_a_chart_keeps_at_most_max_series(autojump_clock: trio.testing.MockClock) -> None:
    [gpu] = gb10_inventory().gpus
    many = tuple(attrs.evolve(gpu, index=i, unified_memory=False) for i in range(MAX_SERIES + 10))
    charts = FleetCharts(cast("Fleet", [_live("big", many)]))
    for _ in range(3):
        charts.sample(trio.current_time())
        await trio.sleep(1.0)
    s: Any = charts.series()
    assert len(s["charts"]["gpu_temperature"]["labels"]) == MAX_SERIES
    assert len(s["t"]) == 4
    assert all(len(v) == 4 for v in s["charts"]["gpu_temperature"]["values"])
