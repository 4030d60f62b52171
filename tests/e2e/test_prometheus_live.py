"""Debian's real Prometheus against a real controller: it scrapes `/metrics` with a monitoring key
(an `authorization` credentials file), loads the shipped `units/nexa-alerts.yml`, sees the GPU,
runtime and gateway series of a sim cluster on (fake nvidia-smi) GB10 nodes, and fires
`NexaNodesUnreachable` in its own `/api/v1/alerts` once a node is killed. The rules it loads are the
shipped file with that one alert's `for: 2m` made `for: 5s` (its expression as shipped): the two
minutes are a constant `tests/test_alerts.py` checks with promtool's own clock, and here they would only
hold a test worker idle.

Prometheus runs on a free loopback port with its data in the test's tmp dir, and is stopped by its
PID whatever happens.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from functools import partial
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from tests.conftest import free_port, require_tool
from tests.realparts import BuiltImages, S3Store
from tests.support.cluster import MESSAGES, SimCluster, new_key, sim_cluster
from tests.support.models import registry_config

RULES = Path(__file__).resolve().parents[2] / "units" / "nexa-alerts.yml"
#: How long Prometheus may take to start and scrape a first time (it takes seconds).
SCRAPE_TIMEOUT_S = 60
#: The node's lease (3 s), the alert's `for` (5 s here), and evaluation rounds on a loaded machine.
ALERT_TIMEOUT_S = 120


def _rules(tmp_path: Path) -> Path:
    """The shipped rules, `NexaNodesUnreachable` pending 5 s instead of 2 min before it fires."""
    shipped = RULES.read_text()
    head, alert, rest = shipped.partition("- alert: NexaNodesUnreachable\n")
    block, sep, tail = rest.partition("\n\n")
    assert alert and "        for: 2m\n" in block, "units/nexa-alerts.yml: NexaNodesUnreachable's `for: 2m` moved"
    path = tmp_path / "nexa-alerts.yml"
    path.write_text(head + alert + block.replace("        for: 2m\n", "        for: 5s\n") + sep + tail)
    return path


def _prometheus_config(tmp_path: Path, controller_url: str, key: str) -> Path:
    credentials = tmp_path / "prometheus-credentials"
    credentials.write_text(key)
    credentials.chmod(0o600)
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(_rules(tmp_path))],
        "scrape_configs": [
            {
                "job_name": "nexa-control",
                "metrics_path": "/metrics",
                "authorization": {"type": "Bearer", "credentials_file": str(credentials)},
                "static_configs": [{"targets": [controller_url.removeprefix("http://")]}],
            }
        ],
    }
    path = tmp_path / "prometheus.yml"
    path.write_text(json.dumps(config))  # JSON is YAML
    return path


async def _query(prom: httpx.AsyncClient, expr: str) -> list[dict[str, Any]]:
    answer = (await prom.get("/api/v1/query", params={"query": expr})).json()
    assert answer["status"] == "success", answer
    result: list[dict[str, Any]] = answer["data"]["result"]
    return result


async def _until(what: str, check: Any, timeout_s: float, log: Path) -> Any:
    """Poll `check` until it answers something true; fail naming `what` (with Prometheus' log tail)."""
    with trio.move_on_after(timeout_s):
        while not (got := await check()):  # noqa: ASYNC110 - polling Prometheus' API
            await trio.sleep(0.5)
        return got
    raise AssertionError(f"timed out waiting for {what}; prometheus log: {_tail(log)}")


def _tail(log: Path) -> str:
    return log.read_text()[-2000:]


def _start_prometheus(prometheus: str, config: Path, data: Path, port: int, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [
                prometheus,
                f"--config.file={config}",
                f"--storage.tsdb.path={data}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=out,
            stderr=out,
        )


async def _one_chat(cluster: SimCluster) -> None:
    client = openai.AsyncOpenAI(base_url=cluster.base_url, api_key=cluster.inference_key, max_retries=0, timeout=30)
    try:
        answer = await client.chat.completions.create(model="chat", messages=MESSAGES)
    finally:
        await client.close()
    assert answer.choices[0].message.content


@pytest.mark.slow
async def test_a_live_prometheus_scrapes_the_fleet_and_fires_an_alert(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> None:
    prometheus = require_tool("prometheus")
    promtool = require_tool("promtool")
    cfg = registry_config(tmp_path, s3_store)
    async with sim_cluster(nursery, tmp_path, cfg, s3_store, test_images, nodes=2, gb10=True) as cluster:
        await cluster.deploy("chat-a", replicas=2)
        config = _prometheus_config(tmp_path, cluster.controller.url, await new_key(cluster, "monitoring"))
        check = partial(
            subprocess.run,
            [promtool, "check", "config", str(config)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        checked = await trio.to_thread.run_sync(check)
        assert checked.returncode == 0, checked.stdout + checked.stderr
        port = free_port()
        log = tmp_path / "prometheus.log"
        proc = _start_prometheus(prometheus, config, tmp_path / "prometheus-data", port, log)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=10) as prom:
                await _scraped(prom, cluster, log)
                # A node dies as a crashed machine does: its lease lapses, the alert goes pending, then fires.
                cluster.nodes[1].kill(signal.SIGKILL)

                async def firing() -> bool:
                    try:
                        alerts = (await prom.get("/api/v1/alerts")).json()["data"]["alerts"]
                    except httpx.TransportError:
                        return False
                    return any(
                        a["labels"]["alertname"] == "NexaNodesUnreachable" and a["state"] == "firing" for a in alerts
                    )

                await _until("NexaNodesUnreachable to fire", firing, ALERT_TIMEOUT_S, log)
                unreachable = await _query(prom, 'nexa_nodes{state="Unreachable"}')
                assert [float(s["value"][1]) for s in unreachable] == [1.0]
        finally:
            if proc.poll() is None:
                os.kill(proc.pid, signal.SIGTERM)
            try:
                await trio.to_thread.run_sync(proc.wait, 30)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
                proc.wait()


async def _scraped(prom: httpx.AsyncClient, cluster: SimCluster, log: Path) -> None:
    """The target is up, and Prometheus holds the GPU, runtime and gateway series."""

    async def target_up() -> bool:
        try:
            targets = (await prom.get("/api/v1/targets")).json()["data"]["activeTargets"]
        except (httpx.TransportError, json.JSONDecodeError):
            return False  # not listening yet
        return any(t["labels"]["job"] == "nexa-control" and t["health"] == "up" for t in targets)

    await _until("the controller's target to be up", target_up, SCRAPE_TIMEOUT_S, log)
    assert await _query(prom, 'up{job="nexa-control"}')

    async def series(expr: str) -> list[dict[str, Any]]:
        return await _query(prom, expr)

    # The GB10's GPU, from the signed heartbeats (the fixture's 41 °C), and its unified pool once per node.
    gpus = await _until("a GPU series", lambda: series("nexa_gpu_temperature_celsius"), SCRAPE_TIMEOUT_S, log)
    assert {s["metric"]["node"] for s in gpus} == {n.node_id for n in cluster.nodes}
    assert all(s["metric"]["model"] == "NVIDIA GB10" and float(s["value"][1]) == 41.0 for s in gpus)
    pools = await _until("the unified pool", lambda: series("nexa_gpu_memory_total_bytes"), SCRAPE_TIMEOUT_S, log)
    assert sorted(s["metric"]["gpu"] for s in pools) == ["unified", "unified"]
    # Each Ready replica's runtime queue, scraped by its node from the sim runtime's /metrics.
    queues = await _until(
        "the runtimes' queue depth", lambda: series('nexa_runtime_queue_depth{deployment="chat-a"}'), 120, log
    )
    assert {s["metric"]["node"] for s in queues} <= {n.node_id for n in cluster.nodes}
    assert all(float(s["value"][1]) == 0 for s in queues)
    # The gateway's counter, after one request through the official SDK.
    await _one_chat(cluster)
    done = await _until(
        "the gateway's requests",
        lambda: series('nexa_gateway_requests_total{model="chat",status="ok"}'),
        SCRAPE_TIMEOUT_S,
        log,
    )
    assert [float(s["value"][1]) for s in done] == [1.0]
