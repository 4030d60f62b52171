"""A request for a LoRA adapter (`InferHead.lora`), named to the runtime as that runtime expects
(`nexa.adapters.lora`), loading the adapter first where the runtime loads them at run time.

* llama.cpp (`llama-server`): every adapter of the assignment was loaded at start, at scale 0; the
  request gets `"lora": [{"id": N, "scale": 1.0}]`, N the adapter's place in `RuntimeSpec.loras`.
* SGLang: the request's `lora_path` field becomes the adapter's name (its `model` stays the base's).
  Loaded at start, or, given its adapters outside its spec (`RuntimeSpec.live_loras`), at run time
  as vLLM's are, at its own endpoints (`nexa.adapters.lora.SGLANG_ENDPOINTS`).
* vLLM and `sim`: the adapter is loaded when a request first needs it (`POST /v1/load_lora_adapter`
  `{"lora_name", "lora_path"}`), without restarting the runtime; when the runtime's limit
  (`--max-loras`) is reached, the least recently used adapter is unloaded first
  (`POST /v1/unload_lora_adapter` `{"lora_name"}`). The request's `model` becomes the adapter's name.
  Besides the spec's `loras`, such a runtime may be given adapters outside its spec
  (`RuntimeSpec.live_loras`, `Assignment.loras`, kept on the node by `nexa.node.liveloras`): one
  given but not lying in the assignment's adapter directory yet is Unavailable (the gateway tries
  another replica), and an adapter loaded but no longer given is unloaded, once no request uses it,
  at the next request that needs the runtime's adapters.

What is loaded is kept per runtime start: a restarted runtime starts with none loaded.
"""

from __future__ import annotations

import collections
import functools
import json
import logging
from collections.abc import Callable, Mapping, Set
from pathlib import Path
from typing import Final

import attrs
import trio

from nexa.adapters.lora import LORA_MOUNT_ROOT, VLLM_ENDPOINTS, LoraEndpoints, endpoints, limit_flag, limit_in
from nexa.contracts.manifest import entry_path
from nexa.contracts.node import RuntimeKind
from nexa.contracts.runtime import LoraSpec, RuntimeSpec
from nexa.errors import ContractError, RuntimeFailed, Unavailable
from nexa.node.http1 import RuntimeClient, RuntimeHTTPError

log = logging.getLogger(__name__)

#: What a runtime lists as loaded, adapters included (vLLM: each with its base as `parent`).
MODELS_PATH: Final = "/v1/models"
MODELS_MAX_BYTES: Final = 1 << 20
#: Loading an adapter reads its files and moves them to the accelerator: bounded, not instant.
LOAD_TIMEOUT_S: Final = 120.0
CONNECT_TIMEOUT_S: Final = 5.0


@attrs.frozen(kw_only=True)
class LiveLora:
    """An adapter of the assignment's `Assignment.loras` (`RuntimeSpec.live_loras`)."""

    lora: LoraSpec
    #: Its entry in the assignment's adapter directory on the node (`<dir>/<name>`), None until it lies there.
    path: Path | None


@attrs.frozen(kw_only=True)
class LoraView:
    """A Ready assignment as the relay sees it for adapters (`Supervisor.lora_view`)."""

    runtime: RuntimeSpec
    #: Where this node holds each of `runtime.loras`' verified files, in order.
    paths: list[Path]
    #: When its runtime started (what is loaded belongs to that start).
    started_at: float
    #: The adapters given outside the spec (`Assignment.loras`), by name.
    live: Mapping[str, LiveLora] = attrs.field(factory=dict)


class LoraSlots:
    """The adapters one runtime start has loaded, least recently used first, within its limit."""

    def __init__(self, limit: int, paths: LoraEndpoints = VLLM_ENDPOINTS) -> None:
        self.limit = limit
        #: Where the runtime takes loads and unloads.
        self.paths = paths
        self.loaded: collections.OrderedDict[str, None] = collections.OrderedDict()
        #: Requests in flight per adapter: one in use is never unloaded under them.
        self.in_use: collections.Counter[str] = collections.Counter()
        self.lock = trio.Lock()
        #: What the runtime held when these slots were made was read (`_read_loaded`).
        self.read = False

    def release(self, name: str) -> None:
        """A request that `ensure` let use `name` is done."""
        self.in_use[name] -= 1

    async def ensure(
        self, where: tuple[str, int], name: str, path: str, *, given: Set[str] | None = None
    ) -> tuple[bool, list[str]]:
        """Load `name` from `path` unless loaded (then it becomes the most recently used), unloading
        the least recently used one that no request is using first while the limit is reached; the
        runtime at `where` (host, port). Loaded adapters not in `given` (when given) that no request
        uses are unloaded first. The caller uses it until it calls `release(name)`. Whether it was
        loaded now, and the names unloaded. Raises Unavailable when every loaded adapter is in use
        at the limit, or the runtime refuses or cannot be reached (nothing is counted loaded then)."""
        async with self.lock:
            if not self.read:
                # A runtime this agent adopted (its predecessor's, still running after an agent
                # restart) may hold adapters already: loading one again would be refused.
                for held in await _read_loaded(where):
                    self.loaded.setdefault(held, None)
                self.read = True
            stale = [n for n in self.loaded if given is not None and n not in given and not self.in_use[n]]
            fresh = name not in self.loaded
            idle = [n for n in self.loaded if not self.in_use[n] and n not in stale]
            if fresh and len(self.loaded) - len(stale) - len(idle) >= self.limit:
                raise Unavailable(
                    f"all {self.limit} LoRA adapters this replica may hold at once (--max-loras) are serving "
                    "requests; retry, or raise the deployment's max_loras"
                )
            unloaded: list[str] = []
            if stale or fresh:
                # Its own connection: loads are rare, and never wait behind (or hold) the relay's pool.
                client = RuntimeClient(connect_timeout_s=CONNECT_TIMEOUT_S, max_idle=1)
                try:
                    for gone in stale:
                        try:
                            await self._post(client, where, {"lora_name": gone}, f"unload LoRA adapter {gone}")
                        except Unavailable as exc:
                            # Still loaded as far as we know: tried again at the next request.
                            log.warning("LoRA adapter %s is no longer given but stays loaded: %s", gone, exc)
                            continue
                        del self.loaded[gone]
                        unloaded.append(gone)
                    while fresh and len(self.loaded) >= self.limit:
                        if not idle:  # an adapter no longer given could not be unloaded
                            raise Unavailable(f"the runtime holds {len(self.loaded)} LoRA adapters, its limit")
                        oldest = idle.pop(0)
                        await self._post(client, where, {"lora_name": oldest}, f"unload LoRA adapter {oldest}")
                        del self.loaded[oldest]
                        unloaded.append(oldest)
                    if fresh:
                        load = {"lora_name": name, "lora_path": path}
                        await self._post(client, where, load, f"load LoRA adapter {name}", loads=True)
                finally:
                    await client.aclose()
            self.loaded[name] = None
            self.loaded.move_to_end(name)
            self.in_use[name] += 1
            return fresh, unloaded

    async def _post(
        self, client: RuntimeClient, where: tuple[str, int], body: dict[str, str], what: str, *, loads: bool = False
    ) -> None:
        """One load (`loads`) or unload call at the runtime's endpoint for it (`_post`)."""
        await _post(client, where, self.paths.load if loads else self.paths.unload, body, what, loads=loads)


async def _read_loaded(where: tuple[str, int]) -> list[str]:
    """The LoRA adapters the runtime at `where` lists as loaded (`GET /v1/models`: vLLM lists each
    with its base as `parent`; the base itself has none); [] when it cannot say (nothing is
    assumed loaded then, as before)."""
    client = RuntimeClient(connect_timeout_s=CONNECT_TIMEOUT_S, max_idle=1)
    try:
        status, body = await client.get(*where, MODELS_PATH, timeout_s=CONNECT_TIMEOUT_S, max_bytes=MODELS_MAX_BYTES)
        answer = json.loads(body) if status == 200 else None
    except (RuntimeHTTPError, ValueError) as exc:
        log.warning("could not read the LoRA adapters the runtime at port %d holds: %s", where[1], exc)
        return []
    finally:
        await client.aclose()
    listed = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(listed, list):
        return []
    return [
        card["id"]
        for card in listed
        if isinstance(card, dict) and isinstance(card.get("id"), str) and isinstance(card.get("parent"), str)
    ]


async def _post(
    client: RuntimeClient, where: tuple[str, int], path: str, body: dict[str, str], what: str, *, loads: bool
) -> None:
    """One load (`loads`) or unload call, its answer read whole within LOAD_TIMEOUT_S; Unavailable
    unless 2xx: RuntimeFailed when the runtime answered a load with an error (the adapter failed
    there: it counts against that adapter version, unlike a runtime that cannot be reached)."""
    payload = json.dumps(body).encode()
    with trio.move_on_after(LOAD_TIMEOUT_S) as scope:
        try:
            async with client.post(*where, path, payload, (("Content-Type", "application/json"),)) as resp:
                async for _ in resp.aiter_bytes():
                    pass
                status = resp.status_code
        except RuntimeHTTPError as exc:
            raise Unavailable(f"the runtime did not answer to {what}: {exc}") from None
    if scope.cancelled_caught:
        raise Unavailable(f"the runtime did not {what} within {LOAD_TIMEOUT_S:g} s")
    if status >= 400:
        refused = RuntimeFailed if loads else Unavailable
        raise refused(f"the runtime refused to {what} (HTTP {status})")


class NodeLoras:
    """The relay's hook (`NodeRelay(lora=…)`): the body a request for an adapter is sent with."""

    def __init__(self, view: Callable[[str], LoraView | None], *, host: str = "127.0.0.1") -> None:
        self._view = view
        self._host = host
        self._slots: dict[tuple[str, float], LoraSlots] = {}
        self.loads = self.unloads = 0

    async def prepare(self, assignment_id: str, name: str, body: bytes, port: int) -> tuple[bytes, Callable[[], None]]:
        """`body` rewritten for adapter `name` of that assignment (loaded first where the runtime
        loads at run time), and what to call once the request is done (until then the adapter is
        not unloaded). Unavailable when the runtime is not Ready or does not have the adapter (the
        gateway tries another replica); ContractError when the body is not a JSON object."""
        view = self._view(assignment_id)
        if view is None:
            raise Unavailable("the runtime is not Ready")
        index = next((i for i, lora in enumerate(view.runtime.loras) if lora.name == name), None)
        live = view.live.get(name) if index is None else None
        if index is None and live is None:
            raise Unavailable(f"this replica does not load the LoRA adapter {name!r}")
        if live is not None and (live.path is None or not _loads_on_request(view.runtime)):
            raise Unavailable(f"the LoRA adapter {name!r} is not on this replica's node yet")
        try:
            request = json.loads(body)
        except ValueError:
            raise ContractError("the request body is not JSON") from None
        if not isinstance(request, dict):
            raise ContractError("the request body is not a JSON object")
        kind = view.runtime.kind
        release: Callable[[], None] = _nothing
        if kind is RuntimeKind.LLAMACPP and index is not None:
            request["lora"] = [{"id": index, "scale": 1.0}]
        else:
            if _loads_on_request(view.runtime):
                path = _path(view, view.runtime.loras[index], index) if index is not None else _live_path(view, live)
                slots = await self._ensure(assignment_id, view, name, path, port)
                release = functools.partial(slots.release, name)
            request["lora_path" if kind is RuntimeKind.SGLANG else "model"] = name
        return json.dumps(request, separators=(",", ":")).encode(), release

    async def _ensure(self, assignment_id: str, view: LoraView, name: str, path: str, port: int) -> LoraSlots:
        key = (assignment_id, view.started_at)
        slots = self._slots.get(key)
        if slots is None:
            for old in [k for k in self._slots if k[0] == assignment_id]:
                del self._slots[old]  # an earlier start of the same assignment: nothing of it is loaded now
            slots = self._slots[key] = LoraSlots(1, endpoints(view.runtime.kind))
        # The number given changes with the live adapters: the limit follows it (unless the command sets one).
        bound = limit_in(view.runtime.command, limit_flag(view.runtime.kind))
        slots.limit = bound or max(1, len(view.runtime.loras) + len(view.live))
        given = {lora.name for lora in view.runtime.loras} | set(view.live)
        fresh, unloaded = await slots.ensure((self._host, port), name, path, given=given)
        self.unloads += len(unloaded)
        if unloaded and not fresh:
            log.info("assignment %s: LoRA adapter(s) %s unloaded: no longer given", assignment_id, ", ".join(unloaded))
        if not fresh:
            return slots
        self.loads += 1
        log.info(
            "assignment %s: LoRA adapter %s loaded%s",
            assignment_id,
            name,
            f" (unloaded {', '.join(unloaded)})" if unloaded else "",
        )
        return slots


def _loads_on_request(runtime: RuntimeSpec) -> bool:
    """Whether the node loads the runtime's adapters when a request first needs them: vLLM's and
    sim's always, SGLang's when given outside its spec (it loaded those of its spec at start)."""
    return runtime.kind in {RuntimeKind.VLLM, RuntimeKind.SIM} or (
        runtime.kind is RuntimeKind.SGLANG and runtime.live_loras
    )


def _nothing() -> None:
    """The release of a request whose adapter the runtime holds for good (loaded at start)."""


def _path(view: LoraView, lora: LoraSpec, index: int) -> str:
    """Where the runtime reads the adapter: a `sim` process on the node's own path, a container at its mount."""
    if view.runtime.kind is not RuntimeKind.SIM:
        return lora.artifact.model_path
    held = view.paths[index]
    return str(held / lora.artifact.entry) if lora.artifact.files and lora.artifact.entry else str(held)


def _live_path(view: LoraView, live: LiveLora | None) -> str:
    """Where the runtime reads an adapter given outside the spec: a `sim` process at its entry in
    the assignment's adapter directory, a container at that entry under the directory's mount."""
    assert live is not None  # checked by `prepare`, as its path
    assert live.path is not None
    ref = live.lora.artifact
    where = str(live.path) if view.runtime.kind is RuntimeKind.SIM else f"{LORA_MOUNT_ROOT}/{live.lora.name}"
    return entry_path(where, ref.entry) if ref.files else where
