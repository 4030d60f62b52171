"""The fast parts of `perf/gateway.py`: Debian nginx as the OpenAI-shaped upstream, Debian wrk as the unary client.

`Nginx` runs `/usr/sbin/nginx` as a child of this process, in the foreground and as one process
(`master_process off`), with its own conf, pid file, temp folders and error log under the run's
folder; it answers on loopback ports it is given. Each port serves one fixed answer to every
`POST /v1/chat/completions` (nginx cannot look inside a request body without njs): a unary chat
completion JSON with `usage` (`return 200 '...'`), or an SSE stream of `data:` chunks, a usage-only
chunk and `data: [DONE]` (a static file as `text/event-stream`, written at once). `GET /health`
answers 200, for the node's probe. Stopped by its PID.

`Ingress` is the same nginx in front of several `nexa control` HTTP ports, as an operator's ingress
(perf/failover.py): round-robin, and a request passed on to the next controller only when it was
not sent yet. Both run one nginx process each, configured and started the same way.

`wrk_point` runs `/usr/bin/wrk` (closed loop, keep-alive, `-c` connections over `-t` threads) with
a Lua script that POSTs the body with the auth header and, when done, prints the count, the errors
and the latency percentiles as one JSON line; the watched processes' CPU is read from /proc over
the same window.
"""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import time
from pathlib import Path

import httpx

from nexa.errors import Unavailable
from nexa.localparts import stop, wait_until
from perf.loadgen import Point, Result, Target, cpu_shares, cpu_snapshot

NGINX = "/usr/sbin/nginx"
WRK = "/usr/bin/wrk"
NGINX_START_TIMEOUT_S = 20.0
#: The percentiles wrk reports, as fractions.
QUANTILES = (0.5, 0.9, 0.99)
#: nginx reads a configuration token into a 4 KiB buffer: longer fixed bodies are files.
RETURN_MAX_CHARS = 3500


def unary_body(model: str, completion_tokens: int) -> str:
    """A chat completion as an OpenAI server answers it, with `usage`."""
    content = " ".join(["tok"] * completion_tokens)
    return json.dumps(
        {
            "id": "chatcmpl-perf",
            "object": "chat.completion",
            "created": 0,
            "model": model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content}, "finish_reason": "stop"}],
            "usage": {
                "prompt_tokens": 8,
                "completion_tokens": completion_tokens,
                "total_tokens": 8 + completion_tokens,
            },
        },
        separators=(",", ":"),
    )


def sse_body(model: str, events: int) -> str:
    """`events` content chunks (the last one with `finish_reason`), a usage-only chunk, `data: [DONE]`."""
    out = []
    for i in range(events):
        chunk = {
            "id": "chatcmpl-perf",
            "object": "chat.completion.chunk",
            "created": 0,
            "model": model,
            "choices": [
                {"index": 0, "delta": {"content": "tok "}, "finish_reason": "stop" if i == events - 1 else None}
            ],
        }
        out.append("data: " + json.dumps(chunk, separators=(",", ":")) + "\n\n")
    usage = {
        "id": "chatcmpl-perf",
        "object": "chat.completion.chunk",
        "created": 0,
        "model": model,
        "choices": [],
        "usage": {"prompt_tokens": 8, "completion_tokens": events, "total_tokens": 8 + events},
    }
    out.append("data: " + json.dumps(usage, separators=(",", ":")) + "\n\n")
    out.append("data: [DONE]\n\n")
    return "".join(out)


class Nginx:
    """One nginx process under `base`; `serve(host, port, body, content_type)` adds a listener before `start()`."""

    def __init__(self, base: Path) -> None:
        self.base = base
        self.servers: list[tuple[str, int, str, str]] = []
        self.proc: subprocess.Popen[bytes] | None = None

    def serve(self, host: str, port: int, body: str, content_type: str) -> None:
        if "'" in body:
            raise ValueError("the fixed body goes into a single-quoted nginx string")
        self.servers.append((host, port, body, content_type))

    def conf(self) -> str:
        b = self.base
        servers = "".join(
            f"    server {{\n      listen {host}:{port} backlog=4096;\n      root {b / 'bodies'};\n"
            "      location = /health { default_type text/plain; return 200 'ok'; }\n"
            f"      location = /v1/chat/completions {{ {self._answer(port, body, ctype)} }}\n"
            f"      location = /{port}.body {{ internal; default_type {ctype}; }}\n"
            "      location / { return 404; }\n    }\n"
            for host, port, body, ctype in self.servers
        )
        return nginx_conf(b, servers)

    def _answer(self, port: int, body: str, ctype: str) -> str:
        """`return 200 '<body>'` when it fits in one nginx token; else a file under bodies/, which the
        static module refuses to POST (405) and `error_page` turns into an internal GET of it."""
        if len(body) < RETURN_MAX_CHARS:
            return f"default_type {ctype}; return 200 '{body}';"
        (self.base / "bodies").mkdir(parents=True, exist_ok=True)
        (self.base / "bodies" / f"{port}.body").write_text(body)
        return f"alias {self.base / 'bodies' / f'{port}.body'}; default_type {ctype}; error_page 405 =200 /{port}.body;"

    def start(self) -> int:
        host, port = self.servers[0][0], self.servers[0][1]
        self.proc = start_nginx(self.base, self.conf(), f"http://{host}:{port}/health")
        return self.proc.pid

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)


class Ingress:
    """nginx as the ingress of several controllers: `host:port`, round-robin over `upstreams`
    (each a controller's `HOST:PORT`).

    A request goes to the next controller only when the one tried refused or timed out before the
    request was sent (`proxy_next_upstream error timeout`: nginx never sends a POST again once it
    reached a server), so a controller that dies fails only the requests it had started; a server
    that failed once is left out for `fail_timeout_s`. Answers stream through unbuffered (SSE).
    Each answer, nginx's own errors too, says which controllers were tried in `X-Nexa-Upstream`
    (`$upstream_addr`: `A:1, B:2` when A failed first).

    `keepalive` > 0 keeps that many idle connections per worker to the controllers (as an ingress
    in production would); 0 opens one per request, so a request can never be written to a
    connection whose controller has just died without nginx knowing it yet (such a request counts
    as sent and is not tried again), which keeps a failover's count of failed requests exact."""

    def __init__(
        self, base: Path, host: str, port: int, upstreams: list[str], *, keepalive: int = 0, fail_timeout_s: float = 5.0
    ) -> None:
        self.base = base
        self.host, self.port = host, port
        self.upstreams = upstreams
        self.keepalive = keepalive
        self.fail_timeout_s = fail_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def conf(self) -> str:
        servers = "".join(
            f"      server {u} max_fails=1 fail_timeout={self.fail_timeout_s:g}s;\n" for u in self.upstreams
        )
        pool = f"      keepalive {self.keepalive};\n" if self.keepalive else ""
        connection = '""' if self.keepalive else "close"
        return nginx_conf(
            self.base,
            f"    upstream controllers {{\n{servers}{pool}    }}\n"
            "    server {\n"
            f"      listen {self.host}:{self.port} backlog=4096;\n"
            "      client_max_body_size 64m;\n"
            "      location = /ingress-health { default_type text/plain; return 200 'ok'; }\n"
            "      location / {\n"
            "        proxy_pass http://controllers;\n"
            "        proxy_http_version 1.1;\n"
            f"        proxy_set_header Connection {connection};\n"
            "        proxy_set_header Host $http_host;\n"
            "        proxy_next_upstream error timeout;\n"
            "        proxy_connect_timeout 2s;\n"
            "        proxy_read_timeout 300s;\n"
            "        proxy_buffering off;\n"
            "        add_header X-Nexa-Upstream $upstream_addr always;\n"
            "      }\n"
            "    }\n",
        )

    def start(self) -> int:
        self.proc = start_nginx(self.base, self.conf(), f"{self.url}/ingress-health")
        return self.proc.pid

    def stop(self) -> None:
        if self.proc is not None:
            stop(self.proc)


def nginx_conf(base: Path, servers: str) -> str:
    """One nginx process (foreground, no master) around `servers`, its pid, log and temp folders under `base`."""
    temp = "\n".join(
        f"    {kind}_temp_path {base / kind};" for kind in ("client_body", "proxy", "fastcgi", "uwsgi", "scgi")
    )
    return (
        "daemon off;\nmaster_process off;\nworker_processes 1;\n"
        f"pid {base / 'nginx.pid'};\nerror_log {base / 'error.log'} warn;\n"
        "events { worker_connections 16384; }\n"
        "http {\n    access_log off;\n    keepalive_requests 100000000;\n    keepalive_timeout 300s;\n"
        "    client_body_buffer_size 64k;\n    server_tokens off;\n"
        f"{temp}\n{servers}}}\n"
    )


def start_nginx(base: Path, conf: str, ready_url: str) -> subprocess.Popen[bytes]:
    """nginx on `conf` as a child of this process, once `ready_url` answers 200 (Unavailable, with
    its log, if it exits or does not answer within NGINX_START_TIMEOUT_S)."""
    if not Path(NGINX).exists():
        raise Unavailable(f"{NGINX} is not installed (apt-get install nginx-light)")
    base.mkdir(parents=True, exist_ok=True)
    path = base / "nginx.conf"
    path.write_text(conf)
    log = base / "stderr.log"
    argv = [NGINX, "-p", str(base), "-c", str(path), "-e", str(base / "error.log")]
    with log.open("wb") as out:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)

    def ready() -> bool:
        try:
            return httpx.get(ready_url, timeout=2, trust_env=False).status_code == 200
        except httpx.HTTPError:
            return False

    try:
        wait_until(ready, proc, "nginx", log, NGINX_START_TIMEOUT_S)
    except BaseException:
        stop(proc)
        raise
    return proc


def wrk_script(path: Path, target: Target, body: bytes) -> Path:
    """The Lua script: POST `body` with the target's auth header; `done` prints one JSON line."""
    auth = f'wrk.headers["Authorization"] = "Bearer {target.key}"\n' if target.key else ""
    quantiles = ", ".join(f'"{q:g}"' for q in QUANTILES)
    path.write_text(
        'wrk.method = "POST"\n'
        f"wrk.body = {json.dumps(body.decode())}\n"
        'wrk.headers["Content-Type"] = "application/json"\n'
        f"{auth}"
        "function done(summary, latency, requests)\n"
        "  local e = summary.errors\n"
        f"  local qs = {{{quantiles}}}\n"
        "  local parts = {}\n"
        "  for _, q in ipairs(qs) do\n"
        "    parts[#parts + 1] = string.format('\"%s\": %d', q, latency:percentile(tonumber(q) * 100))\n"
        "  end\n"
        '  io.write(string.format(\'WRK {"requests": %d, "duration_us": %d, "connect": %d, "read": %d, \'\n'
        '    .. \'"write": %d, "status": %d, "timeout": %d, "latency_us": {%s}}\\n\',\n'
        "    summary.requests, summary.duration, e.connect, e.read, e.write, e.status, e.timeout,\n"
        "    table.concat(parts, ', ')))\n"
        "end\n"
    )
    return path


def wrk_point(
    target: Target,
    conc: int,
    body: bytes,
    *,
    seconds: float,
    warmup_s: float,
    threads: int,
    watched: dict[str, int],
    scripts: Path,
) -> Point:
    """One unary point by wrk: `conc` keep-alive connections for `seconds` (after `warmup_s` unmeasured)."""
    if shutil.which(WRK) is None:
        raise Unavailable(f"{WRK} is not installed (apt-get install wrk)")
    script = wrk_script(scripts / f"wrk-{target.name}.lua", target, body)
    url = f"http://{target.host}:{target.port}{target.path}"
    threads = max(1, min(threads, conc))

    def wrk(duration_s: float) -> subprocess.CompletedProcess[str]:
        argv = [WRK, "-t", str(threads), "-c", str(conc), "-d", f"{duration_s:g}s", "--timeout", "30s"]
        argv += ["--latency", "-s", str(script), url]
        return subprocess.run(argv, capture_output=True, text=True, timeout=duration_s + 60, check=False)

    if warmup_s > 0:
        wrk(warmup_s)
    children0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    before = cpu_snapshot(watched)
    started = time.monotonic()
    done = wrk(seconds)
    elapsed = time.monotonic() - started
    cpu = cpu_shares(before, watched, elapsed)
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu["client"] = (children.ru_utime + children.ru_stime - children0.ru_utime - children0.ru_stime) / elapsed
    line = next((x for x in done.stdout.splitlines() if x.startswith("WRK ")), "")
    if done.returncode != 0 or not line:
        raise RuntimeError(f"wrk failed ({done.returncode}): {done.stderr[-1000:]}{done.stdout[-1000:]}")
    got = json.loads(line[4:])
    errors = {k: int(got[k]) for k in ("connect", "read", "write", "status", "timeout") if got[k]}
    window = got["duration_us"] / 1e6
    # wrk counts every answer in `requests`; those not 2xx/3xx are in `status`.
    requests = int(got["requests"]) - int(got["status"])
    percentiles = {float(q): us / 1000 for q, us in got["latency_us"].items()}
    return Point(
        target=target.name,
        mode="unary",
        conc=conc,
        seconds=window,
        result=Result(errors=errors),
        cpu=cpu,
        percentiles=percentiles,
        requests=requests,
    )
