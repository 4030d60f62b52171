"""Failover, measured (issue 20, point 4; issue 16, point 6): three `nexa control` on one PostgreSQL
behind an nginx ingress, four `nexa node` agents, and the leader SIGKILLed under load.

Sets up, on loopback and as an operator would: PostgreSQL (`nexa.localparts.LocalPostgres`, one
database), the OCI registry and the S3 store `nexa demo` starts, three `nexa control --config`
processes on the one database (`[cluster] lease_s`/`renew_s` from the flags; the first one's keys
directory copied to the others before they first start), nginx in front of their HTTP ports
(`perf.upstream.Ingress`: round-robin; a request goes to the next controller only when it was not
sent yet), and four `nexa node` agents from 127.0.0.11 to .14, each with a channel to every
controller (node.toml `controllers`). Through the ingress only: the demo's tenant, inference key,
`sim` runtime and model, and a `chat` deployment of one `sim` replica per node.

A failover: `--concurrency` clients (the openai SDK) ask `chat` back to back through the ingress,
while a writer creates tenants through it and records each one acknowledged (201). After
`--warmup-s` the leader is SIGKILLed; `--after-s` later the load stops. Printed: the failover time
(the kill → another controller's /readyz says leader at a higher epoch), the inference requests that
failed (in flight at the kill, and on the killed controller) and the ones that succeeded after it,
the writes acknowledged against those found on every other controller afterwards, the nodes'
acknowledged epoch, `nexa audit verify` through the ingress, and the old leader restarted (its
/readyz: follower). `--failovers` repeats it, killing each new leader in turn.

Then requests/s through nginx with one gateway (controller) against two, at `--gateway-concurrency`
(16), interleaved, by wrk: a second model, `fast`, one replica per node, whose runtime nginx stands
in for with a fixed answer on each node's address (as in perf/gateway.py), so that the controllers
and agents are measured, not a Python runtime. The closing note says what a 2-core machine can
show of it. Everything this started is stopped, by PID, on every exit path.

    .venv/bin/python perf/failover.py

The parts and the scenario are perf/failover_cluster.py's, which tests/e2e/test_failover.py runs too.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from functools import partial
from pathlib import Path

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nexa.localparts import free_ports
from perf.failover_cluster import (
    CONTROLLERS,
    NODES,
    PROMPT,
    After,
    ControlProcess,
    Failover,
    FailoverCluster,
    check_after,
    epochs_now,
    run_failover,
    start,
    stop_cluster,
    wait_leader,
)
from perf.loadgen import Point, Target, machine_busy_seconds
from perf.upstream import Ingress, wrk_point


def print_failover(n: int, f: Failover, a: After, args: argparse.Namespace) -> None:
    late = [c for c in f.failed if c.started > f.gone_at]
    errors = Counter(c.error for c in f.failed)
    print(
        f"failover {n}: SIGKILL {f.killed.name} (leader at epoch {f.old_epoch}) after {args.warmup_s:g} s of load,"
        f" gone {(f.gone_at - f.killed_at) * 1000:.0f} ms later; {f.leader.name} leads at epoch {f.epoch},"
        f" {f.took_s:.2f} s after the kill",
        flush=True,
    )
    print(
        f"  inference: {len(f.calls)} requests, {len(f.failed)} failed ({dict(errors)}): {len(f.in_flight)} in flight"
        f" at the kill ({len(f.on_killed)} of them sent to {f.killed.name}), {len(late)} started after it;"
        f" {f.ok_after} succeeded after the kill (c={args.concurrency})"
    )
    found = {name: len(f.writes.acked) - len(m) for name, m in a.missing.items()}
    refused = ", ".join(f"{n} x {status}" for status, n in sorted(f.writes.refused.items())) or "none"
    print(
        f"  writes: {len(f.writes.acked)} acknowledged, found on "
        + ", ".join(f"{name} {n}/{len(f.writes.acked)}" for name, n in found.items())
        + f"; {len(f.writes.unknown)} without an answer (in flight at the kill; {a.unknown_made} made);"
        f" refused: {refused}"
    )
    epochs = sorted({(b, e) for b, e in a.node_epochs.values()})
    print(f"  nodes: acknowledged epoch (before, after) {epochs} on {len(a.node_epochs)} nodes")
    print(f"  nexa audit verify through the ingress: exit {a.audit_rc}: {a.audit_out}")
    print(
        f"  {f.killed.name} restarted: /readyz role {a.rejoined_role}, ready {a.rejoin_s:.1f} s after its start;"
        f" it answered its first completion {a.serving_s:.2f} s after that"
        + (
            f" ({a.refused_while_ready} refused before, 503: the nodes' channels to it reconnect and report first)"
            if a.refused_while_ready
            else ""
        )
    )
    if others := [c for c in f.failed if c not in f.in_flight]:
        by = Counter((c.error, c.upstream) for c in others)
        print(f"  failed, not in flight at the kill: {dict(by)}")


async def gateways(
    cluster: FailoverCluster, args: argparse.Namespace
) -> tuple[dict[str, list[Point]], list[ControlProcess]]:
    """req/s through nginx at one concurrency: one controller behind it, then two, interleaved."""
    leader, _ = await wait_leader(cluster)
    a = leader
    b = next(c for c in cluster.running() if c is not leader)
    arms: dict[str, tuple[Ingress, list[ControlProcess]]] = {}
    for name, behind in (("1 gateway", [a]), ("2 gateways", [a, b])):
        ingress = Ingress(
            cluster.root / f"ingress-{len(behind)}",
            "127.0.0.1",
            free_ports(1)[0],
            [c.upstream for c in behind],
            keepalive=64,
        )
        cluster.extra.append(ingress)
        await trio.to_thread.run_sync(ingress.start)
        arms[name] = (ingress, behind)
    body = json.dumps(
        {"model": "fast", "messages": [{"role": "user", "content": PROMPT}], "max_tokens": args.fast_tokens}
    ).encode()
    points: dict[str, list[Point]] = {name: [] for name in arms}
    for r in range(args.rounds):
        for name, (ingress, behind) in arms.items():
            watched = {f"control:{c.name}": c.pid for c in behind}
            watched |= {f"node:{n.name}": n.proc.pid for n in cluster.nodes if n.proc is not None}
            watched["nginx"] = ingress.proc.pid if ingress.proc is not None else 0
            if cluster.upstream is not None and cluster.upstream.proc is not None:
                watched["upstream"] = cluster.upstream.proc.pid
            target = Target(name, ingress.host, ingress.port, "/v1/chat/completions", cluster.inference_key)
            busy0, began = machine_busy_seconds(), time.monotonic()
            point = await trio.to_thread.run_sync(
                partial(
                    wrk_point,
                    target,
                    args.gateway_concurrency,
                    body,
                    seconds=args.seconds,
                    warmup_s=args.gateway_warmup_s,
                    threads=1,
                    watched=watched,
                    scripts=cluster.root,
                )
            )
            # Everything else the machine ran meanwhile (warm-up included): it skews every figure.
            busy = (machine_busy_seconds() - busy0) / (time.monotonic() - began)
            point.cpu["other"] = max(0.0, busy - sum(point.cpu.values()))
            points[name].append(point)
            print(
                f"  round {r + 1} {name}: {point.rps:.0f} req/s, p50 {point.lat(0.5):.1f} ms,"
                f" p99 {point.lat(0.99):.1f} ms, errors {sum(point.result.errors.values())}",
                flush=True,
            )
    return points, [a, b]


#: A controller using this share of a core or more is taken to be limited by its one event loop.
SATURATED = 0.85


def print_gateways(points: dict[str, list[Point]], behind: list[ControlProcess], conc: int) -> None:
    print()
    print(
        f"requests/s through nginx, unary `fast` (nginx's fixed answer on the nodes), c={conc}, wrk; median of"
        f" {len(next(iter(points.values())))} interleaved rounds (gateways: {behind[0].name}, the leader,"
        f" and {behind[1].name})"
    )
    medians: dict[str, float] = {}
    busy: dict[str, float] = {}
    controllers: dict[str, float] = {}
    per_request: dict[str, float] = {}
    for name, ps in points.items():
        rps = medians[name] = statistics.median(p.rps for p in ps)
        cpu: dict[str, float] = {}
        for p in ps:
            for proc, share in p.cpu.items():
                cpu[proc] = cpu.get(proc, 0.0) + share / len(ps)
        controllers[name] = sum(v for k, v in cpu.items() if k.startswith("control:"))
        agents = sum(v for k, v in cpu.items() if k.startswith("node:"))
        per_request[name] = controllers[name] / rps * 1000 if rps else float("nan")
        busy[name] = sum(cpu.values())
        shares = f"agents {agents * 100:.0f}, ingress {cpu.get('nginx', 0) * 100:.0f}"
        shares += f", upstream {cpu.get('upstream', 0) * 100:.0f}, wrk {cpu.get('client', 0) * 100:.0f}"
        print(
            f"  {name:<10} {rps:>7.0f} req/s  p50 {statistics.median(p.lat(0.5) for p in ps):>6.1f} ms"
            f"  CPU % of one core: controllers {controllers[name] * 100:.0f} (per request {per_request[name]:.2f} ms),"
            f" {shares}, the rest of the machine {cpu.get('other', 0) * 100:.0f}"
        )
    one, two = "1 gateway", "2 gateways"
    if not medians.get(one):
        return
    cores = os.cpu_count() or 0
    limit = " (its one event loop is the limit)" if controllers[one] >= SATURATED else ""
    print(f"  2 gateways / 1 gateway: x{medians[two] / medians[one]:.2f}")
    print(
        f"  What this {cores}-core machine can show: two gateways behind one ingress serve the same traffic without"
        f" errors, at {per_request[two]:.2f} against {per_request[one]:.2f} ms of controller CPU per request. With one"
        f" gateway its controller used {controllers[one] * 100:.0f} % of a core{limit}"
        f" while the machine was {busy[one] * 100:.0f} % busy of {cores * 100} %: a second gateway can use only what"
        " was idle, so the ratio is this machine's bound, not the design's. What it cannot show: how req/s grows"
        " with gateways on cores of their own, since here both share the cores with the ingress and upstream nginx,"
        " the four agents, PostgreSQL and wrk. That needs a core (or a host) per controller."
    )


async def main_async(args: argparse.Namespace) -> int:
    """The run, cancelled (everything stopped all the same) by SIGTERM or SIGHUP as by Ctrl-C."""
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_cancel_on_signal, nursery.cancel_scope)
        await _measure(args)
        nursery.cancel_scope.cancel()
    return 0


async def _cancel_on_signal(scope: trio.CancelScope) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGHUP) as signals:
        async for signum in signals:
            print(f"signal {signum}: stopping everything this run started", flush=True)
            scope.cancel()
            return


async def _measure(args: argparse.Namespace) -> None:
    started = time.monotonic()
    cluster = await start(Path(args.base), lease_s=args.lease_s, renew_s=args.renew_s, fast_tokens=args.fast_tokens)
    try:
        print(
            f"set up PostgreSQL, registry, S3, {CONTROLLERS} controllers, the nginx ingress, {NODES} nodes and the"
            f" deployments in {time.monotonic() - started:.1f} s (lease_s {args.lease_s:g}, renew_s {args.renew_s:g})",
            flush=True,
        )
        took: list[float] = []
        for n in range(1, args.failovers + 1):
            before = await epochs_now(cluster)
            f = await run_failover(
                cluster, concurrency=args.concurrency, warmup_s=args.warmup_s, after_s=args.after_s, prefix=f"fo{n}"
            )
            a = await check_after(cluster, f, before)
            print_failover(n, f, a, args)
            took.append(f.took_s)
        if took:
            print(
                f"failover time over {len(took)}: median {statistics.median(took):.2f} s, max {max(took):.2f} s"
                f" (a lease lapses lease_s = {args.lease_s:g} s after its last renewal; followers try every"
                f" renew_s = {args.renew_s:g} s)"
            )
        if args.rounds:
            print()
            print(f"gateways: unary c={args.gateway_concurrency}, {args.seconds:g} s per point", flush=True)
            points, behind = await gateways(cluster, args)
            print_gateways(points, behind, args.gateway_concurrency)
    finally:
        await stop_cluster(cluster)


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--lease-s", type=float, default=2.0, help="[cluster] lease_s of every controller")
    parser.add_argument("--renew-s", type=float, default=0.5, help="[cluster] renew_s (below lease_s / 2)")
    parser.add_argument("--concurrency", type=int, default=8, help="inference clients during a failover")
    parser.add_argument("--warmup-s", type=float, default=3.0, help="seconds of load before the kill")
    parser.add_argument("--after-s", type=float, default=3.0, help="seconds of load after the new leader")
    parser.add_argument("--failovers", type=int, default=3, help="failovers, each killing the leader of the time")
    parser.add_argument("--gateway-concurrency", type=int, default=16, help="wrk connections (1 vs 2 gateways)")
    parser.add_argument("--seconds", type=float, default=5.0, help="measured seconds per gateway point")
    parser.add_argument("--gateway-warmup-s", type=float, default=1.0, help="unmeasured seconds before each")
    parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of (1 gateway, 2 gateways)")
    parser.add_argument("--fast-tokens", type=int, default=16, help="completion tokens of nginx's fixed answer")
    args = parser.parse_args()
    print("command:", shlex.join([sys.executable, *sys.argv]), flush=True)
    print(f"machine: {os.cpu_count()} CPUs; load c={args.concurrency} (openai SDK) and one writer, through nginx")
    with tempfile.TemporaryDirectory(prefix="nexa-failover-") as tmp:
        args.base = str(Path(tmp) / "run")
        return trio.run(main_async, args)


if __name__ == "__main__":
    sys.exit(main())
