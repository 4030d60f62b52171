"""LoRA adapters given outside the spec (`Assignment.loras`, `RuntimeSpec.live_loras`): a real supervisor
keeps them in the assignment's adapter directory (`nexa.node.liveloras`) without restarting the runtime,
and the relay's hook (`NodeLoras`) loads and unloads them on a real `nexa sim-runtime` process.

Policy: loopback only, every wait bounded by `trio.fail_after`; real time (the directory's work runs
in threads, which `autojump_clock` would race, trio #456).
"""

from __future__ import annotations

import collections
import hashlib
import os
from pathlib import Path

import attrs
import httpx
import pytest
import trio

from nexa import container_spec
from nexa.config import Seconds, SupervisorConfig
from nexa.contracts import wire
from nexa.contracts.manifest import ArtifactFile, Manifest
from nexa.contracts.runtime import ArtifactRef, LoraSpec
from nexa.errors import Unavailable
from nexa.node.lora import NodeLoras
from nexa.node.processes import ProcessDriver
from nexa.node.supervisor import Supervisor
from tests.conftest import free_port
from tests.support.nodes import sim_runtime
from tests.support.supervisor import FakePodman, runtime

TIMEOUT_S = 30
CFG = SupervisorConfig(restart_backoff_initial_s=Seconds(0.1), reconcile_interval_s=Seconds(0.2))


class FileArtifacts:
    """The artifact cache over real files: one object as the file `<root>/<sha256>`, a manifest as
    the directory `<root>/<digest>/`; pins counted per digest."""

    def __init__(self, root: Path) -> None:
        self.root = root
        root.mkdir()
        self.pins: collections.Counter[str] = collections.Counter()

    def one(self, name: str, data: bytes) -> LoraSpec:
        sha256 = hashlib.sha256(data).hexdigest()
        (self.root / sha256).write_bytes(data)
        ref = ArtifactRef(
            uri=f"s3://nexa-models/{name}", sha256=sha256, size_bytes=len(data), mount_path=f"/models/lora/{name}"
        )
        return LoraSpec(name=name, artifact=ref)

    def manifest(self, name: str, files: dict[str, bytes]) -> LoraSpec:
        listed = [
            ArtifactFile(path=p, size_bytes=len(d), sha256=hashlib.sha256(d).hexdigest()) for p, d in files.items()
        ]
        digest = Manifest(files=tuple(listed), entry=".").digest
        for path, data in files.items():
            (self.root / digest / path).parent.mkdir(parents=True, exist_ok=True)
            (self.root / digest / path).write_bytes(data)
        ref = ArtifactRef(
            uri=f"s3://nexa-models/{name}/",
            sha256=digest,
            size_bytes=sum(len(d) for d in files.values()),
            files=listed,
            entry=".",
            mount_path=f"/models/lora/{name}",
        )
        return LoraSpec(name=name, artifact=ref)

    async def fetch(self, ref: ArtifactRef) -> Path:
        await trio.lowlevel.checkpoint()
        return self.root / ref.sha256

    def pin(self, sha256: str) -> None:
        self.pins[sha256] += 1

    def unpin(self, sha256: str) -> None:
        self.pins[sha256] -= 1
        if not self.pins[sha256]:
            del self.pins[sha256]

    async def evict(self) -> int:
        await trio.lowlevel.checkpoint()
        return 0


async def until(check: object) -> None:
    """Poll `check()` (a callable) until it is true."""
    assert callable(check)
    while not check():  # noqa: ASYNC110 - the states polled have no event of their own
        await trio.sleep(0.02)


def ready(sup: Supervisor, aid: str = "a1") -> bool:
    return any(s.assignment_id == aid and s.state is wire.RuntimeState.READY for s in sup.statuses())


def placed(sup: Supervisor, *names: str) -> bool:
    view = sup.live_loras.view("a1")
    return all(name in view and view[name].path is not None for name in names)


def listing(path: Path) -> list[str]:
    return sorted(os.listdir(path)) if path.exists() else []


async def loaded(port: int) -> dict[str, str]:
    """The sim's adapters loaded now (its `GET /v1/models`), each with the path it was loaded from."""
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
        models = (await http.get("/v1/models")).json()["data"]
    return {m["id"]: m["root"] for m in models[1:]}


async def test_a_new_adapter_version_beside_the_earlier_one_then_alone_keeps_the_runtime_and_unloads_the_earlier(
    tmp_path: Path,
) -> None:
    arts = FileArtifacts(tmp_path / "artifacts")
    a1 = arts.one("poet@a1", b"poet a1 weights")
    a2 = arts.manifest("poet@a2", {"adapter_config.json": b"{}", "adapter_model.safetensors": b"poet a2 weights"})
    port = free_port()
    rt = attrs.evolve(sim_runtime(port, "--max-loras", "2"), live_loras=True)
    root = tmp_path / "loras"
    directory = root / "nexa-a1"

    def given(*loras: LoraSpec) -> list[wire.Assignment]:
        return [wire.Assignment(id="a1", deployment="d1", runtime=rt, loras=list(loras))]

    async with ProcessDriver(tmp_path / "state") as driver, trio.open_nursery() as nursery:
        sup = Supervisor(CFG, driver, arts, node_id="n1", live_loras_dir=root)
        relay = NodeLoras(sup.lora_view)

        async def request(name: str) -> None:
            body, release = await relay.prepare("a1", name, b'{"model":"d1","messages":[]}', port)
            assert body == b'{"model":"%s","messages":[]}' % name.encode()  # the adapter is the model
            release()

        with trio.fail_after(TIMEOUT_S):
            sup.update(1, given(a1))
            await nursery.start(sup.run)
            await until(lambda: ready(sup) and placed(sup, "poet@a1"))
            (first,) = await driver.list({container_spec.LABEL_NODE: "n1"})
            await request("poet@a1")
            # A sim process loads from the node's own path: the one object as the file <dir>/<name>.
            assert await loaded(port) == {"poet@a1": str(directory / "poet@a1")}
            assert (directory / "poet@a1").read_bytes() == b"poet a1 weights"

            sup.update(2, given(a1, a2))
            await until(lambda: placed(sup, "poet@a2"))
            await request("poet@a2")
            assert await loaded(port) == {"poet@a1": str(directory / "poet@a1"), "poet@a2": str(directory / "poet@a2")}
            # A manifest as the directory <dir>/<name>/, its files hard links to the cache's.
            assert listing(directory / "poet@a2") == ["adapter_config.json", "adapter_model.safetensors"]
            cached = arts.root / a2.artifact.sha256 / "adapter_model.safetensors"
            assert os.stat(directory / "poet@a2" / "adapter_model.safetensors").st_ino == os.stat(cached).st_ino

            sup.update(3, given(a2))
            await until(lambda: listing(directory) == ["poet@a2"])  # the earlier version's entry is gone
            with pytest.raises(Unavailable, match="does not load the LoRA adapter 'poet@a1'"):
                await relay.prepare("a1", "poet@a1", b"{}", port)
            await request("poet@a2")  # unloads what is no longer given, no request using it
            assert await loaded(port) == {"poet@a2": str(directory / "poet@a2")}
            assert (relay.loads, relay.unloads) == (2, 1)
            assert dict(arts.pins) == {a2.artifact.sha256: 1}

            # One runtime all along: never restarted, never recreated.
            (last,) = await driver.list({container_spec.LABEL_NODE: "n1"})
            assert (last.id, last.started_at) == (first.id, first.started_at)
            assert sup.statistics().created == 1 and sup.statistics().restarts == 0
            nursery.cancel_scope.cancel()


async def test_a_given_adapter_not_on_the_node_yet_is_unavailable(tmp_path: Path) -> None:
    arts = FileArtifacts(tmp_path / "artifacts")
    a1 = arts.one("poet@a1", b"poet a1 weights")
    gate = trio.Event()
    fetch = arts.fetch

    async def slow_fetch(ref: ArtifactRef) -> Path:
        if ref.sha256 == a1.artifact.sha256:
            await gate.wait()
        return await fetch(ref)

    arts.fetch = slow_fetch  # type: ignore[method-assign]
    podman = FakePodman({runtime().image})
    rt = runtime(live_loras=True)
    sup = Supervisor(CFG, podman, arts, node_id="n1", live_loras_dir=tmp_path / "loras")
    relay = NodeLoras(sup.lora_view)
    async with trio.open_nursery() as nursery:
        with trio.fail_after(TIMEOUT_S):
            sup.update(1, [wire.Assignment(id="a1", deployment="d1", runtime=rt, loras=[a1])])
            await nursery.start(sup.run)
            await until(lambda: ready(sup))  # the runtime does not wait for its adapters
            with pytest.raises(Unavailable, match="'poet@a1' is not on this replica's node yet"):
                await relay.prepare("a1", "poet@a1", b"{}", rt.port)
            gate.set()
            await until(lambda: placed(sup, "poet@a1"))
            nursery.cancel_scope.cancel()


async def test_an_unsafe_name_is_skipped_and_nothing_lands_outside_the_directory(tmp_path: Path) -> None:
    arts = FileArtifacts(tmp_path / "artifacts")
    good = arts.one("poet@a1", b"poet")
    bad = ["../escape", "a/b", ".", "..", "", "x\x00y", ".hidden", "n" * 300]
    loras = [good, *(attrs.evolve(good, name=name) for name in bad)]
    podman = FakePodman({runtime().image})
    root = tmp_path / "loras"
    sup = Supervisor(CFG, podman, arts, node_id="n1", live_loras_dir=root)
    before = listing(tmp_path)
    async with trio.open_nursery() as nursery:
        with trio.fail_after(TIMEOUT_S):
            sup.update(1, [wire.Assignment(id="a1", deployment="d1", runtime=runtime(live_loras=True), loras=loras)])
            await nursery.start(sup.run)
            await until(lambda: ready(sup) and placed(sup, "poet@a1"))
            nursery.cancel_scope.cancel()
    assert listing(root) == ["nexa-a1"]
    assert listing(root / "nexa-a1") == ["poet@a1"]
    assert listing(tmp_path) == sorted([*before, "loras"])
    assert sup.live_loras.statistics().refused == len(bad)
    assert list(sup.live_loras.view("a1")) == ["poet@a1"]
    # The container mounts the directory read-only at /models/lora (made before it was created).
    assert (str(root / "nexa-a1"), "/models/lora") in podman.only().spec.ro_mounts


async def test_the_directory_goes_with_its_assignment_and_leftovers_go_at_start(tmp_path: Path) -> None:
    arts = FileArtifacts(tmp_path / "artifacts")
    a1 = arts.one("poet@a1", b"poet")
    root = tmp_path / "loras"
    # Left by an earlier agent: an assignment no longer present, and a stale entry of a present one.
    (root / "nexa-gone").mkdir(parents=True)
    (root / "nexa-gone" / "poet@a0").write_bytes(b"old")
    (root / "nexa-a1").mkdir()
    (root / "nexa-a1" / "poet@a0").write_bytes(b"old")
    podman = FakePodman({runtime().image})
    sup = Supervisor(CFG, podman, arts, node_id="n1", live_loras_dir=root)
    keep = wire.Assignment(id="a2", deployment="d1", runtime=runtime(live_loras=True, port=18301))
    async with trio.open_nursery() as nursery:
        with trio.fail_after(TIMEOUT_S):
            sup.update(
                1, [wire.Assignment(id="a1", deployment="d1", runtime=runtime(live_loras=True), loras=[a1]), keep]
            )
            await nursery.start(sup.run)
            await until(lambda: ready(sup) and placed(sup, "poet@a1"))
            await until(lambda: listing(root) == ["nexa-a1", "nexa-a2"])
            assert listing(root / "nexa-a1") == ["poet@a1"]
            assert arts.pins[a1.artifact.sha256] == 1  # beside the model's (the supervisor's own pin)

            created = podman.mutations("create")
            sup.update(2, [keep])  # a1 removed: its worker retires, its directory goes
            await until(lambda: listing(root) == ["nexa-a2"])
            assert podman.mutations("create") == created  # a2 was never touched
            assert a1.artifact.sha256 not in arts.pins
            nursery.cancel_scope.cancel()
