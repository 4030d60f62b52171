"""Four `nexa node` processes on 127.0.0.11-14 and a `nexa control` process, driven only by the CLI.

Real ZeroMQ with CurveZMQ over loopback; real processes stopped with real signals.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import attrs
import pytest

from tests.conftest import FIXTURES, ControllerProcess
from tests.support.api import wait_until

NODES = 4
TIMEOUT_S = 30


@attrs.define
class NodeProcess:
    name: str
    state_dir: Path
    config: Path
    inventory: Path
    proc: subprocess.Popen[bytes] | None = None
    log: Path | None = None

    def start(self) -> None:
        self.log = self.state_dir.parent / f"{self.name}-{time.monotonic_ns()}.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "nexa", "node", "--config", str(self.config)], stdout=out, stderr=out
            )

    def stop(self, sig: int = signal.SIGTERM) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=30)


def nodes(cp: ControllerProcess) -> dict[str, dict[str, Any]]:
    out = cp.cli("nodes", "list", "--json")
    if out.returncode != 0:
        return {}
    return {n["id"]: n for n in json.loads(out.stdout)["nodes"]}


def states(cp: ControllerProcess) -> dict[str, str]:
    return {k: v["state"] for k, v in nodes(cp).items()}


@pytest.fixture
def fleet(controller_process: ControllerProcess, tmp_path: Path) -> Iterator[list[NodeProcess]]:
    cp = controller_process
    fake_smi = tmp_path / "nvidia-smi"
    fake_smi.write_text(f"#!/bin/sh\ncat '{FIXTURES / 'nvidia-smi' / 'gb10_dgx_spark.csv'}'\n")
    fake_smi.chmod(0o755)
    procs = []
    try:
        for i in range(1, NODES + 1):
            name = f"spark-{i}"
            state_dir = tmp_path / name
            inventory = tmp_path / f"{name}-inventory.json"
            inventory.write_text(json.dumps({"labels": {"board": "dgx-spark"}, "runtimes": ["llamacpp", "sim"]}))
            config = tmp_path / f"{name}.toml"
            config.write_text(
                f'state_dir = "{state_dir}"\ninventory_path = "{inventory}"\ninventory_poll_interval_s = 0.2\n'
                f'nvidia_smi = "{fake_smi}"\nheartbeat_interval_s = 0.5\nsource_address = "127.0.0.1{i}"\n'
                "reconnect_max_s = 1\n"
            )
            check = subprocess.run(
                [sys.executable, "-m", "nexa", "check-config", "--role", "node", str(config)],
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert check.returncode == 0, check.stderr
            token = json.loads(
                cp.cli("tokens", "create", "--ttl", "15m", "--labels", f"rack=r{i}", "--json", check=True).stdout
            )
            enrolled = cp.cli(
                "node",
                "enroll",
                "--controller",
                cp.url,
                "--token",
                token["token"],
                "--name",
                name,
                "--state-dir",
                str(state_dir),
            )
            assert enrolled.returncode == 0, enrolled.stderr
            assert f"enrolled as node {name}" in enrolled.stdout
            node = NodeProcess(name=name, state_dir=state_dir, config=config, inventory=inventory)
            node.start()
            procs.append(node)
        yield procs
    finally:
        for node in procs:
            if node.proc is not None and node.proc.poll() is None:
                node.proc.kill()
                node.proc.wait()


@pytest.mark.slow
def test_four_nodes_enroll_heartbeat_survive_restarts_and_follow_operators(
    controller_process: ControllerProcess, fleet: list[NodeProcess]
) -> None:
    cp = controller_process
    names = [n.name for n in fleet]
    wait_until(lambda: states(cp) == dict.fromkeys(names, "Ready"), "four Ready nodes")

    # Each node dialled out from its own loopback address; nodes listen on nothing.
    ss = subprocess.run(["ss", "-tnH", "state", "established"], capture_output=True, text=True, timeout=10, check=True)
    sources = {
        fields[-2].rsplit(":", 1)[0]
        for fields in (line.split() for line in ss.stdout.splitlines())
        if len(fields) >= 4 and fields[-1] == f"127.0.0.1:{cp.channel_port}"
    }
    assert sources == {f"127.0.0.1{i}" for i in range(1, NODES + 1)}, ss.stdout
    for node in fleet:
        assert node.proc is not None
        listening = subprocess.run(["ss", "-tlnp"], capture_output=True, text=True, timeout=10, check=True).stdout
        assert f"pid={node.proc.pid}," not in listening

    listed = nodes(cp)
    spark1 = listed["spark-1"]
    assert spark1["labels"] == {"board": "dgx-spark", "rack": "r1"}
    assert spark1["inventory"]["gpus"][0]["unified_memory"] is True
    assert spark1["acked_generation"] == spark1["desired_generation"] == 1
    table = cp.cli("nodes", "list").stdout
    assert table.splitlines()[0].split() == [
        "ID",
        "STATE",
        "HEARTBEAT",
        "LABELS",
        "ACCELERATORS",
        "FREE_MEMORY",
        "ASSIGNMENTS",
    ]
    assert "1x NVIDIA GB10 (unified)" in table

    # A valid inventory edit shows in `nexa nodes show`; an invalid one leaves the last good one.
    fleet[0].inventory.write_text(json.dumps({"labels": {"board": "dgx-spark", "zone": "z9"}}))
    wait_until(lambda: "zone=z9" in cp.cli("nodes", "show", "spark-1").stdout, "the edited label")
    fleet[0].inventory.write_text('{"labels": {"zone": "broken"')
    time.sleep(1.5)  # several polls and heartbeats
    shown = cp.cli("nodes", "show", "spark-1").stdout
    assert "zone=z9" in shown and "broken" not in shown
    # The engine line: the default engine (no podman answers these sim nodes: no version) and GPU method.
    assert "engine       podman -, GPUs by cdi" in shown
    assert nodes(cp)["spark-1"]["inventory"]["container_engine"] == "podman"
    assert fleet[0].log is not None
    assert "rejected" in fleet[0].log.read_text()

    # Controller restart: nodes reconnect on their own; states and generations survive.
    assert cp.stop() == 0
    cp.start()
    wait_until(lambda: states(cp) == dict.fromkeys(names, "Ready"), "four Ready nodes after a controller restart")
    wait_until(lambda: all(n["acked_epoch"] == 2 for n in nodes(cp).values()), "every node acking the new epoch")
    assert {n["acked_generation"] for n in nodes(cp).values()} == {1}
    assert nodes(cp)["spark-1"]["labels"]["zone"] == "z9"

    # Node restart: Unreachable while it is gone, back with its stored fence.
    assert fleet[1].stop() == 0
    wait_until(lambda: states(cp)["spark-2"] == "Unreachable", "spark-2 Unreachable")
    fence = json.loads((fleet[1].state_dir / "fence.json").read_text())
    assert (fence["epoch"], fence["generation"]) == (2, 1)
    fleet[1].start()
    wait_until(lambda: states(cp)["spark-2"] == "Ready", "spark-2 Ready again")

    # Operators: cordon, drain, uncordon; revoke shuts a node out for good.
    assert "Cordoned" in cp.cli("nodes", "cordon", "spark-3", check=True).stdout
    assert "Draining" in cp.cli("nodes", "drain", "spark-3", check=True).stdout
    assert "Ready" in cp.cli("nodes", "uncordon", "spark-3", check=True).stdout
    assert "Revoked" in cp.cli("nodes", "revoke", "spark-4", check=True).stdout
    time.sleep(1.5)
    assert states(cp)["spark-4"] == "Revoked"
    fleet[3].stop(signal.SIGKILL)
    fleet[3].start()  # it cannot come back: ZAP refuses its key
    time.sleep(2)
    assert states(cp) == {"spark-1": "Ready", "spark-2": "Ready", "spark-3": "Ready", "spark-4": "Revoked"}
    audit = json.loads(cp.cli("audit", "list", "--json", "--limit", "1000", check=True).stdout)["events"]
    actions = [e["action"] for e in audit]
    for expected in ("node.enroll", "node.reachable", "node.unreachable", "node.cordon", "node.drain", "node.revoke"):
        assert expected in actions, expected
    assert any(e["action"] == "node.message.rejected" and e["target"] == "node/spark-4" for e in audit)
    assert cp.cli("audit", "verify").returncode == 0

    for node in fleet:
        assert node.stop() == 0
