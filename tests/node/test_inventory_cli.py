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


def test_inventory_prints_the_fabric_found_under_sysfs_path(tmp_path: Path) -> None:
    """The InfiniBand host of tests/fixtures/sysfs: one port down with its IPoIB interface, one up
    without a netdev. Its interface is not this host's, so it has no address and no fabric is named."""
    config = tmp_path / "node.toml"
    config.write_text(
        f'sysfs_path = "{FIXTURES / "sysfs" / "infiniband-host"}"\ninventory_path = "{tmp_path / "inventory.json"}"\n'
    )
    human = run("--config", str(config)).stdout
    assert "fabric       - (no ACTIVE RDMA port on an interface with an address)\n" in human
    assert "  rdma ibp3s0 port 1: DOWN (Polling), 10 Gb/sec (4X SDR), InfiniBand; on ibp3s0\n" in human
    assert "  rdma ibp4s0 port 1: ACTIVE (LinkUp), 400 Gb/sec (4X NDR), InfiniBand; no network interface\n" in human
    assert "  interface ibp3s0: down, speed -, mtu 4092, no address\n" in human
    data = json.loads(run("--config", str(config), "--json").stdout)
    assert [d["name"] for d in data["fabric"]["devices"]] == ["ibp3s0", "ibp4s0"]
    assert data["fabric"]["name"] is None

    (tmp_path / "inventory.json").write_text(json.dumps({"labels": {"fabric": "ib-east"}}))
    human = run("--config", str(config)).stdout
    assert "fabric       ib-east (label fabric; discovered: none discovered)\n" in human
