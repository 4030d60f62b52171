"""`nexa.node.beats`: which differences in a node's state are worth a signed state at once (the rest
wait for a liveness beat's company and the state interval)."""

from __future__ import annotations

import attrs

from nexa.contracts import wire
from nexa.node.beats import changed, sent
from tests.conftest import gb10_inventory

CACHE = wire.RuntimeCacheDisk(
    used_bytes=1 << 30, max_bytes=100 << 30, directories=1, in_use=1, free_bytes=50 << 30, total_bytes=250 << 30
)
ARTIFACTS = wire.CacheDisk(used_bytes=4 << 30, free_bytes=50 << 30, total_bytes=250 << 30)


def _state(**changes: object) -> wire.Heartbeat:
    state = wire.Heartbeat(
        node_id="n1",
        seq=1,
        ts=1_000.0,
        inventory=gb10_inventory("n1"),
        free_memory_bytes=100 << 30,
        free_accelerators=1,
        assignments=[],
        runtime_cache=CACHE,
        cache_disk=ARTIFACTS,
    )
    return attrs.evolve(state, **changes)


def test_what_moves_by_itself_is_no_change() -> None:
    last = sent(_state())
    assert not changed(last, _state())
    # The cache's filesystem room moves with every other program writing there.
    assert not changed(last, _state(runtime_cache=attrs.evolve(CACHE, free_bytes=10 << 30)))
    # So does the artifact cache's (a busy disk once sent a state every beat).
    assert not changed(last, _state(cache_disk=attrs.evolve(ARTIFACTS, free_bytes=49 << 30)))
    # Free memory within a step (1 % of the node's memory, at least 256 MiB).
    assert not changed(last, _state(free_memory_bytes=(100 << 30) - (200 << 20)))


def test_a_change_of_what_the_node_reports_is_a_change() -> None:
    last = sent(_state())
    assert changed(None, _state())
    assert changed(last, _state(free_memory_bytes=(100 << 30) - (2 << 30)))
    assert changed(last, _state(runtime_cache=attrs.evolve(CACHE, used_bytes=2 << 30)))
    assert changed(last, _state(runtime_cache=None))
    assert changed(last, _state(cache_disk=attrs.evolve(ARTIFACTS, used_bytes=5 << 30)))  # an artifact fetched
    assert changed(sent(_state(runtime_cache=None)), _state())  # its first measurement
    assert changed(last, _state(free_accelerators=0))
