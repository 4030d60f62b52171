"""The arm64 one-file executable (DGX Spark), built by builds/build-arm64.sh and run under emulation.

The build runs in a Debian 12 arm64 root under qemu-user-static (binfmt_misc); the root, its venv and
the binary itself are cached (the binary by a hash of the sources, see the script). Every check runs
the arm64 binary as an x86-64 host would through binfmt_misc: version, check-config and the
controller's /healthz (builds/smoke.sh), `nexa node inventory` on the GB10 fixtures, and an emulated
arm64 node enrolled with the amd64 controller of this test run, heartbeating over CurveZMQ and
serving a `sim` replica.

Set NEXA_ARM64_BINARY=/path/to/nexa-linux-arm64 to test an existing binary instead of building one.
Only 127.0.0.1 is used, and only processes started here are signalled, by their PID.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import trio

import nexa
from tests.conftest import FIXTURES
from tests.realparts import BuiltImages, S3Store
from tests.support.api import ok
from tests.support.cluster import SIM_ARGS, SimCluster, sim_cluster
from tests.support.models import registry_config

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
#: A cold build on a 2-core machine (debootstrap, then PyInstaller emulated; minutes more when the machine is busy).
BUILD_TIMEOUT_S = 3600
#: Everything is slower under emulation; a start of the one-file binary takes a few seconds.
EMULATED_START_S = 60
BINFMT_ENTRY = Path("/proc/sys/fs/binfmt_misc/qemu-aarch64")
#: The GB10 fixture's MemTotal (KiB).
GB10_MEMINFO = FIXTURES / "meminfo" / "gb10_dgx_spark.meminfo"
GB10_SMI = FIXTURES / "nvidia-smi" / "gb10_dgx_spark.csv"


@pytest.fixture(scope="session")
def arm64_binary() -> Iterator[Path]:
    """The built binary, with QEMU_LD_PREFIX set to the cached arm64 root for everything started here:
    qemu-aarch64 takes the binary's loader and libc from there (its children inherit it)."""
    given = os.environ.get("NEXA_ARM64_BINARY")
    if given:
        path = Path(given).resolve()
        if not os.access(path, os.X_OK):
            pytest.fail(f"NEXA_ARM64_BINARY={given} is not an executable file")
    else:
        proc = subprocess.run(
            ["bash", str(ROOT / "builds" / "build.sh"), "--arch", "arm64"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=BUILD_TIMEOUT_S,
            check=False,
        )
        if proc.returncode != 0:
            pytest.fail(
                f"builds/build.sh --arch arm64 exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
            )
        path = ROOT / "dist" / "nexa-linux-arm64"
        assert "needs glibc >= " in proc.stdout, proc.stdout
    # The script registered qemu-aarch64 (with F) when it was missing; the checks below rely on it.
    assert BINFMT_ENTRY.is_file(), f"{BINFMT_ENTRY} is missing: the arm64 binary cannot run here"
    assert "enabled" in BINFMT_ENTRY.read_text()
    root = subprocess.run(
        ["bash", str(ROOT / "builds" / "build-arm64.sh"), "--print-root"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert root.returncode == 0, root.stderr
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("QEMU_LD_PREFIX", root.stdout.strip())
        yield path


def _run(*argv: str, timeout: float = EMULATED_START_S) -> subprocess.CompletedProcess[str]:
    return subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout, check=False, cwd=ROOT)


def test_the_binary_is_an_aarch64_executable(arm64_binary: Path) -> None:
    head = arm64_binary.read_bytes()[:20]
    assert head[:4] == b"\x7fELF"
    assert head[4] == 2  # 64-bit
    assert head[18:20] == b"\xb7\x00"  # EM_AARCH64


def test_version_under_emulation(arm64_binary: Path) -> None:
    proc = _run(str(arm64_binary), "version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"nexa {nexa.__version__}\n"


def test_smoke_script_under_emulation(arm64_binary: Path) -> None:
    """builds/smoke.sh: version, check-config (good and bad files), `nexa control` answering /healthz, SIGTERM."""
    env = {**os.environ, "NEXA_SMOKE_START_TIMEOUT_S": str(EMULATED_START_S)}
    env.pop("NEXA_CONFIG", None)
    proc = subprocess.run(
        ["bash", str(ROOT / "builds" / "smoke.sh"), str(arm64_binary)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=EMULATED_START_S * 4,
        check=False,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "/healthz answered" in proc.stdout
    assert f"all checks passed for {arm64_binary}" in proc.stdout


def test_node_inventory_on_the_gb10_fixtures(arm64_binary: Path, tmp_path: Path) -> None:
    """`nexa node inventory` sees a DGX Spark: the GB10 nvidia-smi output, and the GB10 /proc/meminfo
    bind-mounted over the real one in a private mount namespace (the binary reads /proc/meminfo)."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\ncat '{GB10_SMI}'\n")
    smi.chmod(0o755)
    inventory = tmp_path / "inventory.json"
    inventory.write_text(json.dumps({"labels": {"board": "spark"}, "runtimes": ["llamacpp"]}))
    config = tmp_path / "node.toml"
    config.write_text(f'nvidia_smi = "{smi}"\ninventory_path = "{inventory}"\n')
    script = 'mount --bind "$1" /proc/meminfo && shift && exec "$@"'
    proc = _run(
        "unshare",
        "--mount",
        "--propagation",
        "private",
        "sh",
        "-c",
        script,
        "sh",
        str(GB10_MEMINFO),
        str(arm64_binary),
        "node",
        "inventory",
        "--config",
        str(config),
        "--json",
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    mem_total_kib = next(
        int(line.split()[1]) for line in GB10_MEMINFO.read_text().splitlines() if line.startswith("MemTotal:")
    )
    assert data["memory_total_bytes"] == mem_total_kib * 1024
    assert [g["name"] for g in data["gpus"]] == ["NVIDIA GB10"]
    assert data["gpus"][0]["unified_memory"] is True
    assert data["gpus"][0]["cdi_device"] == "nvidia.com/gpu=0"
    assert data["accelerator_memory_bytes"] == data["memory_total_bytes"]
    assert data["arch"] == "arm64"
    assert data["labels"] == {"board": "spark"} and data["runtimes"] == ["llamacpp"]


@pytest.fixture
async def arm64_cluster(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages, arm64_binary: Path
) -> AsyncIterator[SimCluster]:
    """This run's (amd64) controller with one emulated arm64 node: enrolled by the binary, then `nexa node`."""
    cfg = registry_config(tmp_path, s3_store)
    async with sim_cluster(nursery, tmp_path, cfg, s3_store, test_images, nodes=1, nexa=(str(arm64_binary),)) as c:
        yield c


async def test_an_emulated_arm64_node_enrolls_heartbeats_and_serves_a_sim_replica(arm64_cluster: SimCluster) -> None:
    cluster = arm64_cluster
    # The cluster waited for Ready, which comes with the node's inventory (Joining until then).
    async with cluster.client() as http:
        (node,) = (await ok(http.get("/api/v1/nodes")))["nodes"]
    assert node["state"] == "Ready"
    assert node["inventory"]["arch"] == "arm64"
    # Heartbeats keep coming over the CurveZMQ channel (every 0.3 s in the node's config).
    first = node["last_heartbeat_at"]
    with trio.fail_after(30):
        while True:
            await trio.sleep(0.5)
            async with cluster.client() as http:
                (again,) = (await ok(http.get("/api/v1/nodes")))["nodes"]
            if again["last_heartbeat_at"] != first:
                break
    # A `sim` replica placed on it (a `nexa sim-runtime` child of the emulated binary) answers.
    t0 = time.monotonic()
    # The agent passes its children only a few variables of its own environment; the deployment's env
    # carries QEMU_LD_PREFIX to the emulated child (on a Spark nothing of this is needed).
    body = {
        "name": "chat-arm64",
        "runtime": "sim",
        "alias": "chat",
        "replicas": 1,
        "resources": {"accelerators": 0, "memory_bytes": 64 * 2**20, "cpus": 0.5},
        "options": {"port": 18600, "command": SIM_ARGS, "env": {"QEMU_LD_PREFIX": os.environ["QEMU_LD_PREFIX"]}},
    }
    async with cluster.client() as http:
        await ok(http.post("/api/v1/deployments", json=body), 201)
    with trio.move_on_after(EMULATED_START_S):
        while not await cluster.ready_replicas("chat-arm64"):  # noqa: ASYNC110 - polling the API
            await trio.sleep(0.2)
    ready_s = time.monotonic() - t0
    if not await cluster.ready_replicas("chat-arm64"):
        async with cluster.client() as http:
            dep = await ok(http.get("/api/v1/deployments/chat-arm64"))
            nodes = await ok(http.get("/api/v1/nodes"))
        log = cluster.nodes[0].log
        tail = log.read_text(errors="replace")[-4000:] if log else ""
        pytest.fail(f"no Ready replica in {EMULATED_START_S} s:\n{json.dumps(dep)}\n{json.dumps(nodes)}\n{tail}")
    async with httpx.AsyncClient(
        base_url=cluster.controller.url, headers={"Authorization": f"Bearer {cluster.inference_key}"}, timeout=60
    ) as http:
        resp = await http.post(
            "/v1/chat/completions", json={"model": "chat", "messages": [{"role": "user", "content": "hello"}]}
        )
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["message"]["content"]
    assert ready_s < 60
