"""One benchmark step in trio: a closed loop (`concurrency` clients, each sending its next request
when the last one ends) or an open loop (requests started at a fixed rate, whatever answers).

Neither cancels a request in flight when the step's time is up: requests stop being started, and
the step ends when the last one has answered (each is bounded by the gateway client's timeout).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Final

import attrs
import trio

from nexa.bench.stats import Sample

#: One request of a step: its number in the step (for the mix and the prompt), timed into a sample.
Call = Callable[[int], Awaitable[Sample]]

#: An open-loop step starts no more requests than this at once; the ones it cannot start count as
#: `client_saturated` (the client's limit, not the gateway's answer).
MAX_IN_FLIGHT: Final = 1024
CLIENT_SATURATED: Final = "client_saturated"


@attrs.define
class Tally:
    """What a running step has so far (read by the progress bar)."""

    #: The trio clock when the step started; None before.
    started_at: float | None = None
    samples: list[Sample] = attrs.Factory(list)

    @property
    def errors(self) -> int:
        return sum(1 for s in self.samples if s.error is not None)


async def closed_loop(call: Call, concurrency: int, duration_s: float, tally: Tally) -> float:
    """`concurrency` clients for `duration_s`; returns the step's seconds (to its last answer)."""
    tally.started_at = start = trio.current_time()
    deadline = start + duration_s
    counter = iter(range(2**62))

    async def client() -> None:
        while trio.current_time() < deadline:
            tally.samples.append(await call(next(counter)))

    async with trio.open_nursery() as nursery:
        for _ in range(concurrency):
            nursery.start_soon(client)
    return trio.current_time() - start


async def open_loop(call: Call, rate_rps: float, duration_s: float, tally: Tally) -> float:
    """Start `rate_rps` requests a second for `duration_s`; returns the step's seconds."""
    tally.started_at = start = trio.current_time()
    total = max(1, round(rate_rps * duration_s))
    in_flight = 0

    async def one(i: int) -> None:
        nonlocal in_flight
        try:
            tally.samples.append(await call(i))
        finally:
            in_flight -= 1

    async with trio.open_nursery() as nursery:
        for i in range(total):
            await trio.sleep_until(start + i / rate_rps)
            if in_flight >= MAX_IN_FLIGHT:
                tally.samples.append(Sample(e2e_ms=0.0, error=CLIENT_SATURATED))
                continue
            in_flight += 1
            nursery.start_soon(one, i)
    return trio.current_time() - start
