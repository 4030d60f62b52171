"""A private rootful podman service for the demo and the tests, with its own store under a folder.

`nexa demo --real` and the tests (tests/realparts.py wraps it as a fixture) build and push their images
through it (`nexa.localparts.images`); the node agent only ever uses its socket.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import time
from pathlib import Path
from typing import Final

import attrs

from nexa.errors import ConfigError, Unavailable
from nexa.localparts import http
from nexa.localparts.children import stop, unmount_below, wait_until

#: The source checkout's podman settings (runc, cgroupfs, file events, low rlimits: what a sandboxed CI
#: machine needs); absent from an installed package, where podman's own defaults apply.
PROJECT_CONTAINERS_CONF: Final = Path(__file__).resolve().parents[2] / ".ci" / "containers.conf"
PODMAN_START_TIMEOUT_S: Final = 30.0
PODMAN_STOP_TIMEOUT_S: Final = 15.0
#: How long a stopping podman store waits for conmon's `podman container cleanup` processes.
STORE_PROCESS_WAIT_S: Final = 15.0
#: sun_path is 108 bytes on Linux, including the terminating NUL.
MAX_SOCKET_PATH: Final = 107
#: podman refuses a longer --runroot.
MAX_RUNROOT: Final = 50


def project_containers_conf() -> Path | None:
    """`PROJECT_CONTAINERS_CONF` when this runs from a source checkout, else None (podman's defaults)."""
    return PROJECT_CONTAINERS_CONF if PROJECT_CONTAINERS_CONF.is_file() else None


def _wait_for_processes_naming(text: str, timeout_s: float) -> None:
    """Wait until no process (but this one) has `text` in its command line, for at most `timeout_s`.
    Only waits: it signals nothing."""
    needle = text.encode()
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not any(needle in cmdline for cmdline in _command_lines()):
            return
        time.sleep(0.1)


def _command_lines() -> list[bytes]:
    """Every other process's command line (those that end meanwhile, or that we may not read, left out)."""
    lines = []
    with os.scandir("/proc") as entries:
        for entry in entries:
            if not entry.name.isdigit() or int(entry.name) == os.getpid():
                continue
            try:
                with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                    lines.append(f.read())
            except OSError:
                continue
    return lines


@attrs.define
class LocalPodman:
    """A rootful `podman system service --time=0` on `base/podman.sock`, with its own store under `base`.

    `run(...)` is the podman CLI against the same store and settings (to build, push and clean up; the
    node agent only ever uses the socket).
    """

    base: Path
    containers_conf: Path | None = None
    proc: subprocess.Popen[bytes] | None = None

    @property
    def socket(self) -> str:
        return str(self.base / "podman.sock")

    @property
    def log(self) -> Path:
        return self.base / "service.log"

    @property
    def runroot(self) -> Path:
        """`base/run`, or where that is too long for podman, a folder in /run named by a hash of `base`."""
        inside = self.base / "run"
        if len(str(inside)) <= MAX_RUNROOT:
            return inside
        return Path("/run") / f"nexa-podman-{hashlib.sha256(str(self.base).encode()).hexdigest()[:12]}"

    @property
    def tmpdir(self) -> Path:
        """`base/tmp`, or beside a runroot kept in /run when `base` is long: podman's network helpers
        (slirp4netns, rootlessport) keep sockets there, and a long path makes a container's start
        hang instead of failing."""
        inside = self.base / "tmp"
        return inside if self.runroot.is_relative_to(self.base) else self.runroot / "tmp"

    @property
    def env(self) -> dict[str, str]:
        if self.containers_conf is None:
            return dict(os.environ)
        return {**os.environ, "CONTAINERS_CONF": str(self.containers_conf)}

    def argv(self, *args: str) -> list[str]:
        store = ("--root", str(self.base / "root"), "--runroot", str(self.runroot))
        return ["podman", *store, "--tmpdir", str(self.tmpdir), *args]

    def run(self, *args: str, check: bool = True, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        """`podman <args>` on this store; Unavailable (with its stderr) if it fails and `check`."""
        result = subprocess.run(
            self.argv(*args), env=self.env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
        if check and result.returncode != 0:
            raise Unavailable(f"podman {' '.join(args)} failed ({result.returncode}): {result.stderr[-2000:]}")
        return result

    def start(self) -> float:
        """Start the service; seconds until it answered. ConfigError without podman or root."""
        if shutil.which("podman") is None:
            raise ConfigError("podman is not installed")
        if os.geteuid() != 0:
            raise ConfigError("a private rootful podman service needs root")
        if len(self.socket) > MAX_SOCKET_PATH:
            raise ConfigError(f"socket path too long for AF_UNIX: {self.socket}")
        self.base.mkdir(parents=True, exist_ok=True)
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                self.argv("system", "service", "--time=0", f"unix://{self.socket}"),
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        return wait_until(self._answers, self.proc, "podman system service", self.log, PODMAN_START_TIMEOUT_S)

    def _answers(self) -> bool:
        return os.path.exists(self.socket) and http.answers("http://d/_ping", uds=self.socket)

    def stop(self) -> None:
        """Remove every container of this store (they outlive the service: conmon), stop the service and
        unmount what its store left mounted."""
        if self.proc is None:
            return
        try:
            self.run("rm", "--all", "--force", "--time", "0", check=False)
        finally:
            stop(self.proc, grace_s=PODMAN_STOP_TIMEOUT_S)
            self.release()

    def release(self) -> None:
        """Unmount what the store left mounted, and remove a runroot kept outside `base` (after the last
        `run`: each podman command makes it again).

        First wait (bounded) for the store's last podman processes: conmon runs `podman container
        cleanup` when a container exits, and that podman mounts the store's overlay home again. Unmounted
        before it ran, the overlay would be left mounted."""
        _wait_for_processes_naming(str(self.base), STORE_PROCESS_WAIT_S)
        unmount_below(self.base)
        if not self.runroot.is_relative_to(self.base):
            unmount_below(self.runroot)
            shutil.rmtree(self.runroot, ignore_errors=True)

    def push(self, local: str, remote: str, digest_dir: Path) -> str:
        """Push `local` to `remote` (a `host/repo:tag` on a plain-HTTP registry) and remove the local copy:
        `host/repo@sha256:…`, the digest the push reported."""
        digest_file = digest_dir / f"{local.rpartition('/')[2].replace(':', '-')}.digest"
        self.run("push", "--tls-verify=false", "--digestfile", str(digest_file), local, remote, timeout_s=600)
        self.run("rmi", local)
        digest = digest_file.read_text().strip()
        if not (digest.startswith("sha256:") and len(digest) == 71):
            raise Unavailable(f"podman push {remote} reported no digest: {digest!r}")
        return f"{remote.rpartition(':')[0]}@{digest}"
