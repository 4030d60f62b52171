"""Errors of the container engine a node drives (node side)."""

from __future__ import annotations

from nexa.errors.base import NexaError


class PodmanError(NexaError):
    code = "podman_error"


class PodmanUnavailable(PodmanError):
    code = "podman_unavailable"
    retryable = True


class ImageNotFound(PodmanError):
    code = "image_not_found"


class ContainerNotFound(PodmanError, LookupError):
    code = "container_not_found"


class SimulationDisabled(PodmanError):
    """A `sim` runtime assigned to a node without `simulation = true` (and NEXA_SIMULATION_ONLY=1)."""

    code = "simulation_disabled"
