"""`perf/gateway.py --modes native`: the gateways measured with load that costs little per event.

The upstream is perf/c/paced_upstream.c (every stream `--native-events` content chunks at
`--native-rate` events/s, then a usage chunk and `data: [DONE]`), the client perf/c/sse_loadgen.c (one
epoll thread), both built by perf/native.py. Every target answers from that one upstream: direct, the
controller (controller → CurveZMQ → node agent → upstream), LiteLLM proxy and vllm-router, measured in
one run and interleaved (every target at one point before the next point):

- unary at c=1 (the added p50) and one stream at c=1 (the time to its first chunk, TTFC), each
  `--seconds` long;
- for N in `--native-streams`, N connections that stream back to back: their first requests spread
  over one stream's nominal duration before the window opens (so N streams run throughout it), then
  `--native-seconds` measured.

From /proc (utime + stime over the window) and the load generator's own CPU clock, it reports each
process's CPU µs per relayed SSE event (every `data:` event the client received in the window: the
content chunks, the usage chunk and `[DONE]`) and per request (streams ended in the window), and its
share of a core. Under other load on the machine the µs per event holds better than any rate.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import attrs

from perf.loadgen import Target, cpu_shares, cpu_snapshot
from perf.native import NativePoint, c_point

#: The processes that serve each target besides the upstream and the load generator.
GATEWAY_PROCESSES: dict[str, tuple[str, ...]] = {
    "direct": (),
    "control": ("control", "node"),
    "litellm": ("litellm",),
    "vllm-router": ("vllm-router",),
}
HARNESS = ("upstream", "loadgen")
#: A stream is behind when it lasted longer than this times its nominal duration (events / rate).
BEHIND_FACTOR = 1.2
#: After a point, wait (at most SETTLE_MAX_S) until no watched process uses more than SETTLE_SHARE of a core
#: (a gateway still draining streams the client gave up would bill the next target).
SETTLE_SHARE = 0.10
SETTLE_MAX_S = 60.0
#: The model name the native deployment answers to.
ALIAS = "chat-native"
PROMPT = "say something short about the weather"
#: Content chunks of the c=1 stream (its `max_tokens`): short, so the window holds many first chunks.
C1_STREAM_EVENTS = 2


@attrs.frozen
class Row:
    target: str
    #: "unary" (c=1), "stream" (c=1) or "paced" (N streams).
    kind: str
    conc: int
    native: NativePoint

    def cpu_us(self, name: str, per: str) -> float:
        """`name`'s CPU µs per relayed event ("event") or per request ("request") in the window."""
        p = self.native.point
        count = self.native.window_events if per == "event" else p.count
        return p.cpu[name] * p.seconds / count * 1e6 if count and name in p.cpu else float("nan")


def body(stream: bool, events: int) -> bytes:
    payload: dict[str, object] = {
        "model": ALIAS,
        "messages": [{"role": "user", "content": PROMPT}],
        "max_tokens": events,
    }
    if stream:
        payload["stream"] = True
        payload["stream_options"] = {"include_usage": True}
    return json.dumps(payload).encode()


def measure(
    targets: dict[str, Target], order: list[str], args: argparse.Namespace, watched: dict[str, int], scratch: Path
) -> list[Row]:
    """Every target at c=1 (unary, then stream), then at each N of `--native-streams`; interleaved."""
    nominal = args.native_events / args.native_rate
    points: list[tuple[str, int, float]] = [("unary", 1, 0.0), ("stream", 1, 0.0)]
    points += [("paced", int(n), nominal) for n in args.native_streams.split(",") if n.strip()]
    rows = []
    for kind, conc, ramp in points:
        seconds = args.native_seconds if kind == "paced" else args.seconds
        for name in order:
            native = c_point(
                targets[name],
                kind,
                conc,
                body(kind != "unary", C1_STREAM_EVENTS if kind == "stream" else args.native_events),
                seconds=seconds,
                warmup_s=args.warmup_s,
                ramp_s=ramp,
                watched=watched,
                scratch=scratch,
            )
            rows.append(Row(target=name, kind=kind, conc=conc, native=native))
            settle(watched)
            p = native.point
            gateway = sum(rows[-1].cpu_us(n, "event") for n in GATEWAY_PROCESSES[name])
            print(
                f"  native {name} {kind} c={conc}: {p.count} answers, {native.window_events / seconds:.0f} events/s, "
                f"p50 {fmt(p.lat(0.5))} ms, TTFC p50 {fmt(p.ttft(0.5))} ms, errors {sum(p.result.errors.values())}"
                + (f", gateway {gateway:.1f} µs/event" if GATEWAY_PROCESSES[name] and kind == "paced" else ""),
                flush=True,
            )
    return rows


def settle(watched: dict[str, int]) -> None:
    """Returns once every watched process used less than SETTLE_SHARE of a core over half a second."""
    deadline = time.monotonic() + SETTLE_MAX_S
    while time.monotonic() < deadline:
        before = cpu_snapshot(watched)
        time.sleep(0.5)
        if max(cpu_shares(before, watched, 0.5).values(), default=0.0) < SETTLE_SHARE:
            return


def fmt(value: float, spec: str = ".2f") -> str:
    return "-" if value != value else format(value, spec)  # NaN → "-"


def report(rows: list[Row], args: argparse.Namespace) -> None:
    by = {(r.target, r.kind, r.conc): r for r in rows}
    nominal = args.native_events / args.native_rate
    print()
    print(
        f"native mode: C load generator, C upstream ({args.native_events} content chunks per stream at "
        f"{args.native_rate:g} events/s, + usage + [DONE] = {args.native_events + 2} events)"
    )
    print(f"c=1 (ms; added = minus direct; the c=1 stream is {C1_STREAM_EVENTS} content chunks)")
    print(f"{'target':<12} {'unary p50':>9} {'+p50':>7} {'p99':>7} {'TTFC p50':>9} {'+TTFC':>7} {'TTFC p99':>9}")
    for name in dict.fromkeys(r.target for r in rows):
        u, s = by.get((name, "unary", 1)), by.get((name, "stream", 1))
        du, ds = by.get(("direct", "unary", 1)), by.get(("direct", "stream", 1))
        if not u or not s:
            continue
        up, sp = u.native.point, s.native.point
        add_u = up.lat(0.5) - du.native.point.lat(0.5) if du and name != "direct" else float("nan")
        add_s = sp.ttft(0.5) - ds.native.point.ttft(0.5) if ds and name != "direct" else float("nan")
        ms = ".3f"
        print(
            f"{name:<12} {fmt(up.lat(0.5), ms):>9} {fmt(add_u, ms):>7} {fmt(up.lat(0.99), ms):>7} "
            f"{fmt(sp.ttft(0.5), ms):>9} {fmt(add_s, ms):>7} {fmt(sp.ttft(0.99), ms):>9}"
        )
    paced = [r for r in rows if r.kind == "paced"]
    if not paced:
        return
    print()
    print(
        f"paced streams ({args.native_seconds:g} s window; behind: a stream that took > {BEHIND_FACTOR:g} x "
        f"{nominal:g} s; events/s of the nominal N x {args.native_rate:g})"
    )
    print(
        f"{'target':<12} {'N':>5} {'streams/s':>9} {'events/s':>9} {'of nom.':>7} {'TTFC p50':>9} {'TTFC p99':>9}"
        f" {'behind':>6}  errors"
    )
    for r in paced:
        p = r.native.point
        rate = r.native.window_events / p.seconds
        behind = sum(1 for lat in p.result.latencies if lat > BEHIND_FACTOR * nominal)
        errors = json.dumps(p.result.errors) if p.result.errors else "0"
        print(
            f"{r.target:<12} {r.conc:>5} {p.rps:>9.1f} {rate:>9.0f} {rate / (r.conc * args.native_rate):>7.0%} "
            f"{fmt(p.ttft(0.5)):>9} {fmt(p.ttft(0.99)):>9} {behind:>6}  {errors}"
        )
        if r.native.error_body:
            print(f"{'':<18} the first answer other than 200 began: {r.native.error_body[:200]}")
    print()
    print("CPU per process: µs per relayed event / µs per request (stream) / % of one core")
    for r in paced:
        p = r.native.point
        names = [*GATEWAY_PROCESSES[r.target], *HARNESS]
        parts = [
            f"{n} {fmt(r.cpu_us(n, 'event'), '.1f')} / {fmt(r.cpu_us(n, 'request'), '.0f')}"
            f" / {p.cpu.get(n, 0) * 100:.0f} %"
            for n in names
        ]
        print(f"  {r.target:<12} N={r.conc:<5} " + "; ".join(parts) + f"; other {p.cpu.get('other', 0) * 100:.0f} %")
    print()
    print("comparison (gateway processes' CPU µs per relayed event, same run)")
    for n in sorted({r.conc for r in paced}):
        gw = {
            r.target: sum(r.cpu_us(x, "event") for x in GATEWAY_PROCESSES[r.target])
            for r in paced
            if r.conc == n and GATEWAY_PROCESSES[r.target]
        }
        direct = by.get(("direct", "paced", n))
        harness = sum(direct.cpu_us(x, "event") for x in HARNESS) if direct else float("nan")
        line = ", ".join(f"{t} {fmt(v, '.1f')}" for t, v in gw.items())
        ratios = ", ".join(f"control / {t} x{fmt(gw['control'] / v)}" for t, v in gw.items() if t != "control" and v)
        print(f"  N={n}: {line}" + (f"; {ratios}" if "control" in gw and ratios else ""))
        print(f"    the load itself (upstream + load generator, direct): {fmt(harness, '.1f')} µs per event")
    print("  issue 32 targets: controller <= 25 µs and agent <= 25 µs of CPU per event at 1,000 paced streams")
