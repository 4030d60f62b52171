"""The shipped Prometheus alert rules (`units/nexa-alerts.yml`): valid, firing when they should, and
naming only metrics the controller exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

from nexa.telemetry import Metrics
from tests.conftest import require_tool

RULES = Path(__file__).resolve().parents[1] / "units" / "nexa-alerts.yml"


def _promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [require_tool("promtool"), *args], capture_output=True, text=True, timeout=60, cwd=cwd, check=False
    )


def test_the_rules_are_valid() -> None:
    checked = _promtool("check", "rules", str(RULES))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    assert "SUCCESS: 8 rules found" in checked.stdout


def test_the_rules_fire_when_they_should_and_not_otherwise(tmp_path: Path) -> None:
    shutil.copy(RULES, tmp_path / RULES.name)
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
    # JSON is YAML: promtool reads it as the test file.
    (tmp_path / "tests.yml").write_text(json.dumps(tests))
    tested = _promtool("test", "rules", "tests.yml", cwd=tmp_path)
    assert tested.returncode == 0, tested.stdout + tested.stderr


def test_the_rules_name_only_metrics_the_controller_exports() -> None:
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    exported = {
        family.name + suffix for family in Metrics().registry.collect() for suffix in suffixes.get(family.type, ("",))
    }
    named = set(re.findall(r"\b(nexa_[a-z_]+)\b", RULES.read_text()))
    assert named, "the rules name no nexa metric"
    assert named <= exported, f"not exported: {sorted(named - exported)}"
