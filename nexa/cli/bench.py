"""`nexa bench`, `nexa benchmarks` and `nexa jobs`: measure a deployment through the gateway, and
read the runs and the jobs the controller keeps (operator)."""

from __future__ import annotations

import argparse
import functools
import os
import sys
from typing import TYPE_CHECKING, Any, Final

from nexa.cli import common
from nexa.cli.output import Cells, gib, print_json, table
from nexa.cli.tables import BENCH_RUN, BENCH_RUNS, JOB_SHOW, JOBS, Show
from nexa.contracts.evidence import BenchKind, BenchPoint, BenchRun, JobKind, JobState, Percentiles
from nexa.errors import ConfigError

if TYPE_CHECKING:
    from nexa.bench.runner import Plan

EXIT_OK: Final = 0
EXIT_INTERRUPTED: Final = 130

_KINDS_HELP: Final = """kinds:
  concurrency  a closed-loop sweep: --concurrency clients at once, each step --duration-s (default 1,2,4,8,16)
  saturation   open loop: --rates requests/s steps (default 5,10,20,40,80); stops at the first step that
               breaks the deployment's error or latency objective, or after the last
  cold-start   creates a one-replica copy of the deployment, named <name>-bench-cold-<n>, from its spec;
               times create -> Ready -> first token through the gateway, then deletes the copy (while other
               replicas serve the same model, the first answer may come from one of them)
  long-stream  a few long streams (--max-tokens, default 1024): TPOT and tokens/s per step (default 1,2)
  mixed        streaming and unary chat plus embeddings; one tenant per --inference-key given (default 2,4,8)

Requests go to the gateway (--url /v1) with the inference key; the deployment, the nodes, the job and
the run go to the API with the operator key (--token). The run is posted to the controller, which
judges it against the deployment's objectives (unless --no-record, which posts nothing at all)."""


def add_commands(sub: Any, common_flags: argparse.ArgumentParser) -> None:
    s = sub.add_parser(
        "bench",
        parents=[common_flags],
        help="measure a deployment through the gateway (operator + inference key)",
        description="Measure a deployment through the gateway as a client does, with the OpenAI API.",
        epilog=_KINDS_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument(
        "kind",
        choices=[k.value for k in BenchKind],
        metavar="KIND",
        help="concurrency, saturation, cold-start, long-stream or mixed",
    )
    s.add_argument("--deployment", required=True, metavar="NAME")
    s.add_argument("--model", help="the model name to call (default: the deployment's alias, or its model's name)")
    s.add_argument("--concurrency", metavar="1,2,4,8", help="the steps of a closed-loop kind")
    s.add_argument("--rates", metavar="5,10,20", help="saturation: the requests/s of each step")
    s.add_argument("--duration-s", type=float, default=10.0, help="seconds of load per step (default 10)")
    s.add_argument("--max-tokens", type=int, help="max_tokens of each chat request (default 64; long-stream 1024)")
    s.add_argument("--seed", type=int, help="pick the prompts reproducibly")
    s.add_argument("--no-record", action="store_true", help="post nothing: no job, no run (no verdict either)")
    s.add_argument(
        "--inference-key",
        action="append",
        help="an inference key ($NEXA_INFERENCE_KEY); repeat it for several tenants (mixed)",
    )
    s.add_argument("--ready-timeout-s", type=float, default=600.0, help="cold-start: the longest wait for Ready")
    s.set_defaults(handler=_bench)

    runs = sub.add_parser("benchmarks", help="recorded benchmark runs (operator)").add_subparsers(
        metavar="VERB", required=True
    )
    s = BENCH_RUNS.add(runs, common_flags, help_text="the runs, newest first")
    s.add_argument("--deployment", help="only this deployment's runs")
    s = runs.add_parser("show", parents=[common_flags], help="one run: its steps and its verdict")
    s.add_argument("run_id")
    s.set_defaults(handler=_SHOW_RUN.run)

    jobs = sub.add_parser("jobs", help="long-running work: benchmarks, evals, sims, backups, rollouts (operator)")
    verbs = jobs.add_subparsers(metavar="VERB", required=True)
    s = JOBS.add(verbs, common_flags, help_text="the jobs, newest first")
    s.add_argument("--kind", choices=[k.value for k in JobKind])
    s.add_argument("--state", choices=[k.value for k in JobState])
    s = verbs.add_parser("show", parents=[common_flags], help="one job")
    s.add_argument("job_id")
    s.set_defaults(handler=JOB_SHOW.run)


def _bench(args: argparse.Namespace) -> int:
    import trio

    from nexa.bench.progress import Progress
    from nexa.bench.runner import Interrupted, Runner

    plan = _plan(args)
    runner = Runner(plan, functools.partial(common.client, args), Progress(len(plan.steps)))
    try:
        result = trio.run(runner.run)
    except Interrupted:
        print("nexa: stopped (Ctrl-C): the load stopped; its job is marked cancelled", file=sys.stderr)
        return EXIT_INTERRUPTED
    finally:
        runner.close()
    if args.json:
        print_json(result.stored if result.stored is not None else result.create)
        return EXIT_OK
    print(table([_point_cells(p) for p in result.create.points], _POINT_COLUMNS))
    if result.create.cold_start_ready_s is not None:
        print(
            f"cold start: Ready after {result.create.cold_start_ready_s:.2f} s, "
            f"first token after {result.create.cold_start_first_token_s or 0:.2f} s"
        )
    print(f"memory headroom: {gib(result.create.memory_headroom_bytes)} (least available on its nodes)")
    if result.stored is None:
        print("not recorded (--no-record): no verdict")
    else:
        _print_verdict(result.stored)
    return EXIT_OK


def _plan(args: argparse.Namespace) -> Plan:
    """The run the flags ask for; ConfigError (exit 2) saying what to give instead."""
    from nexa.bench import stats
    from nexa.bench.runner import DEFAULT_MAX_TOKENS, DEFAULT_STEPS, LONG_STREAM_MAX_TOKENS, Plan

    kind = BenchKind(args.kind)
    keys = args.inference_key or [k for k in [os.environ.get("NEXA_INFERENCE_KEY")] if k]
    if not keys:
        raise ConfigError(
            "no inference key: set NEXA_INFERENCE_KEY or pass --inference-key (an inference key of a tenant: "
            "`nexa keys create --role inference --tenant T`)"
        )
    common.require_token(args)
    if kind is BenchKind.SATURATION:
        if args.concurrency:
            raise ConfigError("saturation takes --rates (requests/s), not --concurrency")
        steps = stats.steps(args.rates or DEFAULT_STEPS[kind], flag="--rates", whole=False)
    else:
        if args.rates:
            raise ConfigError(f"{kind.value} takes --concurrency, not --rates (those are for saturation)")
        steps = stats.steps(args.concurrency or DEFAULT_STEPS[kind], flag="--concurrency", whole=True)
    if not 0 < args.duration_s <= 3600:
        raise ConfigError("--duration-s: give seconds above 0 and at most 3600")
    max_tokens = args.max_tokens or (LONG_STREAM_MAX_TOKENS if kind is BenchKind.LONG_STREAM else DEFAULT_MAX_TOKENS)
    if not 1 <= max_tokens <= 1_000_000:
        raise ConfigError("--max-tokens: give a whole number from 1 to 1000000")
    if args.seed is not None and not 0 <= args.seed < 2**63:
        raise ConfigError("--seed: give a whole number from 0 to 2^63-1")
    return Plan(
        kind=kind,
        deployment=args.deployment,
        steps=steps,
        duration_s=args.duration_s,
        max_tokens=max_tokens,
        inference_keys=keys,
        gateway_url=args.url,
        model=args.model,
        seed=args.seed,
        record=not args.no_record,
        ready_timeout_s=args.ready_timeout_s,
    )


_POINT_COLUMNS: Final = (
    "step",
    "requests",
    "errors",
    "ttft_p50/p95/p99",
    "tpot_p50/p95/p99",
    "e2e_p50/p95/p99",
    "overhead_p95",
    "tok/s",
    "req/s",
)


def _ms(p: Percentiles) -> str:
    if p.p50 is None:
        return "-"
    return "/".join("-" if v is None else f"{v:.1f}" for v in (p.p50, p.p95, p.p99))


def _point_cells(p: BenchPoint) -> Cells:
    from nexa.bench.progress import step_name

    return {
        "step": step_name(p),
        "requests": p.requests,
        "errors": ",".join(f"{code}={n}" for code, n in sorted(p.errors.items())) or "0",
        "ttft_p50/p95/p99": _ms(p.ttft_ms),
        "tpot_p50/p95/p99": _ms(p.tpot_ms),
        "e2e_p50/p95/p99": _ms(p.e2e_ms),
        "overhead_p95": None if p.overhead_ms.p95 is None else f"{p.overhead_ms.p95:.2f}",
        "tok/s": f"{p.tokens_per_s:.0f}",
        "req/s": f"{p.requests_per_s:.1f}",
    }


def _print_verdict(run: BenchRun) -> None:
    v = run.verdict
    print(f"run {run.id}: " + ("meets its objectives" if v.meets_objectives else "does not meet its objectives"))
    for line in v.broken:
        print(f"  {line}")
    if v.recommended_concurrency is None:
        print("recommended max concurrency per replica: none (no step met every objective)")
    else:
        print(f"recommended max concurrency per replica: {v.recommended_concurrency} ({run.replicas} replicas)")


def _show_run_after(run: BenchRun) -> None:
    print()
    print(table([_point_cells(p) for p in run.run.points], _POINT_COLUMNS))
    _print_verdict(run)


_SHOW_RUN: Final = Show(path="/api/v1/benchmarks/{run_id}", answer=BenchRun, view=BENCH_RUN, after=_show_run_after)
