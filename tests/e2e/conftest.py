"""Fixtures of the end-to-end tests: `cluster`, a sim cluster (tests/support/cluster.py) serving the
`chat` alias from two replicas of `chat-a`, one on each node; `llama_cluster`, a controller and two
`nexa node` agents on real podman for the llama.cpp runtime (tests/support/realmodel.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from tests.conftest import Controller
from tests.realparts import BuiltImages, PodmanService, S3Store
from tests.support.cluster import SimCluster, gateway_cluster
from tests.support.realmodel import Node, real_cluster


@pytest.fixture
async def cluster(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> AsyncIterator[SimCluster]:
    async with gateway_cluster(nursery, tmp_path, s3_store, test_images) as c:
        await c.deploy("chat-a", replicas=2)
        yield c


@pytest.fixture
async def llama_cluster(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, podman_service: PodmanService
) -> AsyncIterator[tuple[Controller, list[Node]]]:
    async with real_cluster(nursery, tmp_path, s3_store, podman_service) as c:
        yield c
