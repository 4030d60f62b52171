"""Placement time for one deployment over 10, 100, 1,000 and 5,000 simulated nodes, explanation included.

Builds a seeded, mixed fleet shaped like the hardware fixtures (8x H100, 2x L40S, 1x H200,
DGX Spark GB10 with unified memory, CPU-only), with cordoned, draining and unreachable nodes,
labels, license allowances, data classes, taints, cached artifacts, load and reliability.
Times `nexa.control.deployments.scheduler.place` for a realistic vLLM deployment (1 GPU, 40 GiB, an
internal data class, a license label) with 1 and 4 replicas under spread and binpack, and for
a request nearly every node passes (the most scoring). Prints p50/p99 in ms. Never part of
the test run. Target (DESIGN.md §7): <= 1 ms p50 over 1,000 nodes, explanation included.

The garbage collector runs as it would in the controller (`--gc on`, the default): each
decision allocates one explanation per node, so gen-0 collections run during the timed calls
and a gen-2 pass now and then walks the whole fleet (that is the p99). `--gc freeze` moves the
fleet snapshot out of the collector's reach first (`gc.freeze()`, what a controller can do with
long-lived snapshots); `--gc controller` sets the collector as `nexa control` does
(`nexa.cli.roles.controller_gc`, then `gc.freeze()` of what start-up built) before the fleet
is built; `--gc off` shows the placement code alone.

Each call is timed twice: wall clock, and the thread's CPU time (`time.thread_time_ns`), which
other processes on the machine disturb less.

    .venv/bin/python perf/placement.py
    .venv/bin/python perf/placement.py --sizes 1000 --runs 5000 --gc controller
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import random
import shlex
import statistics
import sys
import time
from pathlib import Path

import attrs

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nexa.contracts.domain import NodeState
from nexa.contracts.node import DataClassName, LabelKey, LabelValue, RuntimeKind, Taint, TaintEffect
from nexa.contracts.placement import PlacementNode, PlacementPolicy, PlacementRequest
from nexa.control.deployments.scheduler import place

GIB = 1024**3
MIB = 1024**2
SHA = "a" * 64
LICENSE = "license.nexa/llama3"
REAL_RUNTIMES = (RuntimeKind.VLLM, RuntimeKind.SGLANG, RuntimeKind.TRTLLM, RuntimeKind.LLAMACPP)

#: (share of the fleet, arch, GPUs, MiB per GPU or None for unified, host memory GiB)
SHAPES = (
    (0.35, "amd64", 8, 81559, 2048),  # h100_80g_x8
    (0.20, "amd64", 2, 46068, 512),  # l40s_48g_x2
    (0.10, "amd64", 1, 143771, 128),  # h200_141g_x1
    (0.25, "arm64", 1, None, 119),  # gb10_dgx_spark (unified)
    (0.10, "amd64", 0, 0, 256),  # cpu only
)
STATES = (
    (0.95, NodeState.READY),
    (0.02, NodeState.CORDONED),
    (0.01, NodeState.DRAINING),
    (0.02, NodeState.UNREACHABLE),
)


def _pick(rng: random.Random, table: tuple[tuple[float, object], ...]) -> object:
    x = rng.random()
    for share, value in table:
        if x < share:
            return value
        x -= share
    return table[-1][1]


def simulated_node(rng: random.Random, i: int) -> PlacementNode:
    shape = _pick(rng, tuple((s[0], s) for s in SHAPES))
    assert isinstance(shape, tuple)
    _, arch, gpus, mib_per_gpu, host_gib = shape
    state = _pick(rng, STATES)
    assert isinstance(state, NodeState)
    host_total = host_gib * GIB
    host_free = int(host_total * rng.uniform(0.3, 0.95))
    labels = {LabelKey("zone"): LabelValue(rng.choice("abc"))}
    if rng.random() < 0.7:
        labels[LabelKey(LICENSE)] = LabelValue("allowed")
    data_classes = [DataClassName("public")]
    if rng.random() < 0.8:
        data_classes.append(DataClassName("internal"))
    taints = (Taint(key=LabelKey("maintenance"), effect=TaintEffect.NO_SCHEDULE),) if rng.random() < 0.05 else ()
    runtimes = REAL_RUNTIMES if rng.random() < 0.9 else (RuntimeKind.LLAMACPP,)
    cached = tuple(f"{rng.getrandbits(256):064x}" for _ in range(rng.randrange(8)))
    if rng.random() < 0.3:
        cached = (*cached, SHA)
    if mib_per_gpu is None:  # unified: the GPU is shared, memory is the host's pool
        return PlacementNode(
            id=f"node-{i:05d}",
            state=state,
            arch=arch,
            labels=labels,
            taints=taints,
            data_classes=tuple(data_classes),
            runtimes=runtimes,
            unified_memory=True,
            gpu_count=1,
            free_gpus=("nvidia.com/gpu=0",),
            accelerator_memory_total_bytes=host_total,
            accelerator_memory_free_bytes=host_free,
            host_memory_total_bytes=host_total,
            host_memory_free_bytes=host_free,
            cached_artifacts=cached,
            load=rng.randrange(3),
            reliability=round(rng.uniform(0.9, 1.0), 3),
        )
    used = rng.randrange(gpus + 1) if gpus else 0
    return PlacementNode(
        id=f"node-{i:05d}",
        state=state,
        arch=arch,
        labels=labels,
        taints=taints,
        data_classes=tuple(data_classes),
        runtimes=runtimes,
        gpu_count=gpus,
        free_gpus=tuple(f"nvidia.com/gpu={g}" for g in range(used, gpus)),
        accelerator_memory_total_bytes=gpus * mib_per_gpu * MIB,
        accelerator_memory_free_bytes=(gpus - used) * mib_per_gpu * MIB,
        host_memory_total_bytes=host_total,
        host_memory_free_bytes=host_free,
        cached_artifacts=cached,
        load=used,
        reliability=round(rng.uniform(0.9, 1.0), 3),
    )


def fleet(n: int, seed: int) -> list[PlacementNode]:
    rng = random.Random(seed)
    return [simulated_node(rng, i) for i in range(n)]


def cases() -> list[tuple[str, PlacementRequest]]:
    vllm = PlacementRequest(
        deployment="llama3-8b",
        runtime=RuntimeKind.VLLM,
        memory_bytes=40 * GIB,
        accelerators=1,
        artifact_sha256=SHA,
        data_classes=(DataClassName("internal"),),
        license_allowance=f"{LICENSE}=allowed",
    )
    return [
        ("vllm 1 GPU 40 GiB, spread, 1 replica", vllm),
        ("vllm 1 GPU 40 GiB, spread, 4 replicas", attrs.evolve(vllm, replicas=4)),
        (
            "vllm 1 GPU 40 GiB, binpack, 4 replicas",
            attrs.evolve(vllm, replicas=4, policy=PlacementPolicy.BINPACK),
        ),
        (
            "llamacpp 1 GiB, taint tolerated (only state filters fail), 1 replica",
            PlacementRequest(
                deployment="tiny",
                runtime=RuntimeKind.LLAMACPP,
                memory_bytes=1 * GIB,
                artifact_sha256=SHA,
                tolerations=(LabelKey("maintenance"),),
            ),
        ),
    ]


def _p50_p99(samples: list[int]) -> tuple[float, float]:
    samples.sort()
    return statistics.median(samples) / 1e6, samples[min(len(samples) - 1, int(len(samples) * 0.99))] / 1e6


def measure(
    nodes: list[PlacementNode], req: PlacementRequest, runs: int
) -> tuple[tuple[float, float], tuple[float, float], int, bool]:
    """(wall p50, p99) and (CPU p50, p99) in ms, eligible nodes, feasible."""
    for _ in range(min(50, runs)):
        place(nodes, req)
    wall, cpu = [], []
    for _ in range(runs):
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        decision = place(nodes, req)
        cpu.append(time.thread_time_ns() - c0)
        wall.append(time.perf_counter_ns() - t0)
    eligible = sum(e.eligible for e in decision.explanations)
    return _p50_p99(wall), _p50_p99(cpu), eligible, decision.feasible


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 1000, 5000])
    parser.add_argument("--runs", type=int, default=0, help="timed calls per case (default: by fleet size)")
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--gc", choices=("on", "controller", "freeze", "off"), default="on")
    args = parser.parse_args()
    print("command:", shlex.join([sys.executable, *sys.argv]))
    print(f"python {platform.python_version()} on {platform.machine()}, {os.cpu_count()} CPUs; gc {args.gc}")
    if args.gc == "off":
        gc.disable()
    elif args.gc == "controller":
        from nexa.cli.roles import controller_gc

        controller_gc()
        gc.freeze()
    print(f"{'nodes':>6}  {'eligible':>8}  {'p50 ms':>8}  {'p99 ms':>8}  {'cpu p50':>8}  {'cpu p99':>8}  case")
    for n in args.sizes:
        if args.gc != "controller":
            gc.unfreeze()
        nodes = fleet(n, args.seed)
        if args.gc == "freeze":
            gc.collect()
            gc.freeze()
        runs = args.runs or max(200, min(5000, 2_000_000 // n))
        for name, req in cases():
            (p50, p99), (cpu50, cpu99), eligible, feasible = measure(nodes, req, runs)
            note = "" if feasible else "  (not feasible)"
            print(f"{n:>6}  {eligible:>8}  {p50:>8.3f}  {p99:>8.3f}  {cpu50:>8.3f}  {cpu99:>8.3f}  {name}{note}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
