"""The model registry and a relay stream as the gateway reads them, for the gateway's tests without a
controller: one alias, `chat`, on `tiny@v1`, serving no LoRA adapter, and scripted streams
(tests/control/test_gateway.py, tests/control/test_gateway_unit.py, tests/test_sdcpp_adapter.py)."""

from __future__ import annotations

import attrs
import trio

from nexa.contracts import wire
from nexa.contracts.models import ModelRef
from nexa.errors import NotFound

REF = ModelRef(model="tiny", version="v1")


@attrs.frozen
class Version:
    """What the gateway reads of a model version: its name and version."""

    name: str
    version: str


@attrs.frozen
class Alias:
    """What the gateway reads of an alias record: the LoRA adapter it serves (none here)."""

    adapter: ModelRef | None = None


class FakeModels:
    """One alias, `chat`, on `tiny@v1`; any name@version resolves to itself."""

    def resolve(self, name: str) -> Version:
        if name != "chat":
            raise NotFound(f"no alias {name}")
        return Version(REF.model, REF.version)

    def alias(self, name: str) -> tuple[Alias, list[object]]:
        self.resolve(name)
        return Alias(), []

    def model(self, name: str, version: str) -> Version:
        return Version(name, version)

    def aliases(self) -> list[object]:
        return []


class FakeStream:
    """What the gateway reads of a relay stream: chunks, then the node's `end` (None: no end yet)."""

    def __init__(self, chunks: list[bytes], end: wire.EndHead | None, *, hang: bool) -> None:
        self._chunks = list(chunks)
        self._final = end
        self._hang = hang
        self.end: wire.EndHead | None = None
        #: The node's overhead figure of a first chunk (none here: the fake's chunks have empty heads).
        self.first_overhead_ms: float | None = None

    def waited_s(self, *, whole: bool) -> float:
        return 0.0

    async def receive_all(self) -> bytes | None:
        await trio.lowlevel.checkpoint()
        if self._chunks:
            return self._chunks.pop(0)
        if self._hang:
            await trio.sleep_forever()
        self.end = self._final
        return None

    async def receive(self) -> bytes | None:
        return await self.receive_all()
