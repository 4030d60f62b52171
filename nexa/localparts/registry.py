"""A local OCI registry: Debian's `docker-registry` (CNCF distribution), plain HTTP on 127.0.0.1."""

from __future__ import annotations

import hashlib
import json
import shutil
import subprocess
from pathlib import Path
from typing import Final

import attrs

from nexa.errors import ConfigError
from nexa.localparts import http
from nexa.localparts.children import free_ports, stop, wait_until

REGISTRY_START_TIMEOUT_S: Final = 30.0
OCI_MANIFEST: Final = "application/vnd.oci.image.manifest.v1+json"
OCI_CONFIG: Final = "application/vnd.oci.image.config.v1+json"


def registry_config(host: str, data_dir: Path) -> str:
    """`docker-registry serve` configuration: plain HTTP on `host`, filesystem storage, deletes allowed."""
    return (
        "version: 0.1\n"
        "log: {level: warn, accesslog: {disabled: true}}\n"
        f"storage: {{filesystem: {{rootdirectory: {data_dir}}}, delete: {{enabled: true}}}}\n"
        f"http: {{addr: {host}}}\n"
    )


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
        wait_until(lambda: http.answers(f"{self.url}/v2/"), self.proc, "docker-registry", log, REGISTRY_START_TIMEOUT_S)

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
        digest = http.push_image(self.url, repository, config_bytes, manifest, OCI_MANIFEST)
        return f"{self.host}/{repository}@{digest or 'sha256:' + hashlib.sha256(manifest).hexdigest()}"
