"""Fixtures of the end-to-end tests: `cluster`, a sim cluster (tests/support/cluster.py) serving the
`chat` alias from two replicas of `chat-a`, one on each node; `llama_cluster`, a controller and two
`nexa node` agents on real podman for the llama.cpp runtime (tests/support/realmodel.py); whisper.cpp's
own `whisper-server` as a runtime image (`whisper_server_image`), a tiny Whisper model made here
(`tiny_whisper`), whisper.cpp's sample speech (`whisper_sample`) and `whisper_cluster`, a controller and
one `nexa node` agent that runs `whispercpp` runtimes."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from nexa.localparts import build_whisper_server_image, cache_dir, make_tiny_whisper, whisper_sdist
from nexa.localparts.whisperserver import SAMPLE_WAV
from tests.conftest import Controller
from tests.realparts import BuiltImages, OciRegistry, PodmanService, S3Store, _failing
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


@pytest.fixture(scope="session")
def whisper_server_image(
    podman_service: PodmanService,
    oci_registry: OciRegistry,
    python_image: str,
    tmp_path_factory: pytest.TempPathFactory,
) -> str:
    """whisper.cpp's own C++ `whisper-server` on the python image, laid out as whisper.cpp's published
    image (`/app/build/bin` on PATH, `WORKDIR /app`, `ENTRYPOINT ["bash", "-c"]`: `.devops/main.Dockerfile`
    in whisper.cpp's source), pushed: `repo@sha256:…`.

    Built offline from the whisper.cpp source the pywhispercpp sdist vendors (`nexa.localparts.
    build_whisper_server_image`): cmake builds the server alone (about 110 s of CPU, 2.5 to 5 minutes on 2
    busy cores), packed into `cache_dir()` under a name keyed by the recipe, so later runs only unpack it.
    Needs cmake and g++.
    """
    work = tmp_path_factory.mktemp("whisper-server-image")
    remote = f"{oci_registry.host}/nexa-test/whisper-server"
    with _failing():
        return build_whisper_server_image(podman_service.local, python_image, remote, work, cache_dir())


@pytest.fixture(scope="session")
def tiny_whisper() -> Path:
    """A tiny random-weight Whisper model in whisper.cpp's ggml format (`nexa.localparts.tinywhisper`: 64
    wide, one block each side, the real tiny model's mel filters and vocabulary), kept in `cache_dir()`."""
    with _failing():
        return make_tiny_whisper(cache_dir())


@pytest.fixture(scope="session")
def whisper_sample() -> Path:
    """whisper.cpp's own sample speech (`samples/jfk.wav` in the sdist: 11 s, 16 kHz mono 16-bit)."""
    with _failing():
        return whisper_sdist(cache_dir()) / SAMPLE_WAV


@pytest.fixture
async def whisper_cluster(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, podman_service: PodmanService
) -> AsyncIterator[tuple[Controller, list[Node]]]:
    async with real_cluster(nursery, tmp_path, s3_store, podman_service, count=1, runtimes=("whispercpp",)) as c:
        yield c
