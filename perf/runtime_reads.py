"""The node agent's read of its runtimes' streams, alone: CPU µs per event of `nexa.node.http1`.

The C paced upstream (`perf/c/paced_upstream.c`, as `perf/gateway.py --modes native` uses) streams
`--streams` chat completions at once, each `--events` chunks at `--rate` events/s, then the next.
A child process per `--tree` reads them all through that tree's `RuntimeClient`, as the relay does
(`post`, then `aiter_bytes`), with the agent's wake-up moderation (`[relay] gather_s`, `--gather`)
installed for its run, and reads its own CPU time over `--seconds`: CPU µs per SSE event read.
Nothing else runs in the child (no channel, no controller), so the figure is the read path's. Trees
take turns, `--rounds` times, against the same upstream, so a before tree (`git worktree add
/tmp/before HEAD`) and this one are measured in the same run; it prints each round and the medians.

    .venv/bin/python perf/runtime_reads.py --tree before=/tmp/before --tree after=.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HOST = "127.0.0.9"
#: A chat completion request as the relay passes it on (the upstream answers any body the same way).
BODY = json.dumps({"model": "chat", "stream": True, "messages": [{"role": "user", "content": "hi"}]}).encode()
HEADERS = (("Content-Type", "application/json"),)


def child(port: int, streams: int, seconds: float, gather_s: float) -> None:
    """Read `streams` paced streams at once for `seconds` (after they all started); print one JSON line."""
    # Imported here, from the tree on PYTHONPATH (the parent imports nexa from this one).
    import trio

    import nexa
    from nexa.moderation import moderated
    from nexa.node.http1 import RuntimeClient

    counted = {"on": False, "events": 0}

    async def stream_after_stream(client: RuntimeClient) -> None:
        while True:
            async with client.post(HOST, port, "/v1/chat/completions", BODY, HEADERS) as answer:
                async for piece in answer.aiter_bytes():
                    if counted["on"]:
                        counted["events"] += piece.count(b"\n\n")

    async def main() -> None:
        client = RuntimeClient(connect_timeout_s=10)
        with moderated(gather_s, lambda: True):
            async with trio.open_nursery() as nursery:
                for _ in range(streams):  # spread over two seconds, as paced clients arrive
                    nursery.start_soon(stream_after_stream, client)
                    await trio.sleep(2.0 / streams)
                await trio.sleep(1.0)
                counted["on"], began = True, time.process_time()
                await trio.sleep(seconds)
                spent, counted["on"] = time.process_time() - began, False
                nursery.cancel_scope.cancel()
        print(json.dumps({"events": counted["events"], "cpu_s": spent, "nexa": str(Path(nexa.__file__).parents[1])}))

    trio.run(main)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tree", action="append", default=[], help="LABEL=DIR: a source tree to measure (repeatable)")
    parser.add_argument("--streams", type=int, default=100)
    parser.add_argument("--events", type=int, default=40, help="content chunks per stream")
    parser.add_argument("--rate", type=float, default=20.0, help="events/s per stream")
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--gather", type=float, default=0.005, help="the agent's [relay] gather_s (0: off)")
    parser.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child is not None:
        child(args.child, args.streams, args.seconds, args.gather)
        return
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from nexa.localparts import free_ports
    from perf.native import PacedUpstream
    from perf.trees import parse_trees, run_child

    trees = parse_trees(args.tree)
    upstream = PacedUpstream(HOST, free_ports(1, HOST)[0], args.events, args.rate)
    print("command:", " ".join([Path(sys.executable).name, *sys.argv]))
    print(f"{args.streams} streams x {args.rate:g} events/s from the C upstream; gather_s {args.gather:g}")
    figures: dict[str, list[float]] = {label: [] for label in trees}
    upstream.start()
    try:
        for round_ in range(1, args.rounds + 1):
            for label, tree in trees.items():
                argv = [__file__, "--child", str(upstream.port), "--streams", str(args.streams)]
                argv += ["--seconds", str(args.seconds), "--gather", str(args.gather)]
                got = run_child(tree, argv, args.seconds + 60)
                per_event = 1e6 * got["cpu_s"] / max(got["events"], 1)
                figures[label].append(per_event)
                line = f"{got['events']:7d} events, {per_event:6.1f} µs CPU per event (nexa from {got['nexa']})"
                print(f"  round {round_}: {label:8s} {line}")
    finally:
        upstream.stop()
    print("median CPU µs per event read:", "; ".join(f"{k} {statistics.median(v):.1f}" for k, v in figures.items()))


if __name__ == "__main__":
    main()
