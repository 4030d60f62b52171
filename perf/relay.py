"""Data-path throughput: Relay → Link ⇄ Uplink (CurveZMQ) → NodeRelay → a fast local runtime, in one process.

A raw ASGI app served by hypercorn on 127.0.0.1 streams `--events` SSE events per request as
fast as it can, `--per-write` at a time; `--streams` requests run at once through the real controller and node relays.
Reports chunk frames and events per second at the controller, and per-request wall time. Both
ends share one trio run (one core), so the figure is a floor for the relay's own cost.

    .venv/bin/python perf/relay.py --streams 8 --events 5000
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import hypercorn.config
import hypercorn.trio
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nexa import security
from nexa.channel import links
from nexa.config import Bytes, RelayConfig
from nexa.contracts import wire
from nexa.control.datapath.relay import Relay
from nexa.node.relay import NodeRelay

EVENT = b'data: {"choices":[{"index":0,"delta":{"content":"token"}}]}\n\n'


async def runtime(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    body = b""
    while True:
        msg = await receive()
        body += msg.get("body", b"")
        if not msg.get("more_body"):
            break
    req = json.loads(body)
    events, per_write = req["events"], req["per_write"]
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
    batch = EVENT * per_write
    for _ in range(events // per_write):
        await send({"type": "http.response.body", "body": batch, "more_body": True})
    await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})


async def main(args: argparse.Namespace) -> None:
    config = hypercorn.config.Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = config.errorlog = None
    ctl_curve, node_curve = links.generate_curve_keypair(), links.generate_curve_keypair()
    ctl_key, node_key = security.generate_signing_key(), security.generate_signing_key()
    link = links.Link(
        "tcp://127.0.0.1:*",
        curve=ctl_curve,
        signing_key=ctl_key,
        authorize=lambda k: "n1" if k == node_curve.public else None,
        node_key={"n1": node_key.public}.get,
        inbox_size=512,
        outbox_size=512,
    )
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(lambda task_status: hypercorn.trio.serve(runtime, config, task_status=task_status))
        port = int(binds[0].rsplit(":", 1)[1])
        endpoint = await nursery.start(link.run)
        uplink = links.Uplink(
            endpoint, curve=node_curve, server_curve_public=ctl_curve.public, signing_key=node_key,
            controller_key=ctl_key.public,
        )  # fmt: skip
        relay = Relay(link, window=args.window)
        node = NodeRelay(RelayConfig(max_chunk_bytes=Bytes(args.chunk_bytes)), uplink, {"a1": port}.get)
        await nursery.start(uplink.run)
        await nursery.start(node.run)

        async def controller() -> None:
            while True:
                got = await link.receive_any()
                if isinstance(got, links.DataInbound):
                    relay.deliver(got.node_id, got.frame)

        async def node_side() -> None:
            while True:
                msg = await uplink.receive()
                if isinstance(msg, wire.DataFrame):
                    node.deliver(msg)

        nursery.start_soon(controller)
        nursery.start_soon(node_side)
        await uplink.send(wire.Hello(node_id="n1", seq=1, ts=time.time(), agent_version="perf"))
        while not link.connected("n1"):  # noqa: ASYNC110
            await trio.sleep(0.01)

        durations: list[float] = []
        totals = {"chunks": 0, "bytes": 0}

        async def one(i: int) -> None:
            head = wire.InferHead(
                assignment_id="a1", path="/v1/chat/completions", stream=True, deadline_at=time.time() + 600, window=0
            )
            started = trio.current_time()
            async with relay.open(
                "n1", f"r{i}", head, json.dumps({"events": args.events, "per_write": args.per_write}).encode()
            ) as s:
                async for chunk in s:
                    totals["chunks"] += 1
                    totals["bytes"] += len(chunk)
                assert s.end is not None
                assert s.end.status is wire.EndStatus.OK, s.end
            durations.append(trio.current_time() - started)

        t0 = time.perf_counter()
        async with trio.open_nursery() as work:
            for i in range(args.streams):
                work.start_soon(one, i)
        elapsed = time.perf_counter() - t0
        nursery.cancel_scope.cancel()
    events = args.streams * (args.events // args.per_write * args.per_write)
    print("command: .venv/bin/python perf/relay.py " + " ".join(sys.argv[1:]))
    print(
        f"streams {args.streams}, events/stream {args.events} ({args.per_write} per runtime write), "
        f"window {args.window}, chunk ≤ {args.chunk_bytes} B"
    )
    print(f"elapsed {elapsed:.2f} s; chunk frames {totals['chunks']} ({totals['chunks'] / elapsed:,.0f}/s)")
    print(f"events {events:,} ({events / elapsed:,.0f}/s); {totals['bytes'] / elapsed / 1e6:.1f} MB/s")
    print(f"per-stream wall time: min {min(durations):.2f} s, max {max(durations):.2f} s")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--events", type=int, default=5000)
    parser.add_argument("--per-write", type=int, default=16, help="events the runtime writes at once")
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--chunk-bytes", type=int, default=65536)
    trio.run(main, parser.parse_args())
