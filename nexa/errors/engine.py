"""Errors of the container engine a node drives (node side)."""

from __future__ import annotations

from nexa.errors.base import NexaError


class EngineError(NexaError):
    """What a container engine driver (`nexa.node.engines`) raises: each driver translates its own
    engine's answers into this tree, so callers never learn which engine answered."""

    code = "engine_error"


class EngineUnavailable(EngineError):
    code = "engine_unavailable"
    retryable = True


class ImageNotFound(EngineError):
    code = "image_not_found"


class ContainerNotFound(EngineError, LookupError):
    code = "container_not_found"


class SimulationDisabled(EngineError):
    """A `sim` runtime assigned to a node without `simulation = true` (and NEXA_SIMULATION_ONLY=1)."""

    code = "simulation_disabled"
