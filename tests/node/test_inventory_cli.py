"""`nexa node inventory`: what a node would report, through the real command and a real subprocess."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.conftest import FIXTURES


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nexa", "node", "inventory", *args], capture_output=True, text=True, timeout=60
    )


def test_inventory_merges_discovery_and_the_file(tmp_path: Path) -> None:
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncat '{FIXTURES / 'nvidia-smi' / 'gb10_dgx_spark.csv'}'\n")
    smi.chmod(0o755)
    inventory = tmp_path / "inventory.json"
    inventory.write_text(json.dumps({"labels": {"rack": "r1"}, "runtimes": ["llamacpp"]}))
    config = tmp_path / "node.toml"
    config.write_text(f'nvidia_smi = "{smi}"\ninventory_path = "{inventory}"\n')

    data = json.loads(run("--config", str(config), "--json").stdout)
    assert [g["name"] for g in data["gpus"]] == ["NVIDIA GB10"]
    assert data["gpus"][0]["unified_memory"] is True
    assert data["gpus"][0]["cdi_device"] == "nvidia.com/gpu=0"
    assert data["accelerator_memory_bytes"] == data["memory_total_bytes"]
    assert data["labels"] == {"rack": "r1"} and data["runtimes"] == ["llamacpp"]

    human = run("--config", str(config)).stdout
    assert "NVIDIA GB10, unified with the host, nvidia.com/gpu=0" in human


def test_an_invalid_inventory_file_is_exit_2_naming_the_key(tmp_path: Path) -> None:
    inventory = tmp_path / "inventory.json"
    inventory.write_text(json.dumps({"lables": {}}))
    out = run("--inventory", str(inventory))
    assert out.returncode == 2
    assert "lables: unknown key" in out.stderr
