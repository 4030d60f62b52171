"""Cancelling the inference requests whose client went away (`Disconnects`, one loop for all)."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from typing import Any, Final, NoReturn

import trio

log = logging.getLogger(__name__)

Receive = Callable[[], Awaitable[dict[str, Any]]]
#: A request still running this long after its body was read gets a task that waits for its client
#: to go away; a client that leaves is noticed at most twice this long after that (seconds).
WATCH_AFTER_S: Final = 0.25


class Disconnects:
    """Cancels the requests whose client went away, without a task for each short request.

    ASGI says a client left only through `receive()`, so noticing it needs a task waiting there.
    Most requests end within milliseconds, and a task each (about 50 µs) was a few per cent of a
    request's CPU: here a request is only noted when it starts, and `run`, one loop for all, gives
    each one still running `WATCH_AFTER_S` later a task that waits for its `http.disconnect` and
    cancels its scope (the relay then cancels the runtime's request). The request forgets its note,
    or cancels its task, when it ends."""

    def __init__(self, after_s: float = WATCH_AFTER_S) -> None:
        self._after_s = after_s
        #: The requests without a task yet, in the order they were noted (oldest first).
        self._noted: dict[_Watched, None] = {}
        self._work = trio.Event()

    def watch(self, receive: Receive, scope: trio.CancelScope) -> _Watched:
        """Note a request whose body was read: `scope` is cancelled if its client goes away."""
        watched = _Watched(receive, scope, trio.current_time())
        self._noted[watched] = None
        if not self._work.is_set():
            self._work.set()
        return watched

    def forget(self, watched: _Watched) -> None:
        """The request ended: stop waiting for its client."""
        try:
            del self._noted[watched]
        except KeyError:
            watched.waiting.cancel()  # a task waits for its client: end it

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> NoReturn:
        async with trio.open_nursery() as nursery:
            task_status.started()
            while True:
                if not self._noted:
                    self._work = trio.Event()
                    await self._work.wait()
                await trio.sleep(self._after_s)
                cutoff = trio.current_time() - self._after_s
                due = []
                for watched in self._noted:
                    if watched.since > cutoff:
                        break  # noted in arrival order: the rest are younger
                    due.append(watched)
                for watched in due:
                    del self._noted[watched]
                    nursery.start_soon(_wait_for_disconnect, watched)


class _Watched:
    __slots__ = ("receive", "scope", "since", "waiting")

    def __init__(self, receive: Receive, scope: trio.CancelScope, since: float) -> None:
        self.receive = receive
        #: The request's scope, cancelled when its client goes away.
        self.scope = scope
        self.since = since
        #: The scope of the task waiting for the client, cancelled when the request ends.
        self.waiting = trio.CancelScope()


async def _wait_for_disconnect(watched: _Watched) -> None:
    with watched.waiting:
        try:
            while (await watched.receive())["type"] != "http.disconnect":
                pass
        except Exception:  # the server could not say: take the connection as gone
            log.debug("reading a client's disconnect failed: its request is cancelled", exc_info=True)
        watched.scope.cancel()
