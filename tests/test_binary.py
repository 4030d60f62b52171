"""The PyInstaller one-file executable, built by builds/build.sh and run as a user would run it.

The build runs once per session (about a minute; the first one also creates the runtime venv).
Set NEXA_BINARY=/path/to/nexa to test an existing binary instead of building one.
Only 127.0.0.1 is used, and only processes started here are signalled, by their PID.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import attrs
import pytest

import nexa
from nexa import docs

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
BUILD_TIMEOUT_S = 1200
#: Generous: a loaded 2-core machine unpacks and starts the one-file binary slowly.
START_TIMEOUT_S = 60.0
#: Above the default http.graceful_timeout_s (10 s), like the units' TimeoutStopSec.
STOP_TIMEOUT_S = 30.0


@pytest.fixture(scope="session")
def nexa_binary() -> Path:
    given = os.environ.get("NEXA_BINARY")
    if given:
        path = Path(given).resolve()
        if not os.access(path, os.X_OK):
            pytest.fail(f"NEXA_BINARY={given} is not an executable file")
        return path
    proc = subprocess.run(
        ["bash", str(ROOT / "builds" / "build.sh")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=BUILD_TIMEOUT_S,
        check=False,
    )
    if proc.returncode != 0:
        pytest.fail(f"builds/build.sh exited {proc.returncode}:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    path = ROOT / "dist" / "nexa"
    assert os.access(path, os.X_OK), proc.stdout[-2000:]
    return path


def _run(binary: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(binary), *args], capture_output=True, text=True, timeout=60, check=False, cwd=ROOT, env=env
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _get(url: str, timeout: float = 2.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read()


@attrs.define
class Controller:
    proc: subprocess.Popen[bytes]
    url: str
    out: Path
    err: Path

    def stdout(self) -> str:
        return self.out.read_text(encoding="utf-8", errors="replace")

    def stderr(self) -> str:
        return self.err.read_text(encoding="utf-8", errors="replace")

    def wait_healthy(self) -> None:
        """Poll /healthz until it answers 200; fail if the process exits or START_TIMEOUT_S passes."""
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(f"the controller exited {self.proc.returncode} before /healthz:\n{self.stderr()}")
            try:
                status, _ = _get(self.url + "/healthz", timeout=1.0)
            except OSError:
                status = 0
            if status == 200:
                return
            time.sleep(0.05)
        pytest.fail(f"no /healthz 200 within {START_TIMEOUT_S} s:\n{self.stderr()}")

    def stop(self) -> int:
        """SIGTERM, then wait for the graceful exit; return the exit code."""
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"the controller did not exit within {STOP_TIMEOUT_S} s of SIGTERM:\n{self.stderr()}")


@contextmanager
def _controller(binary: Path, state_dir: Path, logs: Path, tmpdir: Path) -> Iterator[Controller]:
    """Start `nexa control` on free loopback ports; SIGKILL it (by PID) if it still runs at the end."""
    port = _free_port()
    logs.mkdir(parents=True, exist_ok=True)
    out, err = logs / "stdout", logs / "stderr"
    # The one-file binary unpacks itself under $TMPDIR; a private one lets the test see the cleanup.
    env = {**os.environ, "TMPDIR": str(tmpdir)}
    env.pop("NEXA_CONFIG", None)
    args = [
        str(binary),
        "control",
        "--state-dir",
        str(state_dir),
        "--listen",
        f"127.0.0.1:{port}",
        "--channel",
        "tcp://127.0.0.1:*",
    ]
    with out.open("wb") as out_f, err.open("wb") as err_f:
        # Its own process group: the one-file binary runs the program in a child of its bootloader,
        # which a SIGKILL to the bootloader alone would leave running.
        proc = subprocess.Popen(
            args, stdout=out_f, stderr=err_f, stdin=subprocess.DEVNULL, cwd=ROOT, env=env, start_new_session=True
        )
    try:
        yield Controller(proc=proc, url=f"http://127.0.0.1:{port}", out=out, err=err)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # the group: gone already after a clean stop
        proc.wait(timeout=STOP_TIMEOUT_S)


def test_version(nexa_binary: Path) -> None:
    proc = _run(nexa_binary, "version")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"nexa {nexa.__version__}\n"


def test_the_manual_ships_in_the_binary(nexa_binary: Path, tmp_path: Path) -> None:
    """`nexa docs` reads the topics bundled in the binary, not the source tree (run from elsewhere)."""
    proc = subprocess.run(
        [str(nexa_binary), "docs", "config"], capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == docs.topic("config").text
    listing = subprocess.run(
        [str(nexa_binary), "docs"], capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path
    )
    assert listing.returncode == 0 and all(f"  {name} " in listing.stdout for name in docs.TOPICS)
    unknown = _run(nexa_binary, "docs", "nope")
    assert unknown.returncode == 2 and "nexa docs TOPIC" in unknown.stderr


@pytest.mark.parametrize(("path", "role"), [("units/control.toml", ()), ("units/node.toml", ("--role", "node"))])
def test_check_config_accepts_the_examples(nexa_binary: Path, path: str, role: tuple[str, ...]) -> None:
    proc = _run(nexa_binary, "check-config", *role, path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"{path}: ok" + ("" if role else " (control config)")  # no --role: found


def test_check_config_names_every_unknown_key(nexa_binary: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('colour = "blue"\n[http]\nlisten = "127.0.0.1:8470"\nmax_body_byte = 10\n', encoding="utf-8")
    proc = _run(nexa_binary, "check-config", str(bad))
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert "colour" in proc.stderr
    assert "max_body_byte" in proc.stderr
    assert proc.stdout == ""


def test_controller_starts_serves_and_stops_on_sigterm(nexa_binary: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()

    with _controller(nexa_binary, state, tmp_path / "run1", tmpdir) as ctl:
        ctl.wait_healthy()
        out = ctl.stdout()
        assert f"listening on {ctl.url}" in out
        assert "  NEXA_TOKEN=nxk_" in out  # first start: the bootstrap admin key, once
        status, _ = _get(ctl.url + "/readyz")
        assert status == 200
        status, body = _get(ctl.url + "/version")
        assert status == 200
        info = json.loads(body)
        assert info["version"] == nexa.__version__
        assert info["epoch"] == 1
        # The console's templates, its own files and the vendored libraries are in the binary.
        status, body = _get(ctl.url + "/console/login")
        assert status == 200 and b"<form" in body
        for name in ("console.css", "vendor/htmx.min.js", "vendor/uPlot.iife.min.js"):
            status, body = _get(f"{ctl.url}/console/static/{name}")
            assert status == 200 and body, name
        # The manual is in the binary too, and the console renders it (markdown-it-py bundled).
        status, body = _get(ctl.url + "/console/docs/metrics")
        assert status == 200 and b'<h1 id="metrics-and-alerts">Metrics and alerts</h1>' in body
        assert ctl.stop() == 0
        # Logs are JSON lines on stderr: nothing else (no traceback, no warning) may appear there.
        lines = ctl.stderr().splitlines()
        assert lines
        for line in lines:
            assert isinstance(json.loads(line), dict), line
    # The bootloader removes its _MEI* unpack folder on a clean exit after SIGTERM.
    assert list(tmpdir.iterdir()) == []

    with _controller(nexa_binary, state, tmp_path / "run2", tmpdir) as ctl:
        ctl.wait_healthy()
        status, body = _get(ctl.url + "/version")
        assert status == 200
        assert json.loads(body)["epoch"] == 2  # a new epoch on every start of the same state dir
        assert "NEXA_TOKEN" not in ctl.stdout()  # the admin key exists already: never shown again
        assert ctl.stop() == 0


def test_second_controller_on_the_same_state_dir_is_refused(nexa_binary: Path, tmp_path: Path) -> None:
    state = tmp_path / "state"
    tmpdir = tmp_path / "tmp"
    tmpdir.mkdir()
    with _controller(nexa_binary, state, tmp_path / "first", tmpdir) as first:
        first.wait_healthy()
        with _controller(nexa_binary, state, tmp_path / "second", tmpdir) as second:
            try:
                code = second.proc.wait(timeout=START_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                pytest.fail("a second controller on a locked state dir kept running")
            assert code != 0
            message = second.stdout() + second.stderr()
            assert str(state) in message
        # The refused start did not disturb the running controller.
        status, _ = _get(first.url + "/healthz")
        assert status == 200
        assert first.stop() == 0
