"""LoRA adapters loaded and unloaded at run time (issue 34, point 2), against `nexa sim-runtime` as a real
process: its vLLM-compatible `/v1/load_lora_adapter` and `/v1/unload_lora_adapter` (vLLM's answers, and the
sim's limit `--max-loras`), and the node's `NodeLoras`, which loads an adapter when a request first needs it
and unloads the least recently used one when the runtime's limit is reached, without restarting it.
"""

from __future__ import annotations

from pathlib import Path

import attrs
import httpx
import openai
import pytest
import trio

from nexa.contracts.node import RuntimeKind
from nexa.contracts.runtime import ArtifactRef, HealthProbe, LoraSpec, RuntimeSpec
from nexa.errors import Unavailable
from nexa.node.lora import LoraView, NodeLoras
from tests.support.simprocess import MODEL, SimProcess, chat, sim

__all__ = ["sim"]  # the fixture, used by name

TIMEOUT_S = 20


def adapters(tmp_path: Path, *names: str) -> dict[str, Path]:
    """One adapter file per name (the sim checks that the path exists and never reads it)."""
    out = {}
    for name in names:
        out[name] = tmp_path / f"{name}.safetensors"
        out[name].write_bytes(name.encode())
    return out


async def post(sim: SimProcess, path: str, body: dict[str, str]) -> httpx.Response:
    async with httpx.AsyncClient(base_url=sim.url, timeout=5) as http:
        return await http.post(path, json=body)


async def loaded(sim: SimProcess) -> list[str]:
    async with httpx.AsyncClient(base_url=sim.url, timeout=5) as http:
        models = (await http.get("/v1/models")).json()["data"]
    assert models[0]["id"] == MODEL
    assert all(m["parent"] == MODEL for m in models[1:])
    return [m["id"] for m in models[1:]]


async def test_the_sim_answers_vllms_load_and_unload_endpoints_within_its_limit(
    sim: SimProcess, tmp_path: Path
) -> None:
    files = adapters(tmp_path, "poet", "coder", "judge")
    sim.start("--max-loras", "2")
    with trio.fail_after(TIMEOUT_S):
        resp = await post(sim, "/v1/load_lora_adapter", {"lora_name": "poet", "lora_path": str(files["poet"])})
        assert (resp.status_code, resp.text) == (200, "Success: LoRA adapter 'poet' added successfully.")
        again = await post(sim, "/v1/load_lora_adapter", {"lora_name": "poet", "lora_path": str(files["poet"])})
        assert again.status_code == 400
        assert again.json()["error"]["message"] == "The lora adapter 'poet' has already been loaded."
        missing = await post(sim, "/v1/load_lora_adapter", {"lora_name": "coder"})
        assert missing.json()["error"]["message"] == "Both 'lora_name' and 'lora_path' must be provided."
        nowhere = await post(sim, "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": str(tmp_path / "no")})
        assert nowhere.status_code == 400
        await post(sim, "/v1/load_lora_adapter", {"lora_name": "coder", "lora_path": str(files["coder"])})
        full = await post(sim, "/v1/load_lora_adapter", {"lora_name": "judge", "lora_path": str(files["judge"])})
        assert full.status_code == 400 and "--max-loras 2" in full.json()["error"]["message"]
        assert await loaded(sim) == ["poet", "coder"]

        async with sim.client() as client:
            answer = await client.chat.completions.create(model="coder", messages=chat("hi"), max_tokens=2)  # type: ignore[arg-type]
        assert answer.model == "coder"
        gone = await post(sim, "/v1/unload_lora_adapter", {"lora_name": "coder"})
        assert (gone.status_code, gone.text) == (200, "Success: LoRA adapter 'coder' removed successfully.")
        unknown = await post(sim, "/v1/unload_lora_adapter", {"lora_name": "coder"})
        assert unknown.status_code == 404
        assert unknown.json()["error"]["message"] == "The lora adapter 'coder' cannot be found."
        async with sim.client() as client:
            with pytest.raises(openai.NotFoundError, match="The model 'coder' does not exist"):
                await client.chat.completions.create(model="coder", messages=chat("hi"), max_tokens=2)  # type: ignore[arg-type]
        assert await loaded(sim) == ["poet"]
    events = [(e["event"], e["status"]) for e in sim.events() if str(e["event"]).startswith("lora")]
    assert events[:2] == [("lora_load", 200), ("lora_load", 400)]


async def test_without_max_loras_the_endpoints_do_not_exist(sim: SimProcess, tmp_path: Path) -> None:
    files = adapters(tmp_path, "poet")
    sim.start()
    with trio.fail_after(TIMEOUT_S):
        resp = await post(sim, "/v1/load_lora_adapter", {"lora_name": "poet", "lora_path": str(files["poet"])})
    assert resp.status_code == 404


def view_of(sim: SimProcess, files: dict[str, Path], *, limit: int) -> LoraView:
    """The node's view of a Ready sim assignment with these adapters (as `Supervisor.lora_view` gives it)."""
    loras = [
        LoraSpec(
            name=name,
            artifact=ArtifactRef(
                uri=f"s3://nexa-models/{name}", sha256="a" * 64, size_bytes=len(name), mount_path=f"/models/lora/{name}"
            ),
        )
        for name in files
    ]
    runtime = RuntimeSpec(
        kind=RuntimeKind.SIM,
        image="localhost/sim@sha256:" + "0" * 64,
        command=["--max-loras", str(limit)],
        port=int(sim.url.rsplit(":", 1)[1]),
        memory_bytes=2**20,
        cpus=1.0,
        health=HealthProbe(command=["true"]),
        loras=loras,
    )
    return LoraView(runtime=runtime, paths=list(files.values()), started_at=1.0)


async def test_the_node_loads_adapters_on_demand_and_unloads_the_least_recently_used_at_the_limit(
    sim: SimProcess, tmp_path: Path
) -> None:
    files = adapters(tmp_path, "poet", "coder", "judge")
    sim.start("--max-loras", "2")
    view = view_of(sim, files, limit=2)
    port = view.runtime.port
    loras = NodeLoras(lambda aid: view if aid == "a1" else None)

    async def served(name: str) -> bytes:
        body, release = await loras.prepare("a1", name, b'{"model":"base","messages":[]}', port)
        release()  # the request is done
        return body

    with trio.fail_after(TIMEOUT_S):
        assert await served("poet") == b'{"model":"poet","messages":[]}'  # vLLM: the adapter is the model
        await served("coder")
        assert await loaded(sim) == ["poet", "coder"]
        await served("poet")  # poet is now the most recently used
        await served("judge")  # the limit: coder goes
        assert await loaded(sim) == ["poet", "judge"]
        await served("coder")  # then poet, least recently used
        assert await loaded(sim) == ["judge", "coder"]
        async with sim.client() as client:
            answer = await client.chat.completions.create(model="coder", messages=chat("hi"), max_tokens=2)  # type: ignore[arg-type]
        assert answer.model == "coder"
        with pytest.raises(Unavailable, match="does not load the LoRA adapter 'other'"):
            await loras.prepare("a1", "other", b"{}", port)
        with pytest.raises(Unavailable, match="not Ready"):
            await loras.prepare("a2", "poet", b"{}", port)
    assert (loras.loads, loras.unloads) == (4, 2)
    journal = [(e["event"], e.get("loaded")) for e in sim.events() if str(e["event"]).startswith("lora")]
    assert journal == [
        ("lora_load", ["poet"]),
        ("lora_load", ["poet", "coder"]),
        ("lora_unload", ["poet"]),
        ("lora_load", ["poet", "judge"]),
        ("lora_unload", ["judge"]),
        ("lora_load", ["judge", "coder"]),
    ]


async def test_a_runtime_that_refuses_a_load_is_unavailable_and_counts_nothing_loaded(
    sim: SimProcess, tmp_path: Path
) -> None:
    files = adapters(tmp_path, "poet")
    sim.start("--max-loras", "1")
    view = view_of(sim, files, limit=1)
    files["poet"].unlink()  # the runtime cannot read it now
    loras = NodeLoras(lambda aid: view)
    with trio.fail_after(TIMEOUT_S), pytest.raises(Unavailable, match="refused to load LoRA adapter poet"):
        await loras.prepare("a1", "poet", b"{}", view.runtime.port)
    assert await loaded(sim) == []


async def test_an_adapter_serving_a_request_is_not_unloaded_under_it(sim: SimProcess, tmp_path: Path) -> None:
    files = adapters(tmp_path, "poet", "coder")
    sim.start("--max-loras", "1")
    view = view_of(sim, files, limit=1)
    port = view.runtime.port
    loras = NodeLoras(lambda aid: view)
    with trio.fail_after(TIMEOUT_S):
        _, poet_done = await loras.prepare("a1", "poet", b"{}", port)  # a request still running on poet
        with pytest.raises(Unavailable, match="are serving requests; retry"):
            await loras.prepare("a1", "coder", b"{}", port)
        assert await loaded(sim) == ["poet"]
        poet_done()
        _, coder_done = await loras.prepare("a1", "coder", b"{}", port)
        coder_done()
        assert await loaded(sim) == ["coder"]


async def test_a_new_agent_finds_what_an_adopted_runtime_holds_and_never_loads_it_twice(
    sim: SimProcess, tmp_path: Path
) -> None:
    """An agent restart adopts a runtime that keeps running: the adapters its predecessor loaded are
    still loaded there (vLLM refuses to load one again: 400 `already been loaded`). The new agent reads
    them from `GET /v1/models` (adapters listed with their base as `parent`) before its first load, so a
    request for one is served at once, and one no longer given is unloaded."""
    files = adapters(tmp_path, "poet", "coder")
    sim.start("--max-loras", "2")
    view = view_of(sim, files, limit=2)
    port = view.runtime.port
    before = NodeLoras(lambda aid: view)
    with trio.fail_after(TIMEOUT_S):
        for name in ("poet", "coder"):
            _, done = await before.prepare("a1", name, b"{}", port)
            done()
        assert await loaded(sim) == ["poet", "coder"]
        # The restarted agent: the same runtime start, now given poet only.
        only_poet = attrs.evolve(view, runtime=attrs.evolve(view.runtime, loras=view.runtime.loras[:1]))
        after = NodeLoras(lambda aid: only_poet)
        body, done = await after.prepare("a1", "poet", b'{"model":"base"}', port)
        done()
        assert body == b'{"model":"poet"}'
        assert (after.loads, after.unloads) == (0, 1)  # poet found loaded; coder no longer given: unloaded
        assert await loaded(sim) == ["poet"]
    journal = [(e["event"], e.get("loaded")) for e in sim.events() if str(e["event"]).startswith("lora")]
    assert journal == [("lora_load", ["poet"]), ("lora_load", ["poet", "coder"]), ("lora_unload", ["poet"])]
