"""The C parts of `perf/gateway.py`'s native mode: a paced SSE upstream and an epoll load generator.

Both are C sources under perf/c/, built with the system's C compiler (Debian's gcc as `cc`) into
`~/.cache/nexa-perf/c/NAME-HASH`, HASH being the source's and the flags' SHA-256, so a changed source
builds anew and an unchanged one is built once. They cost little CPU per event (mostly the kernel's), so
what the benchmark measures is the gateway, not its load.

- `PacedUpstream` runs `paced_upstream` (perf/c/paced_upstream.c): every streamed chat completion is
  `events` content chunks at `rate` events/s, a usage chunk and `data: [DONE]`; a unary one is one JSON
  answer. A child of this process, stopped by its PID; `stop()` returns what it sent.
- `c_point` runs `sse_loadgen` (perf/c/sse_loadgen.c) for one point, like `perf.loadgen.run_point`:
  `conc` keep-alive connections POST back to back; their first requests are spread over `ramp_s`
  before the measured window (so every stream runs when it opens); it reads each watched process's
  CPU from /proc over the window, and the load generator's own.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any

import attrs

from nexa.errors import Unavailable
from perf.loadgen import Point, Result, Target, cpu_window

SOURCES = Path(__file__).resolve().parent / "c"
CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "nexa-perf" / "c"
CFLAGS = ("-O2", "-Wall", "-Wextra", "-std=gnu11")
START_TIMEOUT_S = 10.0
#: An answer still in flight when the window closes may take this long to end before it counts as an error.
REQUEST_TIMEOUT_S = 30.0


def compiler() -> str:
    for name in ("cc", "gcc"):
        if path := shutil.which(name):
            return path
    raise Unavailable("no C compiler: apt-get install gcc")


def build(name: str, cache: Path = CACHE) -> Path:
    """perf/c/NAME.c built (once per source and flags) into `cache`; the executable's path."""
    source = SOURCES / f"{name}.c"
    digest = hashlib.sha256(source.read_bytes() + "\0".join(CFLAGS).encode()).hexdigest()[:16]
    out = cache / f"{name}-{digest}"
    if out.exists():
        return out
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        built = Path(tmp) / name
        argv = [compiler(), *CFLAGS, "-o", str(built), str(source)]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
        if done.returncode != 0:
            raise RuntimeError(f"building {source.name} failed:\n{done.stderr[-3000:]}")
        built.replace(out)  # atomic: a concurrent build of the same source ends with the same file
    return out


@attrs.frozen
class Sent:
    """What the upstream wrote: streams answered to their end, SSE events, unary answers."""

    streams: int
    events: int
    unary: int


class PacedUpstream:
    """`paced_upstream` on `host:port`: `events` content chunks per stream at `rate` events/s."""

    def __init__(self, host: str, port: int, events: int, rate: float, cache: Path = CACHE) -> None:
        self.host, self.port, self.events, self.rate = host, port, events, rate
        self.cache = cache
        self.proc: subprocess.Popen[str] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> int:
        argv = [str(build("paced_upstream", self.cache)), self.host, str(self.port), str(self.events), f"{self.rate:g}"]
        self.proc = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()  # it prints this line once it listens, or exits
        if not line.startswith("listening "):
            self.proc.wait(timeout=START_TIMEOUT_S)
            raise Unavailable(f"paced_upstream did not start: {self.proc.stderr.read() if self.proc.stderr else ''}")
        return self.proc.pid

    def stop(self) -> Sent | None:
        """Stops it (by its PID); what it sent, when it said."""
        proc, self.proc = self.proc, None
        if proc is None:
            return None
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
            return None
        last = out.strip().splitlines()[-1:] or [""]
        with_counts: dict[str, Any] = json.loads(last[0]) if last[0].startswith("{") else {}
        return Sent(**with_counts) if with_counts else None


def loadgen_argv(
    target: Target,
    body_file: Path,
    conc: int,
    window: tuple[float, float, float],
    ramp_s: float,
    max_requests: int,
    cache: Path = CACHE,
) -> list[str]:
    """`sse_loadgen`'s command line; `window` is (begin, start, stop) in time.monotonic() seconds."""
    begin, start, stop = window
    return [
        str(build("sse_loadgen", cache)),
        target.host,
        str(target.port),
        target.path,
        target.key,
        str(body_file),
        str(conc),
        f"{begin:.6f}",
        f"{start:.6f}",
        f"{stop:.6f}",
        f"{ramp_s:.6f}",
        str(max_requests),
        f"{REQUEST_TIMEOUT_S:g}",
    ]


@attrs.frozen
class Loaded:
    """What `sse_loadgen` printed."""

    result: Result
    #: SSE events received in the window, whatever answer they belong to.
    window_events: int
    #: Every 200 answer, and its events, in the window or not.
    requests: int
    all_events: int
    #: The start of the first answer other than 200 ("" when none).
    error_body: str = ""


def parse_loadgen(out: str) -> Loaded:
    got = json.loads(out.strip().splitlines()[-1])
    result = Result(
        latencies=got["latencies"],
        ttfts=got["ttfts"],
        events=got["events"],
        errors={str(k): int(v) for k, v in got["errors"].items()},
        cpu_s=got["cpu_s"],
    )
    return Loaded(result, got["window_events"], got["requests"], got["all_events"], got["error_body"])


def run_loadgen(
    target: Target, body: bytes, conc: int, *, max_requests: int, timeout_s: float = 120.0, cache: Path = CACHE
) -> Loaded:
    """`conc` connections, each sending `max_requests` requests at once and back to back (no window)."""
    with tempfile.NamedTemporaryFile(prefix="nexa-perf-body-") as f:
        f.write(body)
        f.flush()
        build("sse_loadgen", cache)  # before the clock starts: a first build takes seconds
        now = time.monotonic()
        argv = loadgen_argv(target, Path(f.name), conc, (now, now, now + timeout_s), 0.0, max_requests, cache)
        limit = timeout_s + REQUEST_TIMEOUT_S + 10
        done = subprocess.run(argv, capture_output=True, text=True, timeout=limit, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"sse_loadgen failed ({done.returncode}): {done.stderr[-2000:]}")
    return parse_loadgen(done.stdout)


@attrs.frozen
class NativePoint:
    point: Point
    #: SSE events received in the window (the "per event" divisor).
    window_events: int
    #: The start of the first answer other than 200 ("" when none).
    error_body: str = ""


def c_point(
    target: Target,
    mode: str,
    conc: int,
    body: bytes,
    *,
    seconds: float,
    warmup_s: float,
    ramp_s: float,
    watched: dict[str, int],
    scratch: Path,
) -> NativePoint:
    """One point by `sse_loadgen`: `conc` connections start over `ramp_s` (after `warmup_s` to connect),
    then `seconds` are measured: each watched process's CPU share, the load generator's, the rest."""
    body_file = scratch / f"body-{mode}.json"
    body_file.write_bytes(body)
    build("sse_loadgen")  # before the clock starts: a first build takes seconds
    begin = time.monotonic() + warmup_s
    start = begin + ramp_s
    stop = start + seconds
    argv = loadgen_argv(target, body_file, conc, (begin, start, stop), ramp_s, 0)
    with subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) as proc:
        cpu, busy = cpu_window(watched, start, seconds)
        out, err = proc.communicate(timeout=REQUEST_TIMEOUT_S + 30)
    if proc.returncode != 0:
        raise RuntimeError(f"sse_loadgen failed ({proc.returncode}): {err[-2000:]}")
    loaded = parse_loadgen(out)
    cpu["loadgen"] = loaded.result.cpu_s / seconds  # its own CPU clock over the window
    cpu["other"] = max(0.0, busy - sum(cpu.values()))
    point = Point(target=target.name, mode=mode, conc=conc, seconds=seconds, result=loaded.result, cpu=cpu)
    return NativePoint(point=point, window_events=loaded.window_events, error_body=loaded.error_body)
