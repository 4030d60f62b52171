"""Node figures stay live: a `nexa node` process and a `nexa control` process, driven only by files the
node reads and the controller's own interfaces.

The node finds `nvidia-smi` on its PATH: a script that prints a file holding a real H200's answer
(tests/fixtures/nvidia-smi/h200_141g_x1.csv, recorded from real nvidia-smi), which the test then
rewrites with that answer's utilisation, temperature, power and memory columns changed, the way the
card's figures move under load. Its meminfo is a recorded /proc/meminfo (tests/fixtures/meminfo) copied
to a file the test rewrites (`[node] meminfo_path`: the fault injection). The changed figures reach the
controller's `/metrics` and `nexa nodes show`; a hung nvidia-smi is killed, counted and its last figures
kept, marked stale.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import FIXTURES, ControllerProcess
from tests.support.api import wait_until
from tests.support.console import csrf

H200 = (FIXTURES / "nvidia-smi" / "h200_141g_x1.csv").read_text()
MEMINFO = (FIXTURES / "meminfo" / "h100_dgx_2t.meminfo").read_text()
GIB = 1024**3
MIB = 1024**2


def h200_reading(*, used_mib: int, utilization: int, temperature: int, power_w: float) -> str:
    """The recorded H200 answer with its load columns changed (total stays; free follows used)."""
    cells = [c.strip() for c in H200.strip().split(",")]
    total = int(cells[3])
    cells[4], cells[5] = str(used_mib), str(total - used_mib)
    cells[6], cells[7], cells[8] = str(utilization), str(temperature), f"{power_w:.2f}"
    return ", ".join(cells) + "\n"


def meminfo_with(available_bytes: int) -> str:
    line = f"MemAvailable:   {available_bytes // 1024} kB"
    return re.sub(r"^MemAvailable:\s+\d+ kB$", line, MEMINFO, flags=re.M)


def replace(path: Path, text: str) -> None:
    staging = path.with_suffix(".new")
    staging.write_text(text)
    staging.replace(path)


def metric(text: str, name: str, **labels: str) -> float | None:
    """The value of one sample of `name` whose labels include `labels`, from exposition text."""
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        head, _, value = line.rpartition(" ")
        if all(f'{k}="{v}"' in head for k, v in labels.items()):
            return float(value)
    return None


@contextlib.contextmanager
def running_node(
    cp: ControllerProcess, tmp_path: Path, name: str, answer: str, meminfo_text: str, extra: str = ""
) -> Iterator[dict[str, Path]]:
    """`nexa node` enrolled as `name`, its nvidia-smi on PATH printing `answer` (a file the test may
    rewrite; `hang` makes it hang), its meminfo the file `meminfo`; killed at the end."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    reading, meminfo, hang = tmp_path / "reading.csv", tmp_path / "meminfo", tmp_path / "hang"
    reading.write_text(answer)
    meminfo.write_text(meminfo_text)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(
        "#!/bin/sh\n"
        f'if [ -e "{hang}" ]; then exec sleep 60; fi\n'
        'case "$1" in --query-compute-apps=*) exit 0;; esac\n'  # no compute processes
        f'exec cat "{reading}"\n'
    )
    smi.chmod(0o755)
    state_dir = tmp_path / "node"
    config = tmp_path / "node.toml"
    config.write_text(
        f'state_dir = "{state_dir}"\ninventory_path = "{tmp_path / "inventory.json"}"\n'
        f'meminfo_path = "{meminfo}"\ndiscovery_interval_s = 0.3\nheartbeat_interval_s = 0.3\n'
        f'source_address = "127.0.0.1"\nreconnect_max_s = 1\n{extra}'
    )
    token = json.loads(cp.cli("tokens", "create", "--ttl", "15m", "--json", check=True).stdout)["token"]
    enrolled = cp.cli(
        "node", "enroll", "--controller", cp.url, "--token", token, "--name", name, "--state-dir", str(state_dir)
    )
    assert enrolled.returncode == 0, enrolled.stderr
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}"}
    log = tmp_path / "node.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "nexa", "node", "--config", str(config)], stdout=out, stderr=out, env=env
        )
    try:
        yield {"reading": reading, "meminfo": meminfo, "hang": hang, "log": log}
    finally:
        hang.unlink(missing_ok=True)
        proc.kill()
        proc.wait(timeout=30)


@pytest.fixture
def live_node(controller_process: ControllerProcess, tmp_path: Path) -> Iterator[dict[str, Path]]:
    with running_node(controller_process, tmp_path, "h200-1", H200, meminfo_with(1500 * GIB)) as files:
        yield files


def scraper(cp: ControllerProcess) -> Callable[[], str]:
    key = json.loads(cp.cli("keys", "create", "--role", "monitoring", "--json", check=True).stdout)["key"]

    def scrape() -> str:
        got = httpx.get(f"{cp.url}/metrics", headers={"Authorization": f"Bearer {key}"}, timeout=10, trust_env=False)
        assert got.status_code == 200
        return got.text

    return scrape


@pytest.mark.slow
def test_changed_nvidia_smi_and_meminfo_readings_reach_metrics_and_nodes_show(
    controller_process: ControllerProcess, live_node: dict[str, Path]
) -> None:
    cp = controller_process
    scrape = scraper(cp)

    gpu = {"node": "h200-1", "gpu": "0", "model": "NVIDIA H200"}
    # The first reading: the recorded, idle H200 and 1500 GiB available.
    wait_until(lambda: metric(scrape(), "nexa_gpu_temperature_celsius", **gpu) == 36.0, "the recorded reading")
    assert metric(scrape(), "nexa_node_memory_available_bytes", node="h200-1") == 1500 * GIB

    # Under load: the card's figures and the host's MemAvailable move.
    replace(live_node["reading"], h200_reading(used_mib=100_000, utilization=97, temperature=71, power_w=612.5))
    replace(live_node["meminfo"], meminfo_with(900 * GIB))

    def moved() -> bool:
        text = scrape()
        return (
            metric(text, "nexa_gpu_utilization_ratio", **gpu) == 0.97
            and metric(text, "nexa_gpu_temperature_celsius", **gpu) == 71.0
            and metric(text, "nexa_gpu_power_watts", **gpu) == 612.5
            and metric(text, "nexa_gpu_memory_used_bytes", **gpu) == 100_000 * MIB
            and metric(text, "nexa_node_memory_available_bytes", node="h200-1") == 900 * GIB
        )

    wait_until(moved, "the changed readings in /metrics", timeout_s=30)
    shown = cp.cli("nodes", "show", "h200-1", check=True).stdout
    assert "utilization 97 %" in shown and "71 °C" in shown and "612.5 W" in shown
    assert "(free 900.0 GiB)" in shown
    assert metric(scrape(), "nexa_node_gpu_figures_stale", node="h200-1") == 0.0

    # nvidia-smi hangs: it is killed at its timeout (10 s), counted, and the last figures stay, marked stale;
    # meminfo is still read.
    live_node["hang"].touch()
    replace(live_node["meminfo"], meminfo_with(800 * GIB))
    # A discovery round that read meminfo just before it changed may be the one whose nvidia-smi hangs:
    # the new MemAvailable then comes with the round after it, still beside the stale GPU figures.
    wait_until(
        lambda: (
            metric(text := scrape(), "nexa_node_gpu_figures_stale", node="h200-1") == 1.0
            and metric(text, "nexa_node_memory_available_bytes", node="h200-1") == 800 * GIB
        ),
        "the GPU figures marked stale, and meminfo still read",
        timeout_s=40,
    )
    text = scrape()
    assert (metric(text, "nexa_node_nvidia_smi_timeouts", node="h200-1") or 0) >= 1
    assert metric(text, "nexa_gpu_temperature_celsius", **gpu) == 71.0
    assert metric(text, "nexa_node_gpu_figures_stale", node="h200-1") == 1.0
    assert metric(text, "nexa_node_memory_available_bytes", node="h200-1") == 800 * GIB
    shown = cp.cli("nodes", "show", "h200-1", check=True).stdout
    assert "figures are stale: nvidia-smi stopped answering" in shown
    assert "nvidia-smi did not answer within 10 s" in shown


GB10 = (FIXTURES / "nvidia-smi" / "gb10_dgx_spark.csv").read_text()
GB10_MEMINFO = (FIXTURES / "meminfo" / "gb10_dgx_spark.meminfo").read_text()


@pytest.mark.slow
def test_a_spark_under_its_memory_floor_reports_pressure_until_it_is_gone(
    controller_process: ControllerProcess, tmp_path: Path
) -> None:
    """A DGX Spark (the recorded GB10 answer and meminfo) whose MemAvailable falls under `[memory]
    pressure_floor_bytes`: the controller shows the pressure (/metrics, `nexa nodes show`, the audit)
    until MemAvailable is back above the floor."""
    cp = controller_process
    scrape = scraper(cp)

    def spark_meminfo(available_bytes: int) -> str:
        line = f"MemAvailable:   {available_bytes // 1024} kB"
        return re.sub(r"^MemAvailable:\s+\d+ kB$", line, GB10_MEMINFO, flags=re.M)

    extra = f"[memory]\npressure_floor_bytes = {8 * GIB}\n"
    with running_node(cp, tmp_path, "spark-1", GB10, spark_meminfo(100 * GIB), extra) as files:
        wait_until(lambda: metric(scrape(), "nexa_node_memory_pressure", node="spark-1") == 0.0, "no pressure")
        replace(files["meminfo"], spark_meminfo(3 * GIB))
        wait_until(lambda: metric(scrape(), "nexa_node_memory_pressure", node="spark-1") == 1.0, "the pressure")
        assert metric(scrape(), "nexa_node_memory_pressure_floor_bytes", node="spark-1") == 8 * GIB
        shown = cp.cli("nodes", "show", "spark-1", check=True).stdout
        assert (
            "pressure     memory pressure: MemAvailable 3.00 GiB is under the node's floor of 8.00 GiB; "
            "nothing more is placed here until it is gone"
        ) in shown
        audit = cp.cli("audit", "list", "--json", check=True).stdout
        assert "node.memory_pressure" in audit
        # The console's nodes page says it too.
        with httpx.Client(base_url=cp.url, trust_env=False, timeout=10) as http:
            form = http.get("/console/login")
            assert cp.admin_key is not None
            signed = http.post("/console/login", data={"csrf_token": csrf(form.text), "api_key": cp.admin_key})
            assert signed.status_code == 303
            page = http.get("/console/nodes")
        assert page.status_code == 200, page.text[:300]
        assert "data-memory-pressure>memory pressure: MemAvailable 3.00 GiB is under" in page.text
        replace(files["meminfo"], spark_meminfo(50 * GIB))
        wait_until(lambda: metric(scrape(), "nexa_node_memory_pressure", node="spark-1") == 0.0, "the pressure gone")
        assert "pressure     " not in cp.cli("nodes", "show", "spark-1", check=True).stdout
        assert "node.memory_pressure_cleared" in cp.cli("audit", "list", "--json", check=True).stdout


SPARK_SYSFS = FIXTURES / "sysfs" / "dgx-spark"


def _spark_sysfs_on_loopback(tmp_path: Path) -> Path:
    """The DGX Spark fixture tree (tests/fixtures/sysfs/README.md) with its first ConnectX-7 function's
    netdev renamed to this host's `lo`, so that its address comes from the kernel, as on a Spark."""
    root = tmp_path / "sys"
    shutil.copytree(SPARK_SYSFS, root)
    dev = root / "class/infiniband/rocep1s0f0"
    (dev / "device/net/enp1s0f0np0").rename(dev / "device/net/lo")
    (dev / "ports/1/gid_attrs/ndevs/0").write_text("lo\n")
    (root / "class/net/enp1s0f0np0").rename(root / "class/net/lo")
    return root


def _console_nodes_page(cp: ControllerProcess) -> str:
    with httpx.Client(base_url=cp.url, trust_env=False, timeout=10) as http:
        form = http.get("/console/login")
        assert cp.admin_key is not None
        signed = http.post("/console/login", data={"csrf_token": csrf(form.text), "api_key": cp.admin_key})
        assert signed.status_code == 303
        page = http.get("/console/nodes")
    assert page.status_code == 200, page.text[:300]
    return page.text


@pytest.mark.slow
def test_the_fabric_a_node_discovers_reaches_nodes_show_the_api_and_the_console(
    controller_process: ControllerProcess, tmp_path: Path
) -> None:
    """A real `nexa node` reads a Spark's sysfs (`[node] sysfs_path`) and the kernel's addresses; its
    heartbeats carry the fabric to a real `nexa control`; a port going down and the `fabric` label in
    its inventory.json reach `nexa nodes show`, `GET /api/v1/nodes/{id}` and the console."""
    cp = controller_process
    sysfs = _spark_sysfs_on_loopback(tmp_path)
    extra = f'sysfs_path = "{sysfs}"\n'
    with running_node(cp, tmp_path, "spark-1", GB10, GB10_MEMINFO, extra) as files:

        def view() -> dict[str, Any]:
            return dict(json.loads(cp.cli("nodes", "show", "spark-1", "--json", check=True).stdout))

        def fabric_is(name: str | None) -> bool:
            v = view()
            return v["inventory"] is not None and v["fabric"] == name

        wait_until(lambda: fabric_is("ipv4:127.0.0.0/8"), "the discovered fabric in the node's view")
        reported = view()["inventory"]["fabric"]
        assert (reported["name"], reported["address"]) == ("ipv4:127.0.0.0/8", "127.0.0.1")
        assert [d["name"] for d in reported["devices"]] == ["roceP2p1s0f0", "roceP2p1s0f1", "rocep1s0f0", "rocep1s0f1"]
        lo = next(i for i in reported["interfaces"] if i["name"] == "lo")
        assert lo["addresses"][0] == "127.0.0.1/8" and lo["mtu"] == 9000 and lo["speed_mbps"] == 200000
        shown = cp.cli("nodes", "show", "spark-1", check=True).stdout
        assert "fabric       ipv4:127.0.0.0/8 at 127.0.0.1\n" in shown
        assert "  rdma rocep1s0f0 port 1: ACTIVE (LinkUp), 200 Gb/sec (4X HDR), Ethernet; on lo\n" in shown
        assert "  rdma roceP2p1s0f0 port 1: DOWN (Disabled), 40 Gb/sec (4X QDR), Ethernet; on enP2p1s0f0np0\n" in shown
        assert "  interface enP2p1s0f0np0: down, speed -, mtu 1500, no address\n" in shown
        page = _console_nodes_page(cp)
        assert "<strong>ipv4:127.0.0.0/8</strong> at 127.0.0.1" in page
        assert 'data-rdma-port="rocep1s0f0/1">rocep1s0f0/1: ACTIVE, 200 Gb/sec (4X HDR), Ethernet on lo' in page

        # The cable is pulled: at the next discovery the port is down and no fabric is discovered.
        replace(sysfs / "class/infiniband/rocep1s0f0/ports/1/state", "1: DOWN\n")
        wait_until(lambda: fabric_is(None), "the fabric gone with its port")
        shown = cp.cli("nodes", "show", "spark-1", check=True).stdout
        assert "fabric       - (no ACTIVE RDMA port on an interface with an address)\n" in shown
        assert "  rdma rocep1s0f0 port 1: DOWN (LinkUp)" in shown

        # The host names its fabric itself (the admin set no `fabric` label): the label wins.
        replace(sysfs / "class/infiniband/rocep1s0f0/ports/1/state", "4: ACTIVE\n")
        (tmp_path / "inventory.json").write_text(json.dumps({"labels": {"fabric": "spark-pair-a"}}))
        wait_until(lambda: fabric_is("spark-pair-a") and view()["inventory"]["fabric"]["name"], "the label's fabric")
        shown = cp.cli("nodes", "show", "spark-1", check=True).stdout
        assert "fabric       spark-pair-a (label fabric; discovered: ipv4:127.0.0.0/8 at 127.0.0.1)\n" in shown
        page = _console_nodes_page(cp)
        assert "<strong>spark-pair-a</strong><br><small>label; discovered ipv4:127.0.0.0/8 at 127.0.0.1</small>" in page
        assert files["log"].exists()
