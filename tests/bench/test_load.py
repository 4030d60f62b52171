"""The closed and open loops of a step, in virtual time, with a fake call in place of the gateway."""

from __future__ import annotations

import trio

from nexa.bench.load import CLIENT_SATURATED, MAX_IN_FLIGHT, Tally, closed_loop, open_loop
from nexa.bench.stats import Sample


async def test_a_closed_loop_keeps_each_client_busy_until_the_step_ends(autojump_clock: trio.testing.MockClock) -> None:
    in_flight = most = 0

    async def call(i: int) -> Sample:
        nonlocal in_flight, most
        in_flight += 1
        most = max(most, in_flight)
        await trio.sleep(0.125)  # exact in binary: no drift over the step
        in_flight -= 1
        return Sample(e2e_ms=125.0)

    tally = Tally()
    seconds = await closed_loop(call, 4, 1.0, tally)
    assert most == 4
    assert len(tally.samples) == 32  # 4 clients, 8 requests each in 1 s
    assert seconds == 1.0  # the last requests finish after the deadline; none is cut off


async def test_an_open_loop_starts_requests_at_its_rate_whatever_answers(
    autojump_clock: trio.testing.MockClock,
) -> None:
    starts: list[float] = []

    async def call(i: int) -> Sample:
        starts.append(trio.current_time())
        await trio.sleep(3.0)  # slower than the rate: the loop does not wait for answers
        return Sample(e2e_ms=3000.0)

    tally = Tally()
    t0 = trio.current_time()
    await open_loop(call, 10.0, 2.0, tally)
    assert len(tally.samples) == 20
    assert [round(s - t0, 6) for s in starts] == [round(i / 10, 6) for i in range(20)]


async def test_an_open_loop_counts_what_it_cannot_start(autojump_clock: trio.testing.MockClock) -> None:
    async def call(i: int) -> Sample:
        await trio.sleep(60.0)
        return Sample(e2e_ms=60_000.0)

    tally = Tally()
    await open_loop(call, 2000.0, 1.0, tally)
    saturated = [s for s in tally.samples if s.error == CLIENT_SATURATED]
    assert len(saturated) == 2000 - MAX_IN_FLIGHT
