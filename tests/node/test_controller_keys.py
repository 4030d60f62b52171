"""The node's side of a controller key rotation (issue 17, point 6), over a real channel.

The controller announces its new signing key in a message signed with the key the node pins; the
node pins it (on disk, so a restart keeps it), accepts sets signed with either key until the
overlap ends, then only the new one: a set signed with the old key is refused (counted, never
judged, nothing written). An announcement signed with a retired key, or one that does not follow
the key pinned now, changes nothing.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import trio

from nexa import security
from nexa.channel import links
from nexa.config import NodeConfig
from nexa.contracts import wire
from nexa.node import identity
from nexa.node.identity import load_fence
from tests.support.nodes import FakeController, aset, start_node

TIMEOUT_S = 60


def _announce(old: security.SigningKey, new: security.SigningKey, until: float) -> wire.ControllerKeysAnnounced:
    return wire.ControllerKeysAnnounced(
        node_id="n1",
        key_id=new.public.fingerprint,
        signing_public_key=new.public.b64,
        curve_public_key=links.generate_curve_keypair().public,
        previous_key_id=old.public.fingerprint,
        overlap_until=until,
    )


async def _bad_signatures_above(node: object, n: int) -> None:
    while node.agent.statistics().bad_signatures <= n:  # type: ignore[attr-defined]  # noqa: ASYNC110
        await trio.sleep(0.01)


@pytest.mark.slow
async def test_the_node_pins_the_new_controller_key_then_refuses_the_old_after_the_overlap(
    nursery: trio.Nursery, ctl: FakeController, cfg: NodeConfig, state_dir: Path
) -> None:
    old, new = ctl.key, security.generate_signing_key()
    with trio.fail_after(TIMEOUT_S):
        node = await start_node(nursery, cfg)
        await ctl.next(wire.Hello)
        assert ctl.link is not None
        overlap_s = 3.0
        until = time.time() + overlap_s
        await ctl.link.send("n1", _announce(old, new, until))  # signed with the key the node pins
        await ctl.next(wire.Heartbeat, lambda _: identity.load_enrollment(state_dir).previous_controller_key_until > 0)
        record = identity.load_enrollment(state_dir)
        assert record.controller_signing_public_key == new.public.b64
        assert record.previous_controller_signing_public_key == old.public.b64

        # Within the overlap: sets signed with the new key and with the old one are accepted.
        ctl.link.use_signing_key(new)
        assert (await ctl.answer(aset(2, 1))).accepted
        ctl.link.use_signing_key(old)
        assert (await ctl.answer(aset(2, 2))).accepted

        # A restart keeps the pinned keys (the identity record).
        assert [k.fingerprint for k, _ in identity.load_identity(state_dir).controller_keys] == [
            new.public.fingerprint,
            old.public.fingerprint,
        ]

        # After the overlap: the old key is refused, typed and counted; nothing is judged or written.
        await trio.sleep_until(trio.current_time() + max(0.0, until - time.time()) + 0.1)  # the overlap's end
        bad = node.agent.statistics().bad_signatures
        await ctl.push(aset(2, 3))
        await _bad_signatures_above(node, bad)
        stats = node.agent.statistics()
        assert (stats.epoch, stats.generation) == (2, 2)
        assert load_fence(state_dir).generation == 2

        # A retired key cannot name a successor either, even a well-formed one: nothing changes.
        stranger = security.generate_signing_key()
        await ctl.link.send("n1", _announce(new, stranger, time.time() + 60))  # signed by `old`
        await _bad_signatures_above(node, bad + 1)
        assert identity.load_enrollment(state_dir).controller_signing_public_key == new.public.b64

        ctl.link.use_signing_key(new)
        assert (await ctl.answer(aset(2, 4))).accepted


async def test_an_announcement_that_does_not_follow_the_pinned_key_changes_nothing(
    nursery: trio.Nursery, ctl: FakeController, cfg: NodeConfig, state_dir: Path
) -> None:
    before = identity.load_enrollment(state_dir)
    with trio.fail_after(TIMEOUT_S):
        node = await start_node(nursery, cfg)
        await ctl.next(wire.Hello)
        assert ctl.link is not None
        # Signed with the pinned key, but it names another key as the one it replaces.
        other = security.generate_signing_key()
        bogus = _announce(other, security.generate_signing_key(), time.time() + 60)
        invalid = node.agent.statistics().invalid_messages
        await ctl.link.send("n1", bogus)
        while node.agent.statistics().invalid_messages == invalid:  # noqa: ASYNC110
            await trio.sleep(0.01)
    assert identity.load_enrollment(state_dir) == before
