"""The local parts' one HTTP client (httpx, synchronous: the parts start in worker threads): whether a
part answers yet, the bucket made while SeaweedFS starts, and an image pushed to the local registry.
Transport failures become a False/None answer or `Unavailable` here; no httpx type leaves this module.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import httpx

from nexa.errors import Unavailable

#: How long one readiness poll waits for an answer (the caller polls again).
POLL_TIMEOUT_S = 2.0
#: How long one request of an image push may take.
PUSH_TIMEOUT_S = 30.0


def answers(url: str, *, uds: str | None = None, timeout_s: float = POLL_TIMEOUT_S) -> bool:
    """GET `url` once (through the unix socket `uds`, if given): True on a 200, False when nothing
    answers yet."""
    transport = httpx.HTTPTransport(uds=uds) if uds is not None else None
    with httpx.Client(transport=transport, trust_env=False, timeout=timeout_s) as client:
        try:
            return client.get(url).status_code == 200
        except httpx.TransportError:
            return False


def put_status(url: str, headers: Mapping[str, str], *, timeout_s: float) -> int | None:
    """PUT `url` with no body: the answer's status, None when nothing answers yet."""
    try:
        return httpx.put(url, headers=dict(headers), timeout=timeout_s, trust_env=False).status_code
    except httpx.TransportError:
        return None


def push_image(base_url: str, repository: str, config: bytes, manifest: bytes, media_type: str) -> str | None:
    """Push an image with no layers (`config` blob, then `manifest` as `latest`) to the registry at
    `base_url`; the digest the registry reports (Docker-Content-Digest), None when it reports none.
    Unavailable when the registry refuses or does not answer."""
    config_digest = "sha256:" + hashlib.sha256(config).hexdigest()
    try:
        with httpx.Client(base_url=base_url, timeout=PUSH_TIMEOUT_S, trust_env=False) as http:
            started = http.post(f"/v2/{repository}/blobs/uploads/")
            started.raise_for_status()
            # The upload URL carries its own state in the query: add the digest, keep the rest.
            location = httpx.URL(started.headers["Location"])
            finish = location.copy_merge_params({"digest": config_digest})
            http.put(finish, content=config).raise_for_status()
            pushed = http.put(
                f"/v2/{repository}/manifests/latest", content=manifest, headers={"Content-Type": media_type}
            )
            pushed.raise_for_status()
    except httpx.HTTPError as exc:
        raise Unavailable(f"pushing {repository} to the registry at {base_url} failed: {exc}") from None
    digest: str | None = pushed.headers.get("Docker-Content-Digest")
    return digest
