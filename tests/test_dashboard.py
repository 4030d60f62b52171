"""The shipped Grafana dashboard (`units/grafana/nexa.json`): the shape Grafana imports, its rows,
and every query naming a series the controller exports (a query of anything else is a failure)."""

from __future__ import annotations

import copy
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.support.metrics import exported_series

DASHBOARD = Path(__file__).resolve().parents[1] / "units" / "grafana" / "nexa.json"
DATASOURCE = "${DS_PROMETHEUS}"
ROWS = ("Fleet", "GPUs", "Deployments and runtimes", "Gateway", "Tenants")
_NAME = re.compile(r"\b(nexa_[a-z0-9_]+)\b")


def _load() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return loaded


def _panels(dash: dict[str, Any]) -> Iterator[dict[str, Any]]:
    for panel in dash["panels"]:
        yield panel
        yield from panel.get("panels", [])  # a collapsed row holds its panels


def _queries(dash: dict[str, Any]) -> list[str]:
    """Every PromQL text in the dashboard: panel targets and template variables."""
    exprs = [t["expr"] for p in _panels(dash) for t in p.get("targets", [])]
    for var in dash.get("templating", {}).get("list", []):
        query = var.get("query")
        exprs.append(query["query"] if isinstance(query, dict) else str(query or ""))
    return exprs


def unexported(dash: dict[str, Any]) -> set[str]:
    """Series the dashboard queries that the controller does not export. A name is checked with the
    suffix Prometheus gives its type: a counter only as `_total`, a histogram as `_bucket`, `_sum`
    or `_count`, a gauge bare; so `nexa_gateway_requests` (no `_total`) does not pass either."""
    named = {name for expr in _queries(dash) for name in _NAME.findall(expr)}
    return named - exported_series()


def test_every_query_names_a_series_the_controller_exports() -> None:
    dash = _load()
    named = {name for expr in _queries(dash) for name in _NAME.findall(expr)}
    assert len(named) >= 25, sorted(named)
    assert unexported(dash) == set()
    # The series are all on it: GPUs, nodes, runtimes, the gateway's overhead.
    for name in (
        "nexa_gpu_utilization_ratio",
        "nexa_gpu_memory_used_bytes",
        "nexa_gpu_temperature_celsius",
        "nexa_gpu_power_watts",
        "nexa_node_heartbeat_age_seconds",
        "nexa_node_artifact_cache_free_bytes",
        "nexa_runtime_queue_depth",
        "nexa_runtime_kv_cache_usage_ratio",
        "nexa_runtime_time_to_first_token_seconds_bucket",
        "nexa_runtime_time_per_output_token_seconds_bucket",
        "nexa_gateway_overhead_seconds_bucket",
        "nexa_gateway_tenant_tokens_total",
    ):
        assert name in named, name


def test_a_query_of_a_series_nexa_does_not_export_fails_the_check() -> None:
    dash = _load()
    for wrong in (
        "nexa_gpu_fan_speed_rpm",  # never exported
        "rate(nexa_gateway_requests[5m])",  # a counter without its _total
        "nexa_gateway_overhead_seconds",  # a histogram without a sample suffix
        "nexa_nodes_total",  # a gauge with a counter's suffix
    ):
        doctored = copy.deepcopy(dash)
        doctored["panels"][1]["targets"][0]["expr"] = wrong
        assert unexported(doctored) - unexported(dash) == {_NAME.findall(wrong)[0]}, wrong
    doctored = copy.deepcopy(dash)
    doctored["templating"]["list"][0]["query"]["query"] = "label_values(nexa_node_uptime_seconds, node)"
    assert unexported(doctored) - unexported(dash) == {"nexa_node_uptime_seconds"}


def test_the_dashboard_has_the_shape_grafana_imports() -> None:
    dash = _load()
    assert dash["schemaVersion"] >= 36
    assert dash["uid"] and dash["title"]
    inputs = {i["name"]: i for i in dash["__inputs"]}
    assert inputs["DS_PROMETHEUS"]["type"] == "datasource"
    assert inputs["DS_PROMETHEUS"]["pluginId"] == "prometheus"
    panels = list(_panels(dash))
    ids = [p["id"] for p in panels]
    assert all(isinstance(i, int) for i in ids) and len(set(ids)) == len(ids), "panel ids must be unique ints"
    rows = [p["title"] for p in panels if p["type"] == "row"]
    assert tuple(rows) == ROWS
    for p in panels:
        grid = p["gridPos"]
        assert {"h", "w", "x", "y"} <= grid.keys(), p["title"]
        assert all(isinstance(grid[k], int) and grid[k] >= 0 for k in "hwxy"), p["title"]
        assert grid["x"] + grid["w"] <= 24, p["title"]
        if p["type"] == "row":
            continue
        assert p["datasource"]["uid"] == DATASOURCE, p["title"]
        assert p["targets"], f"{p['title']} has no query"
        refs = [t["refId"] for t in p["targets"]]
        assert len(set(refs)) == len(refs), p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == DATASOURCE
            assert t["expr"].strip()
            if "histogram_quantile" in t["expr"]:
                assert "_bucket" in t["expr"] and "le)" in t["expr"], t["expr"]
    # No two panels overlap (Grafana would move them).
    cells = set()
    for p in panels:
        g = p["gridPos"]
        mine = {(x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])}
        assert not cells & mine, f"{p['title']} overlaps another panel"
        cells |= mine
    for var in dash["templating"]["list"]:
        assert var["datasource"]["uid"] == DATASOURCE
