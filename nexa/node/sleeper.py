"""A runtime's own sleep, driven by the node (`SleepKeeper`, run by the `Supervisor`).

The controller sets `Assignment.asleep` on a replica whose runtime has its own sleep enabled
(`adapters.native_sleep_for`: vLLM's `--enable-sleep-mode`, and the `sim` runtime's). The keeper
puts each Ready such runtime to sleep or wakes it as its assignment says, by the runtime's own
routes (`POST /sleep?level=1`, `POST /wake_up`), and believes it only once `GET /is_sleeping`
agrees; the replica reports `asleep` in its status from then on, and is never routed while asleep.

The runtime is untrusted: each call is time-bounded, and an answer that fails, or that
`/is_sleeping` contradicts, is a `RuntimeSleepError`. A failed sleep leaves the runtime awake and
reports `sleep_failed` (the controller then stops its container instead, as for a runtime without
its own sleep) and is not retried until the assignment is woken. A failed wake is retried once;
then its container is stopped, so that it restarts awake (a restart, as after a crash).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Awaitable, Callable, Iterable
from typing import Final, NoReturn

import trio

from nexa.adapters import native_sleep_for
from nexa.adapters.base import NativeSleep
from nexa.contracts import wire
from nexa.node.http1 import RuntimeClient, RuntimeHTTPError
from nexa.node.replicas import Worker

log = logging.getLogger(__name__)

#: Longest a sleep or a wake may take to answer (seconds): vLLM's level-1 wake copies the weights
#: back from CPU RAM (seconds for a big model).
SWITCH_TIMEOUT_S: Final = 60.0
#: Longest `GET /is_sleeping` may take (seconds), and the most bytes its answer may have.
STATE_TIMEOUT_S: Final = 5.0
_MAX_STATE_BYTES: Final = 4096
#: Wakes that fail in a row before the container is stopped to restart awake.
WAKE_ATTEMPTS: Final = 2
#: How often the keeper looks at most when nothing changes (seconds).
_LOOK_S: Final = 1.0


class RuntimeSleepError(Exception):
    """The runtime's sleep or wake failed, timed out, or `/is_sleeping` contradicted it."""


async def switch(client: RuntimeClient, host: str, port: int, sleep: NativeSleep, *, asleep: bool) -> None:
    """Put the runtime on `host:port` to sleep (`asleep`) or wake it, and check that it says so."""
    path = sleep.sleep_path if asleep else sleep.wake_path
    try:
        with trio.move_on_after(SWITCH_TIMEOUT_S) as scope:
            async with client.post(host, port, path, b"") as response:
                status = response.status_code
                async for _ in response.aiter_bytes():
                    pass  # read whole (vLLM answers an empty or a tiny body), so the connection is reusable
        if scope.cancelled_caught:
            raise RuntimeSleepError(f"POST {path}: no answer within {SWITCH_TIMEOUT_S:g} s")
        if not 200 <= status < 300:
            raise RuntimeSleepError(f"POST {path} answered {status}")
        status, body = await client.get(
            host, port, sleep.state_path, timeout_s=STATE_TIMEOUT_S, max_bytes=_MAX_STATE_BYTES
        )
    except RuntimeHTTPError as exc:
        raise RuntimeSleepError(f"{'sleep' if asleep else 'wake'}: {exc}") from None
    if status != 200:
        raise RuntimeSleepError(f"GET {sleep.state_path} answered {status}")
    try:
        answer = json.loads(body)
    except (ValueError, RecursionError):
        answer = None
    said = answer.get("is_sleeping") if isinstance(answer, dict) else None
    if not isinstance(said, bool):
        raise RuntimeSleepError(f'GET {sleep.state_path}: not {{"is_sleeping": true|false}}')
    if said is not asleep:
        raise RuntimeSleepError(f"after POST {path}, GET {sleep.state_path} says is_sleeping={str(said).lower()}")


class SleepKeeper:
    """Keeps each Ready runtime with its own sleep asleep or awake as its assignment says."""

    def __init__(self, host: str, restart: Callable[[Worker], Awaitable[None]]) -> None:
        self._host = host
        #: Stops the worker's container (it restarts awake: `Supervisor`).
        self._restart = restart
        self._client = RuntimeClient(connect_timeout_s=STATE_TIMEOUT_S, max_idle=1)
        self._busy: set[Worker] = set()

    async def run(
        self, workers: Callable[[], Iterable[tuple[Worker, bool]]], changed: Callable[[], trio.Event]
    ) -> NoReturn:
        """Until cancelled: for each (worker, wanted asleep) that differs from what it runs, switch it."""
        try:
            async with trio.open_nursery() as nursery:
                while True:
                    event = changed()
                    for w, wanted in workers():
                        if w not in self._busy and self._due(w, wanted):
                            self._busy.add(w)
                            nursery.start_soon(self._drive, w, wanted)
                    with trio.move_on_after(_LOOK_S):
                        await event.wait()
        finally:
            with trio.CancelScope(shield=True):
                await self._client.aclose()

    @staticmethod
    def _due(w: Worker, wanted: bool) -> bool:
        if not wanted:
            w.sleep_refused = False
        if w.removing or w.state is not wire.RuntimeState.READY or w.asleep is wanted:
            return False
        return not (wanted and w.sleep_refused) and native_sleep_for(w.runtime.kind, w.runtime.command) is not None

    async def _drive(self, w: Worker, wanted: bool) -> None:
        sleep = native_sleep_for(w.runtime.kind, w.runtime.command)
        assert sleep is not None
        try:
            await switch(self._client, self._host, w.runtime.port, sleep, asleep=wanted)
        except RuntimeSleepError as exc:
            self._failed(w, wanted, str(exc))
            if not wanted and w.wake_failures >= WAKE_ATTEMPTS and not w.removing:
                log.warning("assignment %s: its runtime does not wake; restarting its container", w.id)
                w.wake_failures = 0
                await self._restart(w)
        else:
            w.asleep, w.sleep_problem, w.wake_failures = wanted, None, 0
            log.info("assignment %s: its runtime %s", w.id, "sleeps" if wanted else "is awake")
        finally:
            self._busy.discard(w)

    @staticmethod
    def _failed(w: Worker, wanted: bool, why: str) -> None:
        if wanted:
            # Stays awake; not tried again until woken (the controller stops its container instead).
            w.sleep_refused = True
            w.sleep_problem = f"the runtime's sleep failed: {why}"
        else:
            w.wake_failures += 1
            w.sleep_problem = f"the runtime's wake failed: {why}"
        log.warning("assignment %s: %s", w.id, w.sleep_problem)
