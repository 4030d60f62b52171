"""The series the controller exports, named the way Prometheus names their samples: every family of
its `Metrics` registry and of the fleet collector (`nexa.telemetry.fleet`), with each type's suffixes."""

from __future__ import annotations

from typing import Final

from nexa.telemetry import Metrics
from nexa.telemetry.fleet import FleetCollector

#: The sample names of a family, by its type (a counter `x` is scraped as `x_total`).
SUFFIXES: Final = {
    "counter": ("_total",),
    "histogram": ("_bucket", "_sum", "_count"),
    "gauge": ("",),
    "info": ("_info",),
}


def exported_series() -> set[str]:
    families = [*Metrics().registry.collect(), *FleetCollector(tuple).describe()]
    return {family.name + suffix for family in families for suffix in SUFFIXES.get(family.type, ("",))}
