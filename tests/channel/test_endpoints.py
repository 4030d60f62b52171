"""`nexa.channel.endpoints.NodeChannel` across a key rotation, with fake uplinks (the real ones are in the e2e rotation
tests): which requests finish on the old connection, and when that connection closes.

Virtual time (`trio.testing.MockClock` with autojump): a closing time is read off the clock, so
"closed after the grace, not after DRAIN_MAX_S" is exact, never a wall-clock timing.
"""

from __future__ import annotations

from typing import NoReturn

import attrs
import trio
import trio.testing

from nexa.channel.endpoints import DRAIN_GRACE_S, DRAIN_MAX_S, Dial, NodeChannel
from nexa.channel.links import generate_curve_keypair
from nexa.contracts import wire
from nexa.security import generate_signing_key


@attrs.define(eq=False)
class _Stats:
    received: int = 0


@attrs.define(eq=False)
class FakeUplink:
    """Records the data frames sent on it and when its connection closed; its start waits for `gate`."""

    name: str
    gate: trio.Event
    sent: list[tuple[str, str]] = attrs.Factory(list)
    closed_at: float | None = None
    stats: _Stats = attrs.Factory(_Stats)

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> NoReturn:
        await self.gate.wait()
        task_status.started()
        try:
            await trio.sleep_forever()
        finally:
            self.closed_at = trio.current_time()

    async def send_data(self, kind: str, request_id: str, head: bytes, body: bytes) -> None:
        self.sent.append((kind, request_id))

    async def receive_unverified(self) -> wire.DataFrame:
        self.stats.received += 1
        return wire.DataFrame(kind=wire.CREDIT, request_id="r9", head=b"", body=b"")

    def wake(self) -> None:
        pass

    def statistics(self) -> _Stats:
        return self.stats


def _dial() -> Dial:
    return Dial(
        curve=generate_curve_keypair(),
        signing_key=generate_signing_key(),
        server_curve_public=generate_curve_keypair().public,
        endpoint="tcp://127.0.0.1:1",
    )


async def test_a_request_that_ends_while_the_new_connection_starts_does_not_hold_the_old_one_open(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """Regression: the open requests were read before the new connection's start (an await); one
    that ended meanwhile stayed listed forever and kept the old connection to DRAIN_MAX_S."""
    opened = trio.Event()
    opened.set()
    new_gate = trio.Event()
    uplinks: list[FakeUplink] = []

    def make(_: Dial, __: object) -> FakeUplink:
        uplink = FakeUplink(f"u{len(uplinks)}", opened if not uplinks else new_gate)
        uplinks.append(uplink)
        return uplink

    running = {"r1", "r2"}
    async with trio.open_nursery() as nursery:
        channel = NodeChannel(make, _dial())  # type: ignore[arg-type]  # the fake has what the channel uses
        await nursery.start(channel.run)
        old = uplinks[0]
        rotation_done = trio.Event()

        async def rotate() -> None:
            await channel.rekey(generate_curve_keypair(), generate_signing_key(), lambda _: sorted(running))
            rotation_done.set()

        nursery.start_soon(rotate)
        await trio.testing.wait_all_tasks_blocked()  # the new connection is starting (waits for its gate)
        await channel.send_data(wire.END, "r1", b"", b"")  # r1 ends meanwhile: on the current (old) one
        running.discard("r1")
        new_gate.set()
        await rotation_done.wait()
        new = uplinks[1]

        await channel.send_data(wire.CHUNK, "r2", b"", b"")  # open at the switch: stays on the old one
        await channel.send_data(wire.CHUNK, "r3", b"", b"")  # new: on the new one
        await channel.receive_unverified()  # the controller has moved its route to the new connection
        ended_at = trio.current_time()
        await channel.send_data(wire.END, "r2", b"", b"")
        while old.closed_at is None:  # noqa: ASYNC110 - the fake signals nothing; virtual time
            await trio.sleep(0.1)
        nursery.cancel_scope.cancel()

    assert old.sent == [(wire.END, "r1"), (wire.CHUNK, "r2"), (wire.END, "r2")]
    assert new.sent == [(wire.CHUNK, "r3")]
    assert old.closed_at - ended_at < DRAIN_GRACE_S + 1 < DRAIN_MAX_S
