"""When a node's signed state is a change worth sending at once (`nexa.node.agent` beats the rest of
the time: a liveness beat, or the state at its interval). Pure."""

from __future__ import annotations

from typing import Final

import attrs

from nexa.contracts import wire
from nexa.contracts.node import steady_inventory

#: Free memory that moves by less than this share of the node's memory (or `_MEMORY_STEP_MIN_BYTES`,
#: whichever is more) since the last state sent is not a change of state by itself.
_MEMORY_STEP_SHARE: Final = 0.01
_MEMORY_STEP_MIN_BYTES: Final = 256 * 1024**2

#: What `changed` compares a new state with: the last one sent, `steady`, and its free memory.
Sent = tuple[wire.Heartbeat, int]


def sent(state: wire.Heartbeat) -> Sent:
    """What to keep of a state just sent, for `changed`."""
    return steady(state), state.free_memory_bytes


def changed(last: Sent | None, state: wire.Heartbeat) -> bool:
    """Whether `state` differs from the last one sent (None: none yet) in more than what moves by itself."""
    if last is None:
        return True
    before, free = last
    step = max(_MEMORY_STEP_MIN_BYTES, int(state.inventory.memory_total_bytes * _MEMORY_STEP_SHARE))
    return steady(state) != before or abs(state.free_memory_bytes - free) >= step


def steady(state: wire.Heartbeat) -> wire.Heartbeat:
    """`state` without what moves by itself between two reads: the clock of discovery, GPU
    telemetry, free memory (compared with a step: `changed`), each load's age and the free room of
    the artifact and runtime caches' filesystems (other programs write there too)."""
    return attrs.evolve(
        state,
        inventory=steady_inventory(state.inventory),
        free_memory_bytes=0,
        cache_disk=attrs.evolve(state.cache_disk, free_bytes=0) if state.cache_disk is not None else None,
        runtime_cache=attrs.evolve(state.runtime_cache, free_bytes=0) if state.runtime_cache is not None else None,
        assignments=[
            attrs.evolve(s, load=attrs.evolve(s.load, age_s=0.0)) if s.load is not None else s
            for s in state.assignments
        ],
    )
