"""`nexa.channel.flow`: the data path's credit window, both halves (pure; virtual time)."""

from __future__ import annotations

import trio
import trio.testing

from nexa.channel.flow import CreditReturn, SendWindow


def test_credit_goes_back_every_half_window_taken() -> None:
    credits = CreditReturn(window=4)
    assert [credits.took() for _ in range(5)] == [0, 2, 0, 2, 0]
    assert credits.took(3) == 4  # one left over, three more taken at once
    assert [CreditReturn(window=1).took() for _ in range(2)] == [1, 1]  # a window of one: every chunk


async def test_a_sender_waits_at_the_window_until_credit_comes(autojump_clock: trio.testing.MockClock) -> None:
    window = SendWindow(2)
    for _ in range(2):
        await window.room()
        window.sent_one()
    assert window.unacknowledged == 2
    window.credit(0)  # nothing: ignored
    window.credit(-3)
    with trio.move_on_after(1) as waited:
        await window.room()
    assert waited.cancelled_caught and not window.waiting
    async with trio.open_nursery() as nursery:
        nursery.start_soon(window.room)
        await trio.testing.wait_all_tasks_blocked()
        assert window.waiting
        window.credit(1)
    window.sent_one()
    assert (window.allowed, window.sent, window.unacknowledged) == (3, 3, 2)
    assert SendWindow(0).window == 1  # a window below one is one
