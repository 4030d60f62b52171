"""`ContainerEngine`: what the node uses of a container engine, whichever answers (`engines.libpod`,
`engines.docker`), and `EngineTransport`, the drivers' fault-injection seam. Pure typing; no I/O."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping
from types import TracebackType
from typing import Protocol, Self

from nexa.contracts.runtime import ContainerDriver, EngineEvent
from nexa.node.engines.http import EngineTransport

__all__ = ["ContainerEngine", "EngineTransport"]


class ContainerEngine(ContainerDriver, Protocol):
    """A container engine's driver: the supervisor's `ContainerDriver` calls, plus what only an
    engine has. Every method raises only `nexa.errors` (`EngineError` and its subclasses for what
    the engine says, ContractError for a bad argument before any request)."""

    @property
    def name(self) -> str:
        """The engine, as messages and the node's inventory name it ("podman", "docker")."""
        ...

    async def __aenter__(self) -> Self: ...

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None = None,
        exc: BaseException | None = None,
        tb: TracebackType | None = None,
    ) -> None: ...

    async def version(self) -> str:
        """The engine's version; also the cheapest "does it answer" check."""
        ...

    def events(self, labels: Mapping[str, str], *, since: float | None = None) -> AsyncGenerator[EngineEvent, None]:
        """Container events of containers carrying all of `labels`, until the caller stops reading
        (use `contextlib.aclosing`)."""
        ...
