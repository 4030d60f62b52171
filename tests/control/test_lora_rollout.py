"""A LoRA adapter reaches its base's running replicas by a rollout under watch (issues 34 and 36): when an
alias starts serving an adapter on a deployment's model, or a new version of one, the reconciler replaces the
deployment's replicas one at a time with replicas whose signed assignment loads it (`Deployment.loras`, a
rollout with reason `adapter`); an `undo` (the same revert a breach takes) returns them to the earlier
adapter set and holds the undone one, so it is not rolled out again while the alias serves it.

A real controller over its HTTP API, with two RawNodes (real zmq, the signed sets they are pushed kept) and
no spare room, a real S3 store (SeaweedFS) holding the tests' GGUF base and adapter.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import trio

from nexa.contracts import wire
from tests.conftest import Controller
from tests.realparts import BuiltImages, S3Store
from tests.support.api import ok
from tests.support.console import sign_in
from tests.support.deployments import fleet_image
from tests.support.models import bring_to
from tests.support.rollout import (
    Nodes,
    Watch,
    assert_never_short,
    audit,
    big,
    finish_rollout,
    fleet_of,
    until,
    view,
    watch_views,
)


async def adapter(http: httpx.AsyncClient, s3: S3Store, data: bytes, version: str) -> str:
    """The adapter poet@`version` for tiny@v1, Approved; its artifact's digest."""
    lora = {"kind": "lora", "base": [{"model": "tiny", "version": "v1"}]}
    model = await bring_to(http, s3, "poet", version, "Approved", data=data, **lora)
    return str(model["artifact"]["sha256"])


async def serve(http: httpx.AsyncClient, version: str) -> None:
    body = {"model": "tiny", "version": "v1", "adapter": {"model": "poet", "version": version}}
    await ok(http.post("/api/v1/aliases/poet/promote", json=body))


def assigned(fleet: Nodes, node_id: str) -> list[wire.Assignment]:
    """The assignments of the latest set pushed to that node."""
    latest: wire.AssignmentSet | None = fleet.latest(node_id)
    return latest.assignments if latest is not None else []


def loaded(fleet: Nodes) -> dict[str, list[tuple[str, str]]]:
    """By node, the adapters its latest set's assignments load: (name, artifact digest)."""
    return {
        n: [(lo.name, lo.artifact.sha256) for a in assigned(fleet, n) for lo in a.runtime.loras] for n in fleet.nodes
    }


async def test_an_adapter_rolls_onto_running_replicas_and_an_undone_version_is_held(
    dep_reg: Controller,
    dial: Any,
    nursery: trio.Nursery,
    s3_store: S3Store,
    test_images: BuiltImages,
    tiny_gguf: Path,
    tiny_lora_gguf: Path,
) -> None:
    fleet = await fleet_of(dep_reg, dial, nursery, "n1", "n2")  # full: one replica each, no spare node
    lora_bytes = await trio.Path(tiny_lora_gguf).read_bytes()
    async with dep_reg.client() as http:
        runtime = {"name": "llama", "kind": "llamacpp", "version": "1", "image": fleet_image(test_images)}
        await ok(http.post("/api/v1/runtimes", json=runtime), 201)
        await bring_to(http, s3_store, "tiny", "v1", "Approved", data=await trio.Path(tiny_gguf).read_bytes())
        await ok(http.post("/api/v1/aliases/chat/promote", json={"model": "tiny", "version": "v1"}))
        policy = {"soak_s": 0.5, "min_requests": 5}
        await ok(http.post("/api/v1/deployments", json=big(rollout_policy=policy)), 201)
        fleet.ready(*(await view(http))["deployment"]["placed"])
        await until(http, lambda v: v["ready"] == 2)
        assert loaded(fleet) == {"n1": [], "n2": []}
        watch = Watch()
        nursery.start_soon(watch_views, dep_reg, "chat-a", watch)

        # A new adapter on the deployment's model: its replicas roll, one at a time, to load it.
        a1 = await adapter(http, s3_store, lora_bytes, "a1")
        await serve(http, "a1")
        rolling = await until(http, lambda v: v["deployment"]["rollout"] is not None)
        assert rolling["deployment"]["rollout"]["reason"] == "adapter"
        assert rolling["deployment"]["loras"] == {"poet": {"model": "poet", "version": "a1"}}
        assert rolling["deployment"]["rollout"]["good"]["loras"] == {}
        done = await finish_rollout(http, fleet)
        assert loaded(fleet) == {"n1": [("poet", a1)], "n2": [("poet", a1)]}
        assert done["deployment"]["loras"] == {"poet": {"model": "poet", "version": "a1"}}
        [started] = await audit(http, "deployment.adapters")
        assert "adapters poet: - -> poet@a1" in started["detail"], started

        # A new version of it rolls the same way; undone after its first replica, the replicas return to
        # a1 and a2 is held: no further adapter rollout starts while the alias serves it.
        await adapter(http, s3_store, lora_bytes + b"\0" * 8, "a2")
        await serve(http, "a2")
        a2_rolling = await until(
            http, lambda v: (v["deployment"]["rollout"] or {}).get("reason") == "adapter" and v["ready"] == 1
        )
        assert a2_rolling["deployment"]["rollout"]["good"]["loras"] == {"poet": {"model": "poet", "version": "a1"}}
        fleet.ready(*a2_rolling["deployment"]["placed"])
        await until(http, lambda v: v["ready"] == 2)
        await ok(http.post("/api/v1/deployments/chat-a/rollout/undo"))
        reverted = await finish_rollout(http, fleet)
        assert reverted["deployment"]["loras"] == {"poet": {"model": "poet", "version": "a1"}}
        assert reverted["deployment"]["held_loras"] == {"poet": {"model": "poet", "version": "a2"}}
        assert loaded(fleet) == {"n1": [("poet", a1)], "n2": [("poet", a1)]}
        [undo] = await audit(http, "deployment.rollout.undo")
        assert "adapters poet: poet@a2 -> poet@a1" in undo["detail"], undo
        await trio.sleep(1.0)  # several reconciler passes
        after = await view(http)
        assert after["deployment"]["rollout"] is None and len(await audit(http, "deployment.adapters")) == 2
    # The console's deployment page names the adapters its replicas load, and the held version.
    async with httpx.AsyncClient(base_url=dep_reg.url) as browser:
        assert (await sign_in(browser, dep_reg.admin_key)).status_code == 303
        page = (await browser.get("/console/deployments/chat-a")).text
    assert (
        '<p id="adapters">LoRA adapters: poet (poet@a1) · held (a rollout to them was reverted): poet (poet@a2)</p>'
        in page
    )
    assert_never_short(watch, fleet, 2)


def live(fleet: Nodes) -> dict[str, tuple[list[str], list[str]]]:
    """By node, its latest set's adapters: (in the specs, by name; given at run time, by name)."""
    out: dict[str, tuple[list[str], list[str]]] = {}
    for node_id in fleet.nodes:
        assignments = assigned(fleet, node_id)
        spec = [lo.name for a in assignments for lo in a.runtime.loras]
        out[node_id] = (spec, [lo.name for a in assignments if a.runtime.live_loras for lo in a.loras])
    return out


async def test_a_node_of_an_earlier_release_gets_its_adapters_in_the_spec_and_a_new_version_is_rolled(
    dep_reg: Controller,
    dial: Any,
    nursery: trio.Nursery,
    s3_store: S3Store,
    test_images: BuiltImages,
    tiny_gguf: Path,
    tiny_lora_gguf: Path,
) -> None:
    """Mixed releases: a node whose Hello says protocol 1 (before adapters given at run time) is never
    sent `Assignment.loras` (it would refuse the whole set): its vLLM replica gets the adapter in its
    spec, the node of this release gets it at run time; and with a replica that cannot take a new
    version in place, the new version is rolled out by replacing replicas, as before."""
    fleet = await fleet_of(dep_reg, dial, nursery, "n1", "n2", protocols={"n2": 1})
    async with dep_reg.client() as http:
        runtime = {"name": "vllm", "kind": "vllm", "version": "0.11.0", "image": fleet_image(test_images)}
        await ok(http.post("/api/v1/runtimes", json=runtime), 201)
        await bring_to(http, s3_store, "tiny", "v1", "Approved", data=await trio.Path(tiny_gguf).read_bytes())
        await ok(http.post("/api/v1/aliases/chat/promote", json={"model": "tiny", "version": "v1"}))
        lora_bytes = await trio.Path(tiny_lora_gguf).read_bytes()
        await adapter(http, s3_store, lora_bytes, "a1")
        await serve(http, "a1")
        vllm = big(runtime="vllm", rollout_policy={"soak_s": 0.5, "min_requests": 5}, options={"port": 18100})
        await ok(http.post("/api/v1/deployments", json=vllm), 201)
        fleet.ready(*(await view(http))["deployment"]["placed"])
        await until(http, lambda v: v["ready"] == 2)
        assert live(fleet) == {"n1": ([], ["poet@a1"]), "n2": (["poet"], [])}

        await adapter(http, s3_store, lora_bytes + b"\0" * 8, "a2")
        await serve(http, "a2")
        rolling = await until(http, lambda v: (v["deployment"]["rollout"] or {}).get("reason") == "adapter")
        assert rolling["deployment"]["rollout"]["in_place"] is False  # n2's replica takes no version at run time
        await finish_rollout(http, fleet)
        assert live(fleet) == {"n1": ([], ["poet@a2"]), "n2": (["poet"], [])}
        [started] = await audit(http, "deployment.adapters")
        assert "adapters poet: poet@a1 -> poet@a2; rolling its replicas" in started["detail"], started
