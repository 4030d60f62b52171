"""The channel's send path, alone: CPU µs per data frame a node's uplink pump sends.

A child process per `--tree` runs that tree's `ZmqPump` on a DEALER with the uplink's settings (it
joins queued data messages into one zmq message, `framing.joins_data`), over CurveZMQ on TCP
loopback, to a ROUTER in this process that only drains. The child queues `--batch` data messages
(`[kind, request id, head, body]`, a token's SSE event as body) at a time, as the relay does after
a moderated wake-up, lets the pump send them, and repeats for `--seconds`. It prints CPU µs per
data frame of its trio thread (the pump and the Python side of zmq's sends) and of the whole
process (zmq's I/O thread too: CurveZMQ, TCP, and its wake-up per message, which varies most). Trees take turns,
`--rounds` times, so a before tree (`git worktree add /tmp/before HEAD`) and this one are measured
in the same run; it prints each round and the medians.

    .venv/bin/python perf/channel_sends.py --tree before=/tmp/before --tree after=.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import zmq

HOST = "127.0.0.9"
EVENT = (
    b'data: {"id":"chatcmpl-1","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"tok"}}]}\n\n'
)
HEAD = b'{"seq":12,"final":false}'


def child(endpoint: str, server_public: bytes, batch: int, seconds: float) -> None:
    """Send batches through a pump for `seconds`; print one JSON line: frames sent, CPU s of the
    process and of its trio thread."""
    # Imported here, from the tree on PYTHONPATH (the parent imports nothing of nexa).
    import trio

    from nexa.channel.framing import encode_data, joins_data
    from nexa.channel.pump import ZmqPump

    async def main() -> None:
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        dealer = ctx.socket(zmq.DEALER)
        public, secret = zmq.curve_keypair()
        dealer.curve_serverkey, dealer.curve_publickey, dealer.curve_secretkey = server_public, public, secret
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(endpoint)
        pump = ZmqPump(dealer, coalesce=joins_data)
        messages = [encode_data("chunk", f"req-{n:04d}", HEAD, EVENT) for n in range(batch)]
        sent = 0
        async with trio.open_nursery() as nursery:
            await nursery.start(pump.run)
            await trio.sleep(0.5)  # the handshake
            began, began_thread = time.process_time(), time.thread_time()
            ends = time.monotonic() + seconds
            while time.monotonic() < ends:
                for message in messages:
                    pump.send_nowait(message)  # as the relay queues a wake-up's chunks
                sent += batch
                await trio.lowlevel.checkpoint()  # the pump sends them, joined
                while pump.statistics().outbox_depth:  # (seldom: only when it could not take them all)
                    await trio.lowlevel.checkpoint()
            spent, spent_thread = time.process_time() - began, time.thread_time() - began_thread
            nursery.cancel_scope.cancel()
        dealer.close(linger=0)
        ctx.term()
        print(json.dumps({"frames": sent, "cpu_s": spent, "thread_cpu_s": spent_thread}))

    trio.run(main)


def drain(router: zmq.Socket[bytes], stop: threading.Event) -> None:
    while not stop.is_set():
        if router.poll(100):
            while True:
                try:
                    router.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tree", action="append", default=[], help="LABEL=DIR: a source tree to measure (repeatable)")
    parser.add_argument("--batch", type=int, default=10, help="data messages queued at a time (1 to 64)")
    parser.add_argument("--seconds", type=float, default=4.0, help="measured seconds per tree and round")
    parser.add_argument("--rounds", type=int, default=5, help="turns of every tree")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from perf.trees import parse_trees, run_child

    trees = parse_trees(args.tree)
    print("command:", " ".join([Path(sys.executable).name, *sys.argv]))

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    public, secret = zmq.curve_keypair()
    router.curve_server, router.curve_publickey, router.curve_secretkey = True, public, secret
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port(f"tcp://{HOST}")
    stop = threading.Event()
    drainer = threading.Thread(target=drain, args=(router, stop), daemon=True)
    drainer.start()
    figures: dict[str, list[tuple[float, float]]] = {label: [] for label in trees}
    try:
        for round_no in range(1, args.rounds + 1):
            line = []
            for label, tree in trees.items():
                argv = [
                    __file__,
                    "--child",
                    f"tcp://{HOST}:{port}",
                    public.decode(),
                    str(args.batch),
                    str(args.seconds),
                ]
                got = run_child(tree, argv, args.seconds + 60)
                thread_us, us = (got[k] / got["frames"] * 1e6 for k in ("thread_cpu_s", "cpu_s"))
                figures[label].append((thread_us, us))
                line.append(f"{label} {thread_us:.2f} µs, process {us:.2f} ({got['frames']} frames)")
            print(f"round {round_no}: " + ", ".join(line), flush=True)
    finally:
        stop.set()
        drainer.join()
        router.close(linger=0)
        ctx.term()
    print(f"CPU µs per data frame sent, batches of {args.batch}, median (range) over {args.rounds} rounds:")
    for label, pairs in figures.items():
        parts = []
        for name, values in (("trio thread", [p[0] for p in pairs]), ("process", [p[1] for p in pairs])):
            parts.append(f"{name} {statistics.median(values):.2f} ({min(values):.2f}-{max(values):.2f})")
        print(f"  {label:>10}: " + ", ".join(parts))


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3].encode(), int(sys.argv[4]), float(sys.argv[5]))
    else:
        main()
