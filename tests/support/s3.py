"""The run's S3 store as a `nexa` process is told about it (a credentials file), and read raw."""

from __future__ import annotations

from pathlib import Path
from urllib.parse import quote
from xml.etree import ElementTree

import httpx

from nexa.s3.client import object_url, signed_headers_for
from nexa.s3.credentials import write_s3_credentials
from tests.realparts import S3Store


def write_credentials(path: Path, s3: S3Store) -> Path:
    """Write the store's keys to `path` (mode 0600, as nexa requires of a secrets file); `path`."""
    return write_s3_credentials(path, s3.credentials)


async def bucket_objects(s3: S3Store, prefix: str = "") -> dict[str, bytes]:
    """Every object of the store's bucket under `prefix`, key → its bytes as stored (raw: signed
    ListObjectsV2 pages, then a GET of each)."""
    keys: list[str] = []
    token: str | None = None
    async with httpx.AsyncClient(timeout=30) as client:
        while True:
            query = "list-type=2&prefix=" + quote(prefix, safe="")
            if token is not None:
                query = "continuation-token=" + quote(token, safe="") + "&" + query
            url = f"{s3.endpoint}/{s3.bucket}?{query}"
            headers = signed_headers_for("GET", url, credentials=s3.credentials, region=s3.region)
            listed = await client.get(url, headers=headers)
            assert listed.status_code == 200, listed.text
            root = ElementTree.fromstring(listed.content)
            ns = {"s3": root.tag.partition("}")[0].lstrip("{")} if root.tag.startswith("{") else {}
            found = root.findall("s3:Contents/s3:Key", ns) if ns else root.findall("Contents/Key")
            keys += [k.text or "" for k in found]
            more = root.find("s3:NextContinuationToken", ns) if ns else root.find("NextContinuationToken")
            if more is None or not more.text:
                break
            token = more.text
        out = {}
        for key in keys:
            url = object_url(s3.endpoint, s3.bucket, key)
            got = await client.get(
                url, headers=signed_headers_for("GET", url, credentials=s3.credentials, region=s3.region)
            )
            assert got.status_code == 200, got.text
            out[key] = got.content
    return out
