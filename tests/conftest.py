"""Shared fixtures: an in-process controller on a loopback port, and a controller subprocess.

Tests use 127.0.0.1 and port 0 (or a port the OS just handed out) only, and stop only the
processes they started.
"""

from __future__ import annotations

import contextlib
import http.server
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Iterator
from functools import partial
from pathlib import Path
from typing import IO

import attrs
import httpx
import pytest
import trio

from nexa.config import ChannelConfig, ControlConfig, HostPort, HttpConfig, NodesConfig
from nexa.contracts.node import DiscoveredHost, InventoryFile, NodeInventory, RuntimeKind
from nexa.contracts.runtime import ArtifactRef, HealthProbe, RuntimeSpec
from nexa.control.service import serve_control
from nexa.node.inventory import merge, parse_meminfo, parse_nvidia_smi_csv
from tests.support import llamabuild

pytest_plugins = ["tests.realparts"]

IN_CI = os.environ.get("CI") == "true"
FIXTURES = Path(__file__).parent / "fixtures"
#: Session fixtures that take 20 s or more to make: the arm64 binary (an emulated Debian root, pip and
#: PyInstaller), the llama-cpp-python image (its wheel), llama.cpp's and whisper.cpp's C++ servers
#: (builds of minutes on a fresh machine) and the signed release reports (a `nexa sim` run). A test that
#: uses one must be marked `slow`, so the fast lane (`-m "not slow"`) never starts them.
SLOW_FIXTURES = frozenset(
    {"arm64_binary", "llama_build", "llama_image", "llama_server_image", "signed_reports", "whisper_server_image"}
)
#: Those that need llama.cpp's build (`.ci/dev` may still be making it: `tests.support.llamabuild`).
LLAMA_FIXTURES = frozenset({"llama_build", "llama_image", "llama_server_image"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    unmarked = [
        item.nodeid
        for item in items
        if SLOW_FIXTURES & set(getattr(item, "fixturenames", ())) and item.get_closest_marker("slow") is None
    ]
    if unmarked:
        raise pytest.UsageError(
            f"mark these tests `slow`, each uses a fixture that takes 20 s or more "
            f"({', '.join(sorted(SLOW_FIXTURES))}): {', '.join(unmarked)}"
        )
    if os.environ.get("PYTEST_XDIST_WORKER"):
        _heaviest_modules_first(items)


def _heaviest_modules_first(items: list[pytest.Item]) -> None:
    """Under pytest-xdist, whole modules in the order: those using a build of minutes, then those with
    `slow` tests, then the rest (each module's own order kept). The builds then start at once, beside
    other tests, and the run does not end waiting on one long test a worker took last. While `.ci/dev`
    builds llama.cpp in the background (`tests.support.llamabuild`), the modules that need it go last
    instead, so the tests run beside that build rather than wait for it. Every worker sorts the same
    way, as xdist requires."""
    building = llamabuild.building()
    weights: dict[str, set[int]] = {}
    for item in items:
        fixtures = set(getattr(item, "fixturenames", ()))
        if building and LLAMA_FIXTURES & fixtures:
            weight = 3
        elif SLOW_FIXTURES & fixtures:
            weight = 0
        elif item.get_closest_marker("slow") is not None:
            weight = 1
        else:
            weight = 2
        weights.setdefault(item.nodeid.partition("::")[0], set()).add(weight)
    rank = {module: 3 if 3 in found else min(found) for module, found in weights.items()}
    items.sort(key=lambda item: rank[item.nodeid.partition("::")[0]])


def gb10_inventory(hostname: str = "spark-1") -> NodeInventory:
    """A DGX Spark's inventory, built from the recorded nvidia-smi and meminfo fixtures."""
    memory = parse_meminfo((FIXTURES / "meminfo" / "gb10_dgx_spark.meminfo").read_text())
    host = DiscoveredHost(
        hostname=hostname,
        arch="arm64",
        cpu_count=20,
        memory_total_bytes=memory.total_bytes,
        memory_available_bytes=memory.available_bytes,
        gpus=tuple(parse_nvidia_smi_csv((FIXTURES / "nvidia-smi" / "gb10_dgx_spark.csv").read_text())),
        discovered_at=time.time(),
    )
    return merge(host, InventoryFile())


def require_tool(name: str) -> str:
    """The path of a real tool the test needs; in CI its absence is a failure, never a skip."""
    path = shutil.which(name)
    if path is None:
        if IN_CI:
            pytest.fail(f"{name} is required in CI but is not installed")
        pytest.skip(f"{name} is not installed")
    return path


@attrs.frozen
class Controller:
    url: str
    admin_key: str
    state_dir: Path
    stopping: trio.Event

    def client(self, key: str | None = None) -> httpx.AsyncClient:
        headers = {"Authorization": f"Bearer {key or self.admin_key}"}
        return httpx.AsyncClient(base_url=self.url, headers=headers, timeout=10)


def local_config(tmp_path: Path | str, **nodes: float) -> ControlConfig:
    """A controller config on 127.0.0.1 with OS-chosen ports for HTTP and the node channel."""
    return ControlConfig(
        state_dir=str(Path(tmp_path) / "state"),
        http=HttpConfig(listen=HostPort("127.0.0.1:0")),
        channel=ChannelConfig(listen="tcp://127.0.0.1:*"),
        nodes=attrs.evolve(NodesConfig(), **nodes),
    )


async def start_controller(nursery: trio.Nursery, cfg: ControlConfig, admin_key: str | None = None) -> Controller:
    """Start `serve_control(cfg)` in `nursery`; set `.stopping` to stop it. `admin_key`: a restart's key."""
    stopping = trio.Event()
    with trio.fail_after(15):
        started = await nursery.start(partial(serve_control, cfg, stopping=stopping))
    key = started.admin_key or admin_key
    assert key is not None
    return Controller(url=started.urls[0], admin_key=key, state_dir=Path(cfg.state_dir), stopping=stopping)


@pytest.fixture
async def controller(nursery: trio.Nursery, tmp_path: Path) -> AsyncIterator[Controller]:
    """A real controller (hypercorn, quart-trio, apsw, zmq) serving on 127.0.0.1 in this test's trio run."""
    started = await start_controller(nursery, local_config(tmp_path))
    yield started
    started.stopping.set()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


#: Where `free_channel_port` looks: below Linux's default ephemeral range (32768-60999), which the
#: kernel never hands to a connection's local end.
_CHANNEL_PORTS = range(20000, 32000, 2)


def free_channel_port(span: int = 2) -> int:
    """A channel port `p` with `p + 1` free too, outside the ephemeral range: a key rotation serves
    its new Curve key on `p + 1` (`rotation_listen`'s default). `free_port`'s `p + 1` is an
    ephemeral port, which any outgoing connection on the host (the test's own HTTP request to the
    controller among them) may be using when the rotation binds it. `span`: the ports from `p` on
    that must be free (`[http] workers = N` serves worker i's channel on `p + 2i`: 2N)."""
    for port in random.sample(_CHANNEL_PORTS, len(_CHANNEL_PORTS)):
        with contextlib.ExitStack() as held:
            try:
                for each in range(port, port + span):
                    s = held.enter_context(socket.socket())
                    s.bind(("127.0.0.1", each))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no {span} adjacent free ports below the ephemeral range on 127.0.0.1")


@attrs.define
class ControllerProcess:
    """`python -m nexa control` as a separate process (what an operator runs)."""

    state_dir: Path
    port: int
    channel_port: int = attrs.field(factory=free_channel_port)
    proc: subprocess.Popen[str] | None = None
    admin_key: str | None = None
    stderr_path: Path | None = None
    _files: list[IO[str]] = attrs.field(factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, *extra: str, timeout_s: float = 20) -> None:
        self.stderr_path = self.state_dir.parent / f"control-{time.monotonic_ns()}.log"
        stderr = self.stderr_path.open("w")
        self._files.append(stderr)
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "nexa",
                "control",
                "--state-dir",
                str(self.state_dir),
                "--listen",
                f"127.0.0.1:{self.port}",
                "--channel",
                f"tcp://127.0.0.1:{self.channel_port}",
                *extra,
            ],
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if not line:
                break
            if "NEXA_TOKEN=" in line:
                self.admin_key = line.strip().split("=", 1)[1]
            if "listening on" in line:
                return
        raise AssertionError(f"controller did not start: {self.stderr_path.read_text()[-2000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        code = self.proc.wait(timeout=timeout_s)
        self.close_files()
        return code

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.close_files()

    def close_files(self) -> None:
        if self.proc is not None and self.proc.stdout:
            self.proc.stdout.close()
        for f in self._files:
            f.close()
        self._files.clear()

    def cli(self, *args: str, token: str | None = None, check: bool = False) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "NEXA_URL": self.url, "NEXA_TOKEN": token or self.admin_key or ""}
        return subprocess.run(
            [sys.executable, "-m", "nexa", *args], env=env, capture_output=True, text=True, timeout=60, check=check
        )


@contextlib.contextmanager
def running_controller(tmp_path: Path, config: str | None = None) -> Iterator[ControllerProcess]:
    """`nexa control` in its own process for the `with` block, reading `config` (TOML) when given."""
    extra: tuple[str, ...] = ()
    if config is not None:
        (config_file := tmp_path / "control.toml").write_text(config)
        extra = ("--config", str(config_file))
    cp = ControllerProcess(state_dir=tmp_path / "state", port=free_port())
    try:
        cp.start(*extra)
        yield cp
    finally:
        cp.kill()


@pytest.fixture
def controller_process(tmp_path: Path) -> Iterator[ControllerProcess]:
    with running_controller(tmp_path) as cp:
        yield cp


def sample_runtime(port: int = 18300, digest: str = "0" * 64) -> RuntimeSpec:
    """A realistic llama.cpp runtime spec (image pinned by digest, artifact by sha256)."""
    return RuntimeSpec(
        kind=RuntimeKind.LLAMACPP,
        image=f"127.0.0.1:5000/nexa/llamacpp@sha256:{digest}",
        command=["python3", "-m", "llama_cpp.server", "--model", "/models/model", "--port", str(port)],
        port=port,
        artifact=ArtifactRef(uri="s3://models/tiny.gguf", sha256="1" * 64, size_bytes=9_000_000),
        gpus=["nvidia.com/gpu=0"],
        memory_bytes=2 << 30,
        cpus=2.0,
        health=HealthProbe(
            command=["python3", "-c", f"import urllib.request as u; u.urlopen('http://127.0.0.1:{port}/v1/models')"]
        ),
    )


@contextlib.contextmanager
def serving_http(handler: type[http.server.BaseHTTPRequestHandler], host: str = "127.0.0.1") -> Iterator[str]:
    """A threaded stdlib HTTP server with `handler` on `host` (a loopback address: a fake peer); yields its URL."""
    server = http.server.ThreadingHTTPServer((host, 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://{host}:{server.server_address[1]}"
    finally:
        server.shutdown()
        thread.join()
        server.server_close()
