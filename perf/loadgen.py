"""The load generator of `perf/gateway.py`: raw HTTP/1.1 keep-alive over trio sockets, in client processes.

`run_point` measures one point: `conc` closed-loop connections, split over up to `client_procs`
spawned processes, send the same request for `seconds` after `warmup_s` unmeasured (connecting and
waiting for the common start); it returns every latency (and, streaming, the time to the first body
bytes and the SSE events counted), the errors by kind and each watched process's CPU share (of one
core, /proc/PID/stat) over the measured window, with the client's own and the rest of the machine's.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import os
import socket
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import trio

#: One request may take this long before it counts as an error (the point still ends on time).
REQUEST_TIMEOUT_S = 30.0


def cpu_seconds(pid: int) -> float:
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_snapshot(watched: dict[str, int]) -> dict[str, float]:
    """The CPU seconds each watched process has used so far."""
    return {name: cpu_seconds(pid) for name, pid in watched.items()}


def cpu_shares(before: dict[str, float], watched: dict[str, int], seconds: float) -> dict[str, float]:
    """Each watched process's CPU share (of one core) since `before`, over `seconds`."""
    return {name: (cpu_seconds(pid) - before[name]) / seconds for name, pid in watched.items()}


def machine_busy_seconds() -> float:
    """CPU seconds every CPU of the machine spent busy (not idle or iowait), from /proc/stat."""
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(fields[:8]) - fields[3] - fields[4]) / os.sysconf("SC_CLK_TCK")


def cpu_window(watched: dict[str, int], start: float, seconds: float) -> tuple[dict[str, float], float]:
    """Sleep until `start` (`time.monotonic()`), then through `seconds`: each watched process's CPU share
    (of one core) over them, and the machine's busy CPUs (busy CPU seconds per second)."""
    stop = start + seconds
    time.sleep(max(0.0, start - time.monotonic()))
    cpu0 = cpu_snapshot(watched)
    busy0 = machine_busy_seconds()
    time.sleep(max(0.0, stop - time.monotonic()))
    return cpu_shares(cpu0, watched, seconds), (machine_busy_seconds() - busy0) / seconds


@attrs.frozen
class Target:
    name: str
    host: str
    port: int
    path: str
    key: str

    def request(self, body: bytes) -> bytes:
        auth = f"Authorization: Bearer {self.key}\r\n" if self.key else ""
        head = (
            f"POST {self.path} HTTP/1.1\r\nHost: {self.host}:{self.port}\r\nContent-Type: application/json\r\n"
            f"{auth}Content-Length: {len(body)}\r\n\r\n"
        )
        return head.encode() + body


class HttpConnection:
    def __init__(self, stream: trio.SocketStream) -> None:
        self.stream = stream
        self.buf = bytearray()

    async def _fill(self) -> None:
        data = await self.stream.receive_some(262144)
        if not data:
            raise ConnectionError("the server closed the connection")
        self.buf += data

    async def _line(self) -> bytes:
        while (i := self.buf.find(b"\r\n")) < 0:
            await self._fill()
        line = bytes(self.buf[:i])
        del self.buf[: i + 2]
        return line

    async def exchange(self, request: bytes, on_body: Callable[[bytes], None]) -> tuple[int, bool]:
        """Send one request, feed its body to `on_body` as it arrives; returns (status, keep-alive)."""
        await self.stream.send_all(request)
        while (end := self.buf.find(b"\r\n\r\n")) < 0:
            await self._fill()
        head = bytes(self.buf[:end]).decode("latin-1").split("\r\n")
        del self.buf[: end + 4]
        status = int(head[0].split(" ", 2)[1])
        headers = {k.strip().lower(): v.strip().lower() for k, _, v in (h.partition(":") for h in head[1:])}
        if headers.get("transfer-encoding") == "chunked":
            while True:
                size = int((await self._line()).split(b";", 1)[0], 16)
                if size == 0:
                    while await self._line():
                        pass
                    break
                while len(self.buf) < size + 2:
                    await self._fill()
                on_body(bytes(self.buf[:size]))
                del self.buf[: size + 2]
        else:
            left = int(headers.get("content-length", "0"))
            while left:
                if not self.buf:
                    await self._fill()
                piece = bytes(self.buf[:left])
                del self.buf[: len(piece)]
                left -= len(piece)
                on_body(piece)
        return status, headers.get("connection") != "close"


@attrs.define
class Result:
    latencies: list[float] = attrs.Factory(list)
    ttfts: list[float] = attrs.Factory(list)
    events: int = 0
    errors: dict[str, int] = attrs.Factory(dict)
    cpu_s: float = 0.0


async def _load(target: Target, body: bytes, stream: bool, offsets: list[float], start: float, stop: float) -> Result:
    """One connection per entry of `offsets`, each sending its first request that long after `start`."""
    result = Result()
    request = target.request(body)

    async def worker(offset: float) -> None:
        conn: HttpConnection | None = None
        while (now := time.monotonic()) < stop:
            if conn is None:
                conn = HttpConnection(await trio.open_tcp_stream(target.host, target.port))
                conn.stream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if now < start + offset:  # warm-up: connect, then wait for the common start (and its offset)
                await trio.sleep_until(trio.current_time() + start + offset - now)
                continue
            first = 0.0
            events = 0
            tail = b""

            def on_body(data: bytes) -> None:
                nonlocal first, events, tail
                if not first:
                    first = time.monotonic()
                if stream:
                    joined = tail + data
                    events += joined.count(b"\n\n")
                    tail = joined[-1:]

            sent = time.monotonic()
            try:
                with trio.fail_after(REQUEST_TIMEOUT_S):
                    status, keep = await conn.exchange(request, on_body)
            except (trio.TooSlowError, OSError, ConnectionError, trio.BrokenResourceError, ValueError) as exc:
                result.errors[type(exc).__name__] = result.errors.get(type(exc).__name__, 0) + 1
                await conn.stream.aclose()
                conn = None
                continue
            done = time.monotonic()
            if status != 200:
                result.errors[str(status)] = result.errors.get(str(status), 0) + 1
            elif done <= stop:
                result.latencies.append(done - sent)
                if stream:
                    result.ttfts.append(first - sent)
                    result.events += events
            if not keep:
                await conn.stream.aclose()
                conn = None
        if conn is not None:
            await conn.stream.aclose()

    async with trio.open_nursery() as nursery:
        for offset in offsets:
            nursery.start_soon(worker, offset)
    return result


def _client_main(
    out: multiprocessing.connection.Connection,
    target: Target,
    body: bytes,
    stream: bool,
    offsets: list[float],
    start: float,
    stop: float,
) -> None:
    cpu0 = time.process_time()
    result = trio.run(_load, target, body, stream, offsets, start, stop)
    result.cpu_s = time.process_time() - cpu0
    out.send(attrs.asdict(result))
    out.close()


@attrs.frozen
class Point:
    target: str
    mode: str
    conc: int
    seconds: float
    result: Result
    cpu: dict[str, float]
    #: Latency percentiles (ms, by quantile) measured elsewhere (wrk): used instead of `result.latencies`.
    percentiles: dict[float, float] = attrs.Factory(dict)
    #: Requests completed, when `result.latencies` does not hold them all (wrk); -1: count those.
    requests: int = -1

    def pct(self, values: list[float], q: float) -> float:
        if not values:
            return float("nan")
        ordered = sorted(values)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1000

    @property
    def count(self) -> int:
        """Requests (or streams) completed with 200 in the window."""
        return self.requests if self.requests >= 0 else len(self.result.latencies)

    @property
    def rps(self) -> float:
        return self.count / self.seconds

    def lat(self, q: float) -> float:
        if self.percentiles:
            return self.percentiles.get(q, float("nan"))
        return self.pct(self.result.latencies, q)

    def ttft(self, q: float) -> float:
        return self.pct(self.result.ttfts, q)

    @property
    def chunks_per_s(self) -> float:
        return self.result.events / self.seconds


def run_point(
    target: Target,
    mode: str,
    conc: int,
    body: bytes,
    *,
    seconds: float,
    warmup_s: float,
    client_procs: int,
    watched: dict[str, int],
    stagger_s: float = 0.0,
) -> Point:
    """One point: `body` POSTed by `conc` connections (any `mode` but "unary": an SSE answer) for `seconds`.

    With `stagger_s`, connection i of `conc` sends its first request i / conc x `stagger_s` after the
    start (the measured window's start), so the requests arrive spread out rather than all at once."""
    stream = mode != "unary"
    nprocs = max(1, min(client_procs, conc))
    shares = [[i / conc * stagger_s for i in range(k, conc, nprocs)] for k in range(nprocs)]
    ctx = multiprocessing.get_context("spawn")
    start = time.monotonic() + warmup_s + 1.0  # spawning a client takes a moment
    stop = start + seconds
    pipes, clients = [], []
    for share in shares:
        receiver, sender = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_client_main, args=(sender, target, body, stream, share, start, stop), daemon=True)
        proc.start()
        sender.close()
        pipes.append(receiver)
        clients.append(proc)
    cpu, busy = cpu_window(watched, start, seconds)
    merged = Result()
    for receiver, proc in zip(pipes, clients, strict=True):
        if not receiver.poll(REQUEST_TIMEOUT_S + 10):
            proc.kill()
            merged.errors["client-lost"] = merged.errors.get("client-lost", 0) + 1
            continue
        got = Result(**receiver.recv())
        merged.latencies += got.latencies
        merged.ttfts += got.ttfts
        merged.events += got.events
        merged.cpu_s += got.cpu_s
        for k, v in got.errors.items():
            merged.errors[k] = merged.errors.get(k, 0) + v
        proc.join(timeout=10)
    cpu["client"] = merged.cpu_s / seconds  # includes its warm-up: an upper bound
    # Everything else the machine ran meanwhile (other work on a shared machine skews every figure).
    cpu["other"] = max(0.0, busy - sum(cpu.values()))
    return Point(target=target.name, mode=mode, conc=conc, seconds=seconds, result=merged, cpu=cpu)
