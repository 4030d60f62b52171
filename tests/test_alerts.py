"""The shipped Prometheus alert rules (`units/nexa-alerts.yml`): valid, firing when they should, and
naming only metrics the controller exports (its registry and the fleet collector)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

from tests.conftest import require_tool
from tests.support.metrics import exported_series

RULES = Path(__file__).resolve().parents[1] / "units" / "nexa-alerts.yml"


def _promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [require_tool("promtool"), *args], capture_output=True, text=True, timeout=60, cwd=cwd, check=False
    )


def test_the_rules_are_valid() -> None:
    checked = _promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 16 rules found" in checked.stdout


def test_the_rules_fire_when_they_should_and_not_otherwise(tmp_path: Path) -> None:
    series = [
        {"series": 'nexa_nodes{state="Unreachable"}', "values": "0 1 1 1 1 1 1"},
        # chat: 10 % errors; embed: 1 % (under the 5 % threshold).
        {"series": 'nexa_gateway_requests_total{model="chat",tenant="a",status="ok"}', "values": "0+540x10"},
        {"series": 'nexa_gateway_requests_total{model="chat",tenant="a",status="runtime_failed"}', "values": "0+60x10"},
        {"series": 'nexa_gateway_requests_total{model="embed",tenant="a",status="ok"}', "values": "0+594x10"},
        {"series": 'nexa_gateway_requests_total{model="embed",tenant="a",status="quota_exceeded"}', "values": "0+6x10"},
        {"series": "nexa_metering_pending", "values": "0 20000 20000 20000 20000 20000 20000 20000"},
        # Backups every 2 minutes: "stale" has none since the start, "fresh" one a minute, "off" schedules none.
        {"series": 'nexa_backup_interval_seconds{instance="stale"}', "values": "120x20"},
        {"series": 'nexa_backup_last_success_timestamp_seconds{instance="stale"}', "values": "0x20"},
        {"series": 'nexa_backup_interval_seconds{instance="fresh"}', "values": "120x20"},
        {"series": 'nexa_backup_last_success_timestamp_seconds{instance="fresh"}', "values": "0+60x20"},
        {"series": 'nexa_backup_interval_seconds{instance="off"}', "values": "0x20"},
        {"series": 'nexa_backup_last_success_timestamp_seconds{instance="off"}', "values": "0x20"},
    ]
    tests = {
        "rule_files": [RULES.name],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "alert_rule_test": [
                    # Unreachable since 1m: pending, not firing, until its `for: 2m` has passed.
                    {"eval_time": "2m", "alertname": "NexaNodesUnreachable", "exp_alerts": []},
                    {
                        "eval_time": "4m",
                        "alertname": "NexaNodesUnreachable",
                        "exp_alerts": [
                            {
                                "exp_labels": {"severity": "warning"},
                                "exp_annotations": {
                                    "summary": "1 node(s) unreachable",
                                    "description": "Nodes missed their heartbeat lease; their replicas are being"
                                    " placed elsewhere.",
                                },
                            }
                        ],
                    },
                    {
                        "eval_time": "10m",
                        "alertname": "NexaInferenceErrors",
                        "exp_alerts": [
                            {
                                "exp_labels": {"severity": "warning", "model": "chat"},
                                "exp_annotations": {
                                    "summary": "more than 5% of requests to chat fail",
                                    "description": "Error rate 10% over 5 minutes (quota refusals included).",
                                },
                            }
                        ],
                    },
                    {"eval_time": "10m", "alertname": "NexaNoReadyReplica", "exp_alerts": []},
                    {
                        "eval_time": "12m",
                        "alertname": "NexaBackupStale",
                        "exp_alerts": [
                            {
                                "exp_labels": {"severity": "warning", "instance": "stale"},
                                "exp_annotations": {
                                    "summary": "no new backup of stale for two backup intervals",
                                    "description": "Scheduled backups fail (nexa_backup_failures_total, the"
                                    " controller's log): a lost disk would lose everything since the newest backup.",
                                },
                            }
                        ],
                    },
                    {
                        "eval_time": "7m",
                        "alertname": "NexaMeteringBacklog",
                        "exp_alerts": [
                            {
                                "exp_labels": {"severity": "critical"},
                                "exp_annotations": {
                                    "summary": "usage records are not being written",
                                    "description": "20000 usage records wait for the store: a crash would lose them.",
                                },
                            }
                        ],
                    },
                ],
            }
        ],
    }
    _test_rules(tmp_path, tests)


def _test_rules(tmp_path: Path, tests: dict[str, Any]) -> None:
    shutil.copy(RULES, tmp_path / RULES.name)
    # JSON is YAML: promtool reads it as the test file.
    (tmp_path / "tests.yml").write_text(json.dumps(tests))
    tested = _promtool("test", "rules", "tests.yml", cwd=tmp_path)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def _alert(name: str, at: str, *fired: tuple[dict[str, str], dict[str, str]]) -> dict[str, Any]:
    """One promtool alert test: at `at`, `name` fires exactly for each (labels, annotations) in `fired`."""
    return {
        "eval_time": at,
        "alertname": name,
        "exp_alerts": [
            {"exp_labels": {"severity": "warning", **labels}, "exp_annotations": notes} for labels, notes in fired
        ],
    }


def test_the_fleet_rules_fire_when_sustained_and_not_otherwise(tmp_path: Path) -> None:
    gpu = 'nexa_gpu_temperature_celsius{{node="{}",gpu="0",model="NVIDIA GB10"}}'
    rt = '{}{{deployment="chat",replica="{}",node="n1"}}'
    series = [
        # n1 runs hot; n2 is warm but under the threshold; n3 had one hot minute.
        {"series": gpu.format("n1"), "values": "70 90x12"},
        {"series": gpu.format("n2"), "values": "80x12"},
        {"series": gpu.format("n3"), "values": "70 95 70x11"},
        # r1's queue stays long; r2's was long for two minutes; r3's is short.
        {"series": rt.format("nexa_runtime_queue_depth", "r1"), "values": "0 30x12"},
        {"series": rt.format("nexa_runtime_queue_depth", "r2"), "values": "0 30 30 0x10"},
        {"series": rt.format("nexa_runtime_queue_depth", "r3"), "values": "5x12"},
        # r1's KV cache is full; r2's is busy but has room.
        {"series": rt.format("nexa_runtime_kv_cache_usage_ratio", "r1"), "values": "0.5 0.99x14"},
        {"series": rt.format("nexa_runtime_kv_cache_usage_ratio", "r2"), "values": "0.9x14"},
        # r1's metrics endpoint fails; r2's answers; r3's failed once.
        {"series": rt.format("nexa_runtime_metrics_up", "r1"), "values": "1 0x12"},
        {"series": rt.format("nexa_runtime_metrics_up", "r2"), "values": "1x12"},
        {"series": rt.format("nexa_runtime_metrics_up", "r3"), "values": "1 0 1x11"},
    ]
    hot = (
        {"node": "n1", "gpu": "0", "model": "NVIDIA GB10"},
        {
            "summary": "GPU 0 of node n1 is at 90 °C",
            "description": "Above 85 °C for 5 minutes: check the node's cooling and airflow; the GPU throttles near"
            " 90 °C. Drain the node (nexa nodes drain) if it keeps rising.",
        },
    )
    r1 = {"deployment": "chat", "replica": "r1", "node": "n1"}
    queued = (
        r1,
        {
            "summary": "30 requests wait in replica r1 of chat",
            "description": "The runtime on n1 has kept more than 16 requests waiting for 5 minutes: scale the"
            " deployment (nexa deployments scale) or lower the load.",
        },
    )
    full = (
        r1,
        {
            "summary": "the KV cache of replica r1 of chat is 99% full",
            "description": "Above 95% for 10 minutes: the runtime preempts and recomputes requests. Add replicas,"
            " or give the runtime more memory or shorter contexts (its options).",
        },
    )
    down = (
        r1,
        {
            "summary": "node n1 cannot read the metrics of replica r1",
            "description": "The runtime's metrics endpoint has failed for 5 minutes; routing falls back to"
            " in-flight counts for it. See nexa deployments show chat and the runtime's log on the node.",
        },
    )
    checks = [
        # Pending, not yet firing: each rule waits for its `for`.
        _alert("NexaGpuTemperatureHigh", "3m"),
        _alert("NexaRuntimeQueueSaturated", "3m"),
        _alert("NexaKvCacheFull", "8m"),
        _alert("NexaRuntimeMetricsDown", "3m"),
        # Sustained: firing for the one series that stayed past its threshold.
        _alert("NexaGpuTemperatureHigh", "8m", hot),
        _alert("NexaRuntimeQueueSaturated", "8m", queued),
        _alert("NexaKvCacheFull", "13m", full),
        _alert("NexaRuntimeMetricsDown", "8m", down),
    ]
    _test_rules(
        tmp_path,
        {
            "rule_files": [RULES.name],
            "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": checks}],
        },
    )


def test_the_memory_pressure_and_stale_gpu_rules_fire_when_sustained(tmp_path: Path) -> None:
    series = [
        # n1 falls under its floor and stays there; n2 dips under it for a minute only.
        {"series": 'nexa_node_memory_pressure{node="n1"}', "values": "0 1x10"},
        {"series": 'nexa_node_memory_pressure{node="n2"}', "values": "0 1 0x9"},
        # n1's nvidia-smi hangs from the second minute on; n2's once.
        {"series": 'nexa_node_gpu_figures_stale{node="n1"}', "values": "0 1x10"},
        {"series": 'nexa_node_gpu_figures_stale{node="n2"}', "values": "0 1 0x9"},
    ]
    pressure = (
        {"node": "n1"},
        {
            "summary": "node n1 is under memory pressure",
            "description": "Its MemAvailable has been under its [memory] pressure_floor_bytes for a minute: the node"
            " stops its newest replica (Failed(memory_pressure)) and nothing more is placed on it. See nexa nodes"
            " show n1; move or shrink deployments (nexa deployments show) before the host stalls.",
        },
    )
    stale = (
        {"node": "n1"},
        {
            "summary": "nvidia-smi on node n1 has not answered for 5 minutes",
            "description": "The node keeps its last GPU figures (utilisation, temperature, power, memory) and kills"
            " each hung nvidia-smi: the driver may be wedged. Check nvidia-smi on the node; drain it (nexa nodes"
            " drain) if the GPU is lost.",
        },
    )
    checks = [
        _alert("NexaNodeMemoryPressure", "1m"),
        {  # critical: the host may stall
            "eval_time": "3m",
            "alertname": "NexaNodeMemoryPressure",
            "exp_alerts": [{"exp_labels": {"severity": "critical", **pressure[0]}, "exp_annotations": pressure[1]}],
        },
        _alert("NexaGpuFiguresStale", "4m"),
        _alert("NexaGpuFiguresStale", "7m", stale),
    ]
    _test_rules(
        tmp_path,
        {
            "rule_files": [RULES.name],
            "evaluation_interval": "1m",
            "tests": [{"interval": "1m", "input_series": series, "alert_rule_test": checks}],
        },
    )


def test_the_slow_wake_rule_fires_when_wakes_exceed_their_objective(tmp_path: Path) -> None:
    # nexa_wake_seconds of two deployments: "slow" wakes in 40-60 s (every wake), "quick" in under 5 s.
    buckets = ("1.0", "2.5", "5.0", "10.0", "30.0", "60.0", "+Inf")

    def wakes(deployment: str, first_bucket: str) -> list[dict[str, str]]:
        out = []
        for le in buckets:
            counted = buckets.index(le) >= buckets.index(first_bucket)
            series = f'nexa_wake_seconds_bucket{{deployment="{deployment}",le="{le}"}}'
            out.append({"series": series, "values": "0+1x20" if counted else "0x20"})
        return out

    expected = (
        {"deployment": "slow"},
        {
            "summary": "slow takes 58.5s to wake",
            "description": "Its wakes from sleep (p95 over 30 minutes) exceed the 30 s objective: requests for it"
            " wait that long or fail with deadline_exceeded. Raise its idle_after_s, keep it awake (nexa deployments"
            " idle), or check its node's artifact cache and runtime start (nexa deployments show).",
        },
    )
    _test_rules(
        tmp_path,
        {
            "rule_files": [RULES.name],
            "evaluation_interval": "1m",
            "tests": [
                {
                    "interval": "1m",
                    "input_series": wakes("slow", "60.0") + wakes("quick", "5.0"),
                    "alert_rule_test": [_alert("NexaSlowWakes", "1m"), _alert("NexaSlowWakes", "10m", expected)],
                }
            ],
        },
    )


def test_the_rules_name_only_metrics_the_controller_exports() -> None:
    exported = exported_series()
    named = set(re.findall(r"\b(nexa_[a-z_]+)\b", RULES.read_text()))
    assert named, "the rules name no nexa metric"
    assert named <= exported, f"not exported: {sorted(named - exported)}"


def test_a_reverted_rollout_alerts_until_fifteen_minutes_passed_without_another(tmp_path: Path) -> None:
    series = [
        # chat-a: one revert at minute 2; embed: none.
        {"series": 'nexa_rollout_reverts_total{deployment="chat-a"}', "values": "0 0 1x20"},
        {"series": 'nexa_rollout_reverts_total{deployment="embed"}', "values": "0x22"},
    ]
    notes = {
        "summary": "a rollout of chat-a was reverted",
        "description": "A new replica broke the deployment's objectives during its soak; its changed replicas went"
        " back to the last good spec. See nexa deployments rollout status chat-a and the audit"
        " (deployment.rollout.revert).",
    }
    tests = {
        "rule_files": [RULES.name],
        "evaluation_interval": "1m",
        "tests": [
            {
                "interval": "1m",
                "input_series": series,
                "alert_rule_test": [
                    _alert("NexaRolloutReverted", "1m"),
                    _alert("NexaRolloutReverted", "3m", ({"deployment": "chat-a"}, notes)),
                    _alert("NexaRolloutReverted", "20m"),
                ],
            }
        ],
    }
    _test_rules(tmp_path, tests)
