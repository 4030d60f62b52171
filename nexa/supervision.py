"""Supervised long-running loops: a loop that fails is logged, counted and restarted with capped backoff.

Trio only; no I/O. A composition root makes one `Supervision` per process and installs it
(`with supervision.installed():`); every task started inside inherits it (a contextvar, as the
request id in `nexa.telemetry`), so components wrap their inner loops with one line:
`nursery.start_soon(supervised, "southbound.receive", self._receive_loop)` or
`await nursery.start(supervised, "gateway", gateway.run)`.

What passes through, never restarted: `trio.Cancelled`, KeyboardInterrupt, SystemExit, and the
fatal errors (by default `StoreUnusable`: the database cannot be used, so the process must end).
A loop that fails before its first `task_status.started()` is a failed start: it ends the
process too. Logs name the loop, the exception type, a cut message and the code location,
never locals or payloads.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import os
import sys
import threading
import time
import traceback
import types
from collections import Counter
from collections.abc import Awaitable, Callable, Iterable, Iterator, Mapping
from typing import Final, NoReturn, TypeVar

import attrs
import trio

from nexa.errors import NexaError, StoreUnusable

log = logging.getLogger(__name__)
T = TypeVar("T")

#: First wait before a failed loop runs again; doubled after each failure in a row.
FIRST_BACKOFF_S: Final = 0.1
#: The longest wait between two runs of a loop that keeps failing.
MAX_BACKOFF_S: Final = 30.0
#: A loop that ran this long before failing starts its backoff over.
HEALTHY_AFTER_S: Final = 60.0
#: An exception's message is cut to this many characters in the log (it may quote its input).
MESSAGE_MAX_CHARS: Final = 200
#: Innermost frames named in the log of one failure.
FRAMES_LOGGED: Final = 6
#: At most this many leaves of an exception group are described.
LEAVES_LOGGED: Final = 3
#: The event loop not running for this long is a stall: logged with where it was, and counted.
STALL_AFTER_S: Final = 1.0


@attrs.frozen(kw_only=True)
class SupervisionStatistics:
    """Failures by loop name since the process started (trio's `statistics()` convention)."""

    failures: Mapping[str, int]
    restarts: int


class Supervision:
    """One per process: the backoff policy, the fatal errors and the failure counter of its loops."""

    def __init__(
        self,
        *,
        on_failure: Callable[[str], None] | None = None,
        fatal: tuple[type[BaseException], ...] = (StoreUnusable,),
        first_backoff_s: float = FIRST_BACKOFF_S,
        max_backoff_s: float = MAX_BACKOFF_S,
        healthy_after_s: float = HEALTHY_AFTER_S,
    ) -> None:
        #: Called with the loop's name on every failure (`nexa_loop_failures_total{loop}` on the controller).
        self._on_failure = on_failure
        self.fatal = fatal
        self.first_backoff_s = first_backoff_s
        self.max_backoff_s = max_backoff_s
        self.healthy_after_s = healthy_after_s
        self._failures: Counter[str] = Counter()
        self._restarts = 0

    @contextlib.contextmanager
    def installed(self) -> Iterator[Supervision]:
        """Make this the supervision of every task started inside the block (and their children)."""
        token = _current.set(self)
        try:
            yield self
        finally:
            _current.reset(token)

    def statistics(self) -> SupervisionStatistics:
        return SupervisionStatistics(failures=types.MappingProxyType(dict(self._failures)), restarts=self._restarts)

    def _failed(self, name: str) -> None:
        self._failures[name] += 1
        if self._on_failure is not None:
            self._on_failure(name)

    def _restarting(self) -> None:
        self._restarts += 1


_current: Final[contextvars.ContextVar[Supervision | None]] = contextvars.ContextVar("nexa_supervision", default=None)


@attrs.define
class Backoff:
    """Capped exponential backoff between the runs of something that keeps failing: `first_s`, then
    twice as long each time, up to `max_s`; a run that lasted `healthy_after_s` starts it over."""

    first_s: float
    max_s: float
    healthy_after_s: float
    _next_s: float = attrs.field(init=False)

    def __attrs_post_init__(self) -> None:
        self._next_s = self.first_s

    def wait_after(self, ran_s: float) -> float:
        """How long to wait before the next run, after one that lasted `ran_s`."""
        if ran_s >= self.healthy_after_s:
            self._next_s = self.first_s
        wait = self._next_s
        self._next_s = min(wait * 2, self.max_s)
        return wait


def current() -> Supervision:
    """The supervision installed for this task; a log-only one where none is (component tests)."""
    installed = _current.get()
    if installed is None:
        installed = Supervision()
        _current.set(installed)
    return installed


async def supervised(
    name: str,
    fn: Callable[..., Awaitable[object]],
    *args: object,
    task_status: trio.TaskStatus[object] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run `fn(*args)` until cancelled, restarting it with capped exponential backoff when it fails.

    Started with `nursery.start`, `fn` must speak the start protocol too: what its first start
    reports is passed on, once; a failure before that first start is raised (a failed start).
    Later runs are started the same way, and what they report is dropped. A run that returns
    ends the supervision (the loop is done); the failures named in the module docstring pass through.
    """
    sup = current()
    protocol = task_status is not trio.TASK_STATUS_IGNORED
    starting = protocol
    backoff = Backoff(sup.first_backoff_s, sup.max_backoff_s, sup.healthy_after_s)
    while True:
        began = trio.current_time()
        try:
            if protocol:
                async with trio.open_nursery() as nursery:
                    value = await nursery.start(fn, *args)
                    if starting:
                        starting = False
                        task_status.started(value)
            else:
                await fn(*args)
        except BaseException as exc:
            passing, failed = _split(exc, sup.fatal)
            if passing is not None and _holds(passing, sup.fatal):
                log.critical("loop %s: %s; the process stops", name, describe(next(_fatal_leaves(passing, sup.fatal))))
            if failed is not None:
                _log_failure(name, failed, starting=starting)
                sup._failed(name)
            if passing is exc or (passing is None and starting):
                raise
            if passing is not None:
                # Cancelled while another part failed: the failure is logged, the cancellation goes on.
                raise passing from None
        else:
            log.info("loop %s returned; it is not restarted", name)
            return
        wait = backoff.wait_after(trio.current_time() - began)
        log.warning("loop %s restarts in %.3g s", name, wait)
        await trio.sleep(wait)
        sup._restarting()


def _restartable(fatal: tuple[type[BaseException], ...]) -> Callable[[BaseException], bool]:
    def restartable(exc: BaseException) -> bool:
        # Groups are never matched whole: a group holding a fatal error or a Cancelled must split.
        return not isinstance(exc, BaseExceptionGroup) and isinstance(exc, Exception) and not isinstance(exc, fatal)

    return restartable


def _split(
    exc: BaseException, fatal: tuple[type[BaseException], ...]
) -> tuple[BaseException | None, BaseException | None]:
    """(what must pass through, what may be restarted); either may be None."""
    restartable = _restartable(fatal)
    if not isinstance(exc, BaseExceptionGroup):
        return (None, exc) if restartable(exc) else (exc, None)
    failed, passing = exc.split(restartable)
    if failed is None:
        return exc, None
    if passing is None:
        return None, exc
    return passing, failed


def _holds(exc: BaseException, kinds: tuple[type[BaseException], ...]) -> bool:
    return any(True for _ in _fatal_leaves(exc, kinds))


def _fatal_leaves(exc: BaseException, kinds: tuple[type[BaseException], ...]) -> Iterator[BaseException]:
    return (leaf for leaf in _leaves(exc) if isinstance(leaf, kinds))


def _leaves(exc: BaseException) -> Iterator[BaseException]:
    if isinstance(exc, BaseExceptionGroup):
        for inner in exc.exceptions:
            yield from _leaves(inner)
    else:
        yield exc


def kinds(exc: BaseException) -> str:
    """The types of an exception's leaves (`KeyError, ValueError`): all that is logged of a failure
    whose messages may quote a request."""
    return ", ".join(sorted({type(leaf).__name__ for leaf in _leaves(exc)}))


def describe(exc: BaseException) -> str:
    """`Type: message` with the message cut (it may quote the input that caused it); nexa errors by code."""
    text = f"{exc.code}: {exc.message}" if isinstance(exc, NexaError) else str(exc)
    if len(text) > MESSAGE_MAX_CHARS:
        text = text[:MESSAGE_MAX_CHARS] + "…"
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _where(exc: BaseException) -> list[str]:
    frames = traceback.extract_tb(exc.__traceback__)[-FRAMES_LOGGED:]
    return [f"{os.path.basename(f.filename)}:{f.lineno} in {f.name}" for f in frames]


def _log_failure(name: str, exc: BaseException, *, starting: bool) -> None:
    leaves = list(_leaves(exc))
    errors = [describe(leaf) for leaf in leaves[:LEAVES_LOGGED]]
    if len(leaves) > LEAVES_LOGGED:
        errors.append(f"and {len(leaves) - LEAVES_LOGGED} more")
    fields = {"loop": name, "errors": errors, "where": _where(leaves[0])}
    if starting:
        log.error("loop %s failed to start: %s", name, "; ".join(errors), extra={"fields": fields})
    else:
        log.error("loop %s failed: %s", name, "; ".join(errors), extra={"fields": fields})


async def all_or_first_failure(
    items: Iterable[T],
    run: Callable[[T], Awaitable[None]],
    *,
    catch: tuple[type[Exception], ...],
    limit: int | None = None,
) -> None:
    """`run(item)` for every item concurrently, at most `limit` at once (None: no limit).

    The first run to fail with one of `catch` cancels the others, and its exception is raised
    alone, never inside an exception group, so a caller catches typed errors as from one call.
    Anything else propagates as trio's nursery raises it.
    """
    limiter = trio.CapacityLimiter(limit) if limit is not None else None
    failures: list[Exception] = []

    async def one(item: T) -> None:
        try:
            if limiter is None:
                await run(item)
            else:
                async with limiter:
                    await run(item)
        except catch as exc:
            failures.append(exc)
            nursery.cancel_scope.cancel()

    async with trio.open_nursery() as nursery:
        for item in items:
            nursery.start_soon(one, item)
    if failures:
        raise failures[0]


async def watch_event_loop(
    on_stall: Callable[[float], None] | None = None,
    *,
    stall_after_s: float = STALL_AFTER_S,
    task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED,
) -> NoReturn:
    """Report every stall of this event loop: a time it ran no task for `stall_after_s` or more.

    A task notes the time every quarter of `stall_after_s`; a daemon thread checks the note, and
    once per stall logs how long the loop has been stuck with the loop thread's stack (code
    locations only, never locals) and calls `on_stall(seconds)` (the controller counts
    `nexa_event_loop_stalls_total`). Something that blocks the loop (a sync call, a long
    computation) is then found from the log instead of from clients' time-outs."""
    loop_thread = threading.get_ident()
    tick = stall_after_s / 4
    noted = time.monotonic()
    stop = threading.Event()

    def watch() -> None:
        reported = None
        while not stop.wait(tick):
            behind, seen = time.monotonic() - noted, noted
            if behind < stall_after_s or reported == seen:
                continue
            reported = seen  # one report per stall
            frame = sys._current_frames().get(loop_thread)
            where = "".join(traceback.format_stack(frame, limit=FRAMES_LOGGED * 2)) if frame else "(unknown)\n"
            log.warning("the event loop has run no task for %.1f s; it is at:\n%s", behind, where.rstrip())
            if on_stall is not None:
                on_stall(behind)

    watcher = threading.Thread(target=watch, name="nexa-event-loop-watchdog", daemon=True)
    watcher.start()
    try:
        task_status.started()
        while True:
            noted = time.monotonic()
            await trio.sleep(tick)
    finally:
        stop.set()
