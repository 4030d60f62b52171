"""Fixtures of the end-to-end tests: `cluster`, a sim cluster (tests/support/cluster.py) serving the
`chat` alias from two replicas of `chat-a`, one on each node."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from tests.realparts import BuiltImages, S3Store
from tests.support.cluster import SimCluster, gateway_cluster


@pytest.fixture
async def cluster(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> AsyncIterator[SimCluster]:
    async with gateway_cluster(nursery, tmp_path, s3_store, test_images) as c:
        await c.deploy("chat-a", replicas=2)
        yield c
