"""The model registry as the gateway reads it, for the gateway's tests without a controller:
one alias, `chat`, on `tiny@v1`, serving no LoRA adapter (tests/control/test_gateway.py and
tests/control/test_gateway_unit.py)."""

from __future__ import annotations

import attrs

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
