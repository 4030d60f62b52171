"""SGLang's LoRA adapters through the node's `NodeLoras` (issue 34, point 2): loaded at run time when the
deployment fixes SGLang's LoRA pool shape (`max_lora_rank`, `lora_target_modules`), and always named in
the request's `lora_path` field.

The far end is a stand-in for SGLang's HTTP server, served by hypercorn on 127.0.0.1. Its routes, status
codes and answer shapes follow SGLang's own source (sgl-project/sglang at 0025436e,
python/sglang/srt/entrypoints/http_server.py):
- `POST /load_lora_adapter` `{"lora_name", "lora_path", "pinned"}` and `POST /unload_lora_adapter`
  `{"lora_name"}`, with no `/v1`, answer 200 with `{"success": true, "error_message": null,
  "loaded_adapters": {...}}` (`LoadLoRAAdapterReqOutput`), or 400 with `success` false;
- `GET /v1/models` lists the served model, then each loaded adapter with its path as `root` and the
  served model as `parent`;
- a chat request names its adapter in `lora_path` (`entrypoints/openai/serving_base.py`,
  `_resolve_lora_path`: the model's `base:adapter` form first, else the explicit `lora_path`).
What it refuses beyond that (a name loaded twice, a path that is not there, more than its
`--max-loaded-loras`) is the stand-in's choice, worded as its own.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio

from nexa.adapters.lora import SGLANG_ENDPOINTS
from nexa.contracts.node import RuntimeKind
from nexa.contracts.runtime import ArtifactRef, HealthProbe, LoraSpec, RuntimeSpec
from nexa.errors import RuntimeFailed, Unavailable
from nexa.node.lora import LiveLora, LoraView, NodeLoras
from tests.support.relay import request_body, serve_runtime

SERVED = "llama-3-8b"
TIMEOUT_S = 10


@attrs.define
class SGLang:
    """The stand-in: what is loaded (name → path), the load and unload calls and the chat bodies it saw."""

    loaded: dict[str, str] = attrs.field(factory=dict)
    calls: list[tuple[str, dict[str, Any]]] = attrs.field(factory=list)
    chats: list[dict[str, Any]] = attrs.field(factory=list)
    max_loaded: int = 2
    #: Paths it cannot read (the load fails there).
    unreadable: set[str] = attrs.field(factory=set)

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        raw = await request_body(scope, receive, send)
        if raw is None:
            return
        body = json.loads(raw) if raw else {}
        path = scope["path"]
        if path == "/v1/models":
            base = {"id": SERVED, "object": "model", "root": SERVED, "max_model_len": 8192}
            cards = [
                {"id": n, "object": "model", "root": p, "parent": SERVED, "max_model_len": None}
                for n, p in self.loaded.items()
            ]
            await _answer(send, 200, {"object": "list", "data": [base, *cards]})
        elif path in (SGLANG_ENDPOINTS.load, SGLANG_ENDPOINTS.unload):
            self.calls.append((path, body))
            error = self._load(body) if path == SGLANG_ENDPOINTS.load else self._unload(body)
            answer = {"success": error is None, "error_message": error, "loaded_adapters": dict(self.loaded)}
            await _answer(send, 200 if error is None else 400, answer)
        elif path == "/v1/chat/completions":
            self.chats.append(body)
            await _answer(send, 200, {"object": "chat.completion", "model": body.get("model"), "choices": []})
        else:
            await _answer(send, 404, {"detail": "Not Found"})

    def _load(self, body: dict[str, Any]) -> str | None:
        name, path = body.get("lora_name"), body.get("lora_path")
        if name in self.loaded:
            return f"LoRA adapter {name} is already loaded"
        if path in self.unreadable:
            return f"Failed to load LoRA adapter {name} from {path}"
        if len(self.loaded) >= self.max_loaded:
            return f"Maximum number of loaded LoRA adapters ({self.max_loaded}) reached"
        self.loaded[str(name)] = str(path)
        return None

    def _unload(self, body: dict[str, Any]) -> str | None:
        if self.loaded.pop(str(body.get("lora_name")), None) is None:
            return f"LoRA adapter {body.get('lora_name')} is not loaded"
        return None


async def _answer(send: Any, status: int, body: dict[str, Any]) -> None:
    await send({"type": "http.response.start", "status": status, "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(body).encode()})


def _lora(name: str) -> LoraSpec:
    ref = ArtifactRef(uri=f"s3://nexa-models/{name}", sha256="a" * 64, size_bytes=1, mount_path=f"/models/lora/{name}")
    return LoraSpec(name=name, artifact=ref)


def view(port: int, *, live: tuple[str, ...] = (), spec: tuple[str, ...] = (), limit: int = 2) -> LoraView:
    """A Ready SGLang assignment as `Supervisor.lora_view` gives it: adapters given outside its spec
    (`live`, lying in its adapter directory) or in its spec (`spec`, loaded at start)."""
    runtime = RuntimeSpec(
        kind=RuntimeKind.SGLANG,
        image="localhost/sglang@sha256:" + "0" * 64,
        command=["--max-lora-rank", "64", "--lora-target-modules", "all", "--max-loaded-loras", str(limit)],
        port=port,
        memory_bytes=2**20,
        cpus=1.0,
        health=HealthProbe(command=["true"]),
        loras=[_lora(n) for n in spec],
        live_loras=bool(live),
    )
    given = {n: LiveLora(lora=_lora(n), path=Path("/var/lib/nexa/loras/c") / n) for n in live}
    return LoraView(runtime=runtime, paths=[Path("/var/lib/nexa") / n for n in spec], started_at=1.0, live=given)


async def test_run_time_adapters_load_at_sglangs_endpoints_and_are_named_in_lora_path() -> None:
    sglang = SGLang()
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(serve_runtime, sglang))
        given = view(port, live=("poet@a1", "poet@a2", "coder@c1"))
        now = {"r1": given}  # the assignment as the node's current set gives it
        loras = NodeLoras(now.get)

        async def served(name: str) -> dict[str, Any]:
            body, release = await loras.prepare("r1", name, b'{"model":"llama-3-8b","messages":[]}', port)
            release()
            return dict(json.loads(body))

        with trio.fail_after(TIMEOUT_S):
            # SGLang takes the adapter in `lora_path`; `model` stays the served base's.
            assert await served("poet@a1") == {"model": SERVED, "messages": [], "lora_path": "poet@a1"}
            await served("poet@a2")
            assert sglang.loaded == {"poet@a1": "/models/lora/poet@a1", "poet@a2": "/models/lora/poet@a2"}
            await served("poet@a2")  # loaded already: no call
            await served("coder@c1")  # --max-loaded-loras 2: the least recently used goes first
            assert sglang.loaded == {"poet@a2": "/models/lora/poet@a2", "coder@c1": "/models/lora/coder@c1"}
            # An adapter version no longer given (a rollout in place ended) is unloaded at the next load.
            now["r1"] = attrs.evolve(given, live={k: v for k, v in given.live.items() if k != "coder@c1"})
            await served("poet@a1")
            assert sglang.loaded == {"poet@a2": "/models/lora/poet@a2", "poet@a1": "/models/lora/poet@a1"}
        nursery.cancel_scope.cancel()
    assert [(path, body.get("lora_name")) for path, body in sglang.calls] == [
        ("/load_lora_adapter", "poet@a1"),
        ("/load_lora_adapter", "poet@a2"),
        ("/unload_lora_adapter", "poet@a1"),
        ("/load_lora_adapter", "coder@c1"),
        ("/unload_lora_adapter", "coder@c1"),
        ("/load_lora_adapter", "poet@a1"),
    ]
    assert (loras.loads, loras.unloads) == (4, 2)


async def test_a_load_sglang_refuses_fails_the_request_against_that_version_and_counts_nothing_loaded() -> None:
    sglang = SGLang(unreadable={"/models/lora/poet@a2"})
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(serve_runtime, sglang))
        loras = NodeLoras(lambda aid: view(port, live=("poet@a2",)))
        with trio.fail_after(TIMEOUT_S), pytest.raises(RuntimeFailed, match="refused to load LoRA adapter poet@a2"):
            await loras.prepare("r1", "poet@a2", b"{}", port)
        nursery.cancel_scope.cancel()
    assert sglang.loaded == {} and loras.loads == 0


async def test_an_adopted_sglang_keeps_what_it_holds_and_adapters_of_its_spec_are_never_loaded() -> None:
    sglang = SGLang(loaded={"poet@a1": "/models/lora/poet@a1"})  # loaded before this agent started
    async with trio.open_nursery() as nursery:
        port = await nursery.start(partial(serve_runtime, sglang))
        with trio.fail_after(TIMEOUT_S):
            adopted = NodeLoras(lambda aid: view(port, live=("poet@a1",)))
            body, done = await adopted.prepare("r1", "poet@a1", b"{}", port)
            done()
            assert json.loads(body) == {"lora_path": "poet@a1"} and adopted.loads == 0
            # Loaded at start (`--lora-paths`): named in the request, never loaded by the node.
            at_start = NodeLoras(lambda aid: view(port, spec=("poet",)))
            body, done = await at_start.prepare("r2", "poet", b'{"model":"llama-3-8b"}', port)
            done()
            assert json.loads(body) == {"model": SERVED, "lora_path": "poet"}
            # One given outside the spec that is not on the node yet: another replica is tried.
            waiting = view(port, live=("poet@a1",))
            waiting = attrs.evolve(waiting, live={"poet@a1": attrs.evolve(waiting.live["poet@a1"], path=None)})
            with pytest.raises(Unavailable, match="not on this replica's node yet"):
                await NodeLoras(lambda aid: waiting).prepare("r3", "poet@a1", b"{}", port)
        nursery.cancel_scope.cancel()
    assert sglang.calls == []
