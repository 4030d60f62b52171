"""OCI documents built by hand (config blobs, manifests, indexes) and pushed to a plain-HTTP registry."""

from __future__ import annotations

import hashlib
import json

import httpx

from nexa.oci import OCI_INDEX, OCI_MANIFEST
from tests.support.api import Json

OCI_CONFIG = "application/vnd.oci.image.config.v1+json"


def sha(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def config_blob(arch: str, variant: str = "") -> bytes:
    doc: Json = {"architecture": arch, "os": "linux", "rootfs": {"type": "layers", "diff_ids": []}}
    if variant:
        doc["variant"] = variant
    return json.dumps(doc).encode()


def manifest_for(config: bytes, media_type: str = OCI_MANIFEST) -> bytes:
    return json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": media_type,
            "config": {"mediaType": OCI_CONFIG, "digest": sha(config), "size": len(config)},
            "layers": [],
        }
    ).encode()


def index_of(entries: list[tuple[bytes, Json]], media_type: str = OCI_INDEX) -> bytes:
    return json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": media_type,
            "manifests": [
                {"mediaType": OCI_MANIFEST, "digest": sha(m), "size": len(m), "platform": p} for m, p in entries
            ],
        }
    ).encode()


def push_index(host: str, repository: str, platforms: list[Json], *, auth: tuple[str, str] | None = None) -> str:
    """`push` to the plain-HTTP registry at `host` (idempotent: the same platforms give the same digest),
    with basic `auth` when given."""
    entries: list[tuple[bytes, Json]] = []
    with httpx.Client(base_url=f"http://{host}", timeout=30, trust_env=False, auth=auth) as http:
        for platform in platforms:
            config = config_blob(platform["architecture"], platform.get("variant", ""))
            started = http.post(f"/v2/{repository}/blobs/uploads/")
            assert started.status_code == 202, started.text
            location = httpx.URL(started.headers["Location"]).copy_merge_params({"digest": sha(config)})
            assert http.put(location, content=config).status_code == 201
            manifest = manifest_for(config)
            put = http.put(
                f"/v2/{repository}/manifests/{sha(manifest)}", content=manifest, headers={"Content-Type": OCI_MANIFEST}
            )
            assert put.status_code == 201, put.text
            entries.append((manifest, platform))
        index = index_of(entries)
        put = http.put(f"/v2/{repository}/manifests/latest", content=index, headers={"Content-Type": OCI_INDEX})
        assert put.status_code == 201, put.text
        assert put.headers["Docker-Content-Digest"] == sha(index)
    return f"{host}/{repository}@{sha(index)}"
