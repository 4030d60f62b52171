"""Gateway workers on one host with the embedded store (`[http] workers = N`, DESIGN §5).

`nexa control` with `workers` above 1 runs no controller itself: it locks the state dir (so no
other `nexa control` opens it), starts N worker processes (`nexa control --worker I`, the same
flags) and supervises them (`serve_workers`). Each worker is a whole controller, the same as one of
several controllers on PostgreSQL, on the same code path: the SQLite file in the state dir is the
shared store (`open_store(worker=True)`: no state-dir lock, transactions that take the write lock
first, a longer busy timeout), the leadership is leased (`Leadership.leased`), and

- the worker holding the lease (the first, which starts alone and so takes it, unless it died)
  makes every leader-only write and the node channel's control work: sets, placement, recovery,
  backups, rollouts, key rotation;
- the others serve inference and reads and pass management writes to it (`forward.Forwarder`,
  over loopback to its own address), keep their caches up with the store (`follow.ChangeFeed`)
  and write what is theirs alone, as every controller on a shared store does: their usage
  records, their workloads, the pins of the stored responses they served (`datapath.pins`: every
  worker finds them), their node channel's enrollment and reachability events;
- all share `[http] listen`'s port: each binds it with SO_REUSEPORT (`service.shared_listener`)
  and the kernel spreads new connections over them. Each also serves the API on an address of
  its own (`own_listener`: 127.0.0.1 on a port the kernel picks, plain http even when the shared
  port serves https), which it names as its `[cluster] address`: where forwarded writes reach it.
- worker i serves the node channel on `[channel] listen`'s port + 2i (its key rotation endpoint
  on the next one): nodes list every worker's, as they list every controller's (`worker_config`).

Nothing acknowledged is lost when a worker is killed: a management write is acknowledged once the
leader committed it (synchronous=FULL), a usage record once its worker's batch committed
(`metering`: a worker's own rows, written every `gateway.metering_flush_s`). What a killed worker
had not yet committed is lost, as it is for one controller killed: its unflushed usage (at most
one flush window) and the requests it was serving (their clients see the connection cut).

A worker that exits is started again, 1 s later and then up to `RESTART_MAX_S` apart while it
keeps failing. One that exits with 2 (its configuration) or 3 (an unusable store) stops them all:
a restart cannot fix either, and `nexa control` exits with that status. SIGTERM is passed to every
worker, which drains as one controller does (`http.graceful_timeout_s`); one that has not exited
`STOP_GRACE_S` after that is killed. A worker whose supervisor is gone stops by itself
(`stop_when_orphaned`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Final

import attrs
import trio

from nexa.config import ClusterConfig, ControlConfig, HttpConfig, parse_host_port
from nexa.control import store as st
from nexa.errors import ConfigError, NexaError, StoreUnusable
from nexa.supervision import Backoff

log = logging.getLogger(__name__)

#: The hidden flag a supervisor starts worker I with (`nexa control --worker I`).
WORKER_FLAG: Final = "--worker"
#: What `nexa control` prints once it serves: a worker that printed it has started.
READY_MARK: Final = b" listening on "
#: The first restart of a worker that exited waits this long; each next one twice as long, up to
#: `RESTART_MAX_S`; a worker that ran `RESTART_RESET_AFTER_S` before exiting starts from 1 s again.
RESTART_FIRST_S: Final = 1.0
RESTART_MAX_S: Final = 30.0
RESTART_RESET_AFTER_S: Final = 60.0
#: After SIGTERM, how much longer than `http.graceful_timeout_s` a worker may take to stop before
#: it is killed: its loops' shielded last writes (the last usage batch) are bounded well within it.
STOP_GRACE_S: Final = 20.0
#: The exit statuses after which restarting a worker cannot help (the CLI's usage and unusable store).
EXIT_CONFIG: Final = 2
EXIT_STORE_UNUSABLE: Final = 3
#: How often a worker looks whether its supervisor is still there.
ORPHAN_CHECK_S: Final = 1.0


def _failed_start(index: int, status: int | None) -> NexaError:
    """A gateway worker exited before it served: `nexa control` does not start."""
    return NexaError(
        f"gateway worker {index} exited with status {status} before it served ([http] workers): "
        "its log lines above say why; fix that and start again"
    )


@attrs.frozen(kw_only=True)
class WorkersStarted:
    """What `serve_workers` reports once every worker serves."""

    urls: list[str]
    workers: int
    #: Each worker's node channel endpoint, in worker order: what node.toml `controllers` lists.
    channels: list[str]


def controller_base(cluster: ClusterConfig, http: HttpConfig) -> str:
    """The name the workers' ids share: `[cluster] controller_id`, else `<hostname>:<http port>`."""
    return cluster.controller_id or f"{socket.gethostname()}:{parse_host_port(http.listen)[1]}"


def _shifted(endpoint: str, by: int) -> str:
    """`tcp://HOST:PORT` with PORT + `by`; "" stays ""."""
    if not endpoint:
        return endpoint
    host, _, port = endpoint.rpartition(":")
    return f"{host}:{int(port) + by}"


def channel_endpoints(cfg: ControlConfig) -> list[str]:
    """Each worker's node channel endpoint as nodes are told it (`advertise`, else `listen`)."""
    base = cfg.channel.advertise or cfg.channel.listen
    return [_shifted(base, 2 * i) for i in range(cfg.http.workers)]


def worker_config(cfg: ControlConfig, index: int, own_port: int) -> ControlConfig:
    """Worker `index`'s configuration: one process (`workers` 1) named `<base>/<index>`, reached
    at `http://127.0.0.1:<own_port>` (`own_listener`), its node channel endpoints (the four
    `[channel]` addresses that are set) `2 * index` ports up. With https on the shared port, the
    other workers' `X-Forwarded-Proto` is believed from loopback (their forwarded console requests)."""
    channel = cfg.channel
    shifted = attrs.evolve(
        channel,
        listen=_shifted(channel.listen, 2 * index),
        advertise=_shifted(channel.advertise, 2 * index),
        rotation_listen=_shifted(channel.rotation_listen, 2 * index),
        rotation_advertise=_shifted(channel.rotation_advertise, 2 * index),
    )
    proxies = cfg.http.trusted_proxies
    if cfg.http.tls_cert_file and "127.0.0.1" not in proxies:
        proxies = (*proxies, "127.0.0.1")
    return attrs.evolve(
        cfg,
        http=attrs.evolve(cfg.http, workers=1, trusted_proxies=proxies),
        channel=shifted,
        cluster=attrs.evolve(
            cfg.cluster,
            controller_id=f"{controller_base(cfg.cluster, cfg.http)}/{index}",
            address=f"http://127.0.0.1:{own_port}",
        ),
    )


def own_listener() -> socket.socket:
    """A worker's own address: a TCP socket on 127.0.0.1, on a port the kernel picks, not yet
    listening. The worker keeps it for its life and hands hypercorn a duplicate at each (re)start."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind(("127.0.0.1", 0))
    except BaseException:
        sock.close()
        raise
    return sock


async def stop_when_orphaned(stopping: trio.Event, parent: int) -> None:
    """Set `stopping` once this process's parent (its supervisor) is gone: a worker never outlives it."""
    while os.getppid() == parent:  # noqa: ASYNC110 - no event says that a parent went
        await trio.sleep(ORPHAN_CHECK_S)
    log.warning("the supervising `nexa control` is gone: this gateway worker stops")
    stopping.set()


async def serve_workers(
    cfg: ControlConfig,
    command: Sequence[str],
    *,
    stopping: trio.Event,
    task_status: trio.TaskStatus[WorkersStarted] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Lock the state dir, run `cfg.http.workers` workers (`command` + `--worker I`) until
    `stopping` is set and they have stopped; supports the nursery start protocol (started once
    every worker serves; worker 0 first, alone: it migrates the store, makes the keys and the
    first admin key, and takes the lease). NexaError: one exited before it served; ConfigError
    or StoreUnusable: one exited with 2 or 3."""
    lock_fd = await trio.to_thread.run_sync(st.lock_state_dir, Path(cfg.state_dir))
    try:
        await _Supervisor(cfg, command, stopping).run(task_status)
    finally:
        os.close(lock_fd)


class _Supervisor:
    def __init__(self, cfg: ControlConfig, command: Sequence[str], stopping: trio.Event) -> None:
        self._cfg = cfg
        self._command = list(command)
        self._stopping = stopping
        self._procs: dict[int, trio.Process] = {}
        self._fatal: int | None = None  # the exit status that stopped them all
        self._failed: NexaError | None = None  # a worker that exited before it first served

    async def run(self, task_status: trio.TaskStatus[WorkersStarted]) -> None:
        count = self._cfg.http.workers
        async with trio.open_nursery() as outer:
            outer.start_soon(self._stop_all)
            async with trio.open_nursery() as nursery:
                for index in range(count):  # one at a time: each starts once the one before serves
                    await nursery.start(self._keep, index)
                    if self._failed is not None:
                        break
                else:
                    host, port = parse_host_port(self._cfg.http.listen)
                    scheme = "https" if self._cfg.http.tls_cert_file else "http"
                    url = f"{scheme}://{f'[{host}]' if ':' in host else host}:{port}"
                    channels = channel_endpoints(self._cfg)
                    task_status.started(WorkersStarted(urls=[url], workers=count, channels=channels))
            outer.cancel_scope.cancel()  # every worker has stopped
        if self._failed is not None:
            raise self._failed
        if self._fatal == EXIT_STORE_UNUSABLE:
            raise StoreUnusable("a gateway worker found the store unusable (exit 3): see its log lines above")
        if self._fatal == EXIT_CONFIG:
            raise ConfigError("a gateway worker refused its configuration (exit 2): see its log lines above")

    async def _keep(self, index: int, *, task_status: trio.TaskStatus[None]) -> None:
        """Run worker `index`, again each time it exits, until stopping; started once it first served."""
        announced = False

        def announce() -> None:
            nonlocal announced
            if not announced:
                announced = True
                task_status.started()

        backoff = Backoff(RESTART_FIRST_S, RESTART_MAX_S, RESTART_RESET_AFTER_S)
        while not self._stopping.is_set():
            began = trio.current_time()
            status = await self._run_once(index, announce)
            if self._stopping.is_set():
                break
            if not announced:  # the others are stopped, then `run` raises it
                self._failed = _failed_start(index, status)
                self._stopping.set()
                break
            if status in (EXIT_CONFIG, EXIT_STORE_UNUSABLE):
                log.error("gateway worker %d exited with status %d: stopping every worker", index, status)
                self._fatal = status
                self._stopping.set()
                break
            wait = backoff.wait_after(trio.current_time() - began)
            log.warning(
                "gateway worker %d exited (status %s): starting it again in %.0f s",
                index,
                status,
                wait,
                extra={"fields": {"worker": index, "status": status}},
            )
            with trio.move_on_after(wait):
                await self._stopping.wait()
        announce()  # stopped before it served: nothing more to wait for

    async def _run_once(self, index: int, served: Callable[[], None]) -> int | None:
        """One run of worker `index` until it exits, its status: its stdout relayed, but for its
        `listening on` line, on which `served()` is called."""
        serving = False
        argv = [*self._command, WORKER_FLAG, str(index)]
        async with trio.open_nursery() as nursery:
            proc: trio.Process = await nursery.start(
                partial(trio.run_process, argv, stdout=subprocess.PIPE, check=False, deliver_cancel=_kill)
            )
            self._procs[index] = proc
            if self._stopping.is_set():  # stopping began while it started
                proc.send_signal(signal.SIGTERM)
            log.info(
                "gateway worker %d started (pid %d)",
                index,
                proc.pid,
                extra={"fields": {"worker": index, "pid": proc.pid}},
            )
            assert proc.stdout is not None
            async for line in _lines(proc.stdout):
                if READY_MARK in line and not serving:
                    serving = True
                    log.info("gateway worker %d serving", index, extra={"fields": {"worker": index, "pid": proc.pid}})
                    served()
                    continue
                sys.stdout.buffer.write(line)  # the first start's admin key, from worker 0
                sys.stdout.flush()
            status = await proc.wait()
        self._procs.pop(index, None)
        return status

    async def _stop_all(self) -> None:
        """On stopping: SIGTERM to every worker; SIGKILL to those still running past their grace."""
        await self._stopping.wait()
        for proc in list(self._procs.values()):
            _signal(proc, signal.SIGTERM)
        await trio.sleep(self._cfg.http.graceful_timeout_s + STOP_GRACE_S)
        for index, proc in list(self._procs.items()):
            log.error("gateway worker %d did not stop in time: killed", index)
            _signal(proc, signal.SIGKILL)


def _signal(proc: trio.Process, signum: int) -> None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signum)


async def _kill(proc: trio.Process) -> None:
    """The supervisor cancelled outright (a second SIGTERM): its workers go at once too."""
    _signal(proc, signal.SIGKILL)


async def _lines(stream: trio.abc.ReceiveStream) -> AsyncIterator[bytes]:
    """`stream`'s lines (each with its newline) until it ends."""
    pending = b""
    while True:
        data = await stream.receive_some()
        if not data:
            if pending:
                yield pending
            return
        pending += data
        *lines, pending = pending.split(b"\n")
        for line in lines:
            yield line + b"\n"
