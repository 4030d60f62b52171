"""`nexa.node.runtime_cache`: what a replica's cache is keyed by, least-recently-used eviction above
the bound, never of a directory a replica holds, and a start refused with a typed reason when the
disk has no room. The real engines mounting it are in tests/node/test_runtime_isolation.py."""

from __future__ import annotations

import os
from pathlib import Path

import attrs
import pytest

from nexa.adapters.vllm import VLLM
from nexa.contracts.node import RuntimeKind
from nexa.contracts.runtime import ArtifactRef, HealthProbe, RuntimeSpec
from nexa.errors import RuntimeCacheNoRoom
from nexa.node.runtime_cache import RuntimeCaches, cache_key

IMAGE = "registry.local/vllm@sha256:" + "1" * 64
MiB = 2**20


def _runtime(port: int = 18000, *, settings: dict[str, object] | None = None, model: str = "a" * 64) -> RuntimeSpec:
    launch = VLLM.launch("m", settings or {}, ["nvidia.com/gpu=0"], port)
    return RuntimeSpec(
        kind=RuntimeKind.VLLM,
        image=IMAGE,
        command=launch.command,
        env=launch.env,
        port=port,
        artifact=ArtifactRef(uri="s3://models/m", sha256=model, size_bytes=1),
        gpus=["nvidia.com/gpu=0"],
        memory_bytes=2**30,
        cpus=1.0,
        health=HealthProbe(command=["true"]),
    )


def _fill(path: Path, size: int) -> None:
    (path / "kernel.bin").write_bytes(os.urandom(size))


def _age(path: Path, seconds_ago: float) -> None:
    t = path.stat().st_mtime - seconds_ago
    os.utime(path, (t, t))


def test_the_key_is_the_image_the_model_and_the_settings_not_the_port() -> None:
    base = cache_key(_runtime())
    assert cache_key(_runtime(port=18001)) == base  # a second replica of the same thing
    assert cache_key(_runtime(settings={"max_model_len": 4096})) != base
    assert cache_key(_runtime(model="b" * 64)) != base
    assert cache_key(attrs.evolve(_runtime(), image="registry.local/vllm@sha256:" + "2" * 64)) != base
    assert len(base) == 64


async def test_least_recently_used_directories_are_evicted_above_the_bound_but_never_one_in_use(
    tmp_path: Path,
) -> None:
    caches = RuntimeCaches(tmp_path / "rc", max_bytes=3 * MiB, start_free_bytes=1)
    runtimes = [_runtime(settings={"max_num_seqs": n}) for n in (1, 2, 3)]
    paths = [await caches.acquire(f"r{n}", rt) for n, rt in enumerate(runtimes)]
    for path in paths:
        _fill(path, MiB + 4096)  # three of them: over the 3 MiB bound
    caches.release("r0")
    caches.release("r1")
    # r1 was used longest ago, then r0; r2 is still held.
    _age(paths[1], 300)
    _age(paths[0], 100)
    _age(paths[2], 900)  # the oldest of all, but in use
    await caches.measure()
    assert not paths[1].exists()
    assert paths[0].exists() and paths[2].exists()
    stats = caches.statistics()
    assert (stats.directories, stats.in_use, stats.evicted) == (2, 1, 1)
    disk = caches.disk()
    assert disk is not None and disk.max_bytes == 3 * MiB and disk.directories == 2 and disk.in_use == 1
    assert disk.used_bytes <= 3 * MiB and disk.free_bytes > 0 and disk.total_bytes >= disk.free_bytes

    # Held directories are kept even when they alone are over the bound.
    caches.release("r2")
    again = await caches.acquire("r2-again", runtimes[2])
    assert again == paths[2] and (again / "kernel.bin").exists()  # the restart finds its cache
    _fill(paths[0], 4 * MiB)
    await caches.measure()
    assert paths[2].exists() and not paths[0].exists()


async def test_a_directory_is_writable_by_any_user_of_the_image_under_a_private_root(tmp_path: Path) -> None:
    caches = RuntimeCaches(tmp_path / "rc", max_bytes=MiB, start_free_bytes=1)
    path = await caches.acquire("r", _runtime())
    assert path.parent == tmp_path / "rc" and path.name == cache_key(_runtime())
    assert path.stat().st_mode & 0o777 == 0o777
    assert path.parent.stat().st_mode & 0o777 == 0o700


async def test_a_start_without_room_on_the_disk_fails_typed_and_holds_nothing(tmp_path: Path) -> None:
    free = os.statvfs(tmp_path).f_bavail * os.statvfs(tmp_path).f_frsize
    caches = RuntimeCaches(tmp_path / "rc", max_bytes=MiB, start_free_bytes=free + 2**40)
    with pytest.raises(RuntimeCacheNoRoom) as caught:
        await caches.acquire("r", _runtime())
    assert caught.value.code == "runtime_cache_no_room"
    assert caught.value.needed_bytes == free + 2**40 and caught.value.free_bytes <= free + MiB
    assert "runtime_cache_start_free_bytes" in caught.value.message
    assert caches.statistics().in_use == 0


def test_a_sim_runtime_is_a_process_and_gets_no_cache(tmp_path: Path) -> None:
    caches = RuntimeCaches(tmp_path / "rc", max_bytes=MiB, start_free_bytes=1)
    sim = attrs.evolve(_runtime(), kind=RuntimeKind.SIM)
    assert caches.wants(_runtime()) and not caches.wants(sim)
