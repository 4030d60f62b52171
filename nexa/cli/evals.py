"""`nexa eval`: register evaluation suites, run them through the gateway against a deployment (the
result is the served model version's measured evaluation), show and compare runs (operator +
inference key)."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Final

from nexa.cli import common
from nexa.cli.output import Cells, print_json, print_more, table
from nexa.contracts import codec
from nexa.contracts.evals import (
    MAX_CONCURRENCY,
    MAX_DEADLINE_S,
    EvalCompare,
    EvalRun,
    EvalRunList,
    MetricDiff,
    MetricSummary,
    Suite,
    SuiteCreate,
    SuiteList,
)
from nexa.contracts.models import ModelRef, name_problem, version_problem
from nexa.errors import ConfigError

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1

_RUN_HELP: Final = """Each case of the suite goes to the gateway (--url /v1) with the inference key, as a client sends
it: the key's tenant, quotas and limits apply, and a deployment the key may not use (the suite's own
or one a judge or cosine scorer names) stops the run (403, nothing recorded). The suite, the
deployment, the job and the run go to the API with the operator key (--token). The controller
summarizes the run per metric (pass rate with its 95% Wilson interval, mean score with its t
interval) and records it as the evaluation of the model version the deployment serves, marked
measured. Exit status 0 when the run passed (every metric's pass rate >= --min-pass-rate), 1 when not.

With --model NAME@VERSION instead of --deployment, the version need not be Approved (Verified at
least, its licence valid): a short-lived evaluation replica of it is started, like an existing
deployment (--like) or on a runtime (--runtime), which no alias points at and only the inference
key given may call; it is removed when the run ends, also when it fails or is interrupted, and the
controller removes it itself once the run's job is no longer running. The measured evaluation is
the version's, so `[models] approval_requires` can be met before approval.

With --deployment D --canary, the cases go to D's canary replicas alone and the result is the
canary version's evaluation: what a canary started with --suite needs before it is promoted.

With --deployment D --rollout, the cases go to the new replicas of D's rollout alone (those that run
its spec now): what a rollout policy's suite gate needs before each new replica passes.

A gate run by the controller (the default: `--suite-tenant T`) needs no such run: the controller
runs it itself, as tenant T, with this scorer. A run made here counts too: the newest decides."""


def add_commands(sub: Any, common_flags: argparse.ArgumentParser) -> None:
    verbs = sub.add_parser("eval", help="evaluation suites and measured runs (operator)").add_subparsers(
        metavar="VERB", required=True
    )
    s = verbs.add_parser(
        "register",
        parents=[common_flags],
        help="register a suite file (JSON Lines; `nexa docs models` has the format)",
        description="Register an evaluation suite; a bad file is refused naming each bad line.",
    )
    s.add_argument("file", help="the suite file: one case a line, JSON")
    s.add_argument("--name", required=True, help="the suite's name (registering it again replaces what runs take)")
    s.set_defaults(handler=_register)

    s = verbs.add_parser("suites", parents=[common_flags], help="the registered suites (the newest of each name)")
    s.set_defaults(handler=_suites)

    s = verbs.add_parser(
        "run",
        parents=[common_flags],
        help="run a suite against a deployment through the gateway (operator + inference key)",
        description="Run a registered suite against a deployment, through the gateway, and record the result.",
        epilog=_RUN_HELP,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    s.add_argument("suite", help="the suite's name")
    target = s.add_mutually_exclusive_group(required=True)
    target.add_argument("--deployment", metavar="NAME", help="run against this deployment")
    target.add_argument(
        "--model",
        metavar="NAME@VERSION",
        help="run against a new evaluation replica of this version (Approved or not), removed afterwards",
    )
    s.add_argument(
        "--canary",
        action="store_true",
        help="with --deployment: run against its canary replicas alone (what a canary's suite gate asks)",
    )
    s.add_argument(
        "--rollout",
        action="store_true",
        help="with --deployment: run against its rollout's new replicas alone (what a rollout's suite gate asks)",
    )
    s.add_argument("--like", metavar="DEPLOYMENT", help="with --model: run the replica like this deployment")
    s.add_argument(
        "--runtime", metavar="NAME", help="with --model: run the replica on this runtime (default resources)"
    )
    s.add_argument(
        "--ready-timeout-s",
        type=float,
        default=600.0,
        help="with --model: how long the replica may take to be Ready (600)",
    )
    s.add_argument("--call-as", help="the model name to call (default: the deployment's alias, or its model's name)")
    s.add_argument("--concurrency", type=int, default=4, help=f"cases at once (1 to {MAX_CONCURRENCY}; default 4)")
    s.add_argument(
        "--deadline-s", type=float, default=600.0, help="the whole run's limit; cases not done by then fail (600)"
    )
    s.add_argument(
        "--min-pass-rate",
        type=float,
        default=1.0,
        help="the run passes when every metric's pass rate is at least this (0 to 1; default 1)",
    )
    s.add_argument("--inference-key", help="an inference key ($NEXA_INFERENCE_KEY)")
    s.set_defaults(handler=_run)

    s = verbs.add_parser("runs", parents=[common_flags], help="measured runs, newest first")
    s.add_argument("--suite", help="only this suite's runs")
    common.page_flags(s)
    s.set_defaults(handler=_runs)

    s = verbs.add_parser("show", parents=[common_flags], help="one run: its metrics and each case")
    s.add_argument("run_id")
    s.set_defaults(handler=_show)

    s = verbs.add_parser(
        "compare",
        parents=[common_flags],
        help="B against A per metric, with 95%% intervals of the differences",
        description="Compare two runs (of the same suite, as a rule): B minus A per metric; the pass-rate "
        "difference's interval is Newcombe's (from the two Wilson intervals), the mean's Welch's.",
    )
    s.add_argument("a", help="the run compared against")
    s.add_argument("b", help="the run compared")
    s.set_defaults(handler=_compare)


def _register(args: argparse.Namespace) -> int:
    raw = common.read_file(args.file)
    try:
        content = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{args.file}: not UTF-8 text (a suite is JSON Lines)") from None
    with common.client(args) as api:
        suite = api.post(
            "/api/v1/eval/suites", Suite, body=codec.api.unstructure(SuiteCreate(name=args.name, content=content))
        )
    if args.json:
        print_json(suite)
    else:
        print(f"suite {suite.name}: {suite.cases} case(s), metrics {', '.join(suite.metrics)}, sha256 {suite.digest}")
    return EXIT_OK


def _suites(args: argparse.Namespace) -> int:
    with common.client(args) as api:
        found = api.get("/api/v1/eval/suites", SuiteList)
    if args.json:
        print_json(found)
        return EXIT_OK
    rows: list[Cells] = [
        {"name": s.name, "cases": s.cases, "metrics": ",".join(s.metrics), "sha256": s.digest[:16]}
        for s in found.suites
    ]
    print(table(rows, ("name", "cases", "metrics", "sha256")))
    return EXIT_OK


def _run(args: argparse.Namespace) -> int:
    import trio

    from nexa.bench.evals import EvalPlan, EvalRunner

    key = args.inference_key or os.environ.get("NEXA_INFERENCE_KEY")
    if not key:
        raise ConfigError(
            "no inference key: set NEXA_INFERENCE_KEY or pass --inference-key (an inference key of a tenant: "
            "`nexa keys create --role inference --tenant T`)"
        )
    if not 1 <= args.concurrency <= MAX_CONCURRENCY:
        raise ConfigError(f"--concurrency: 1 to {MAX_CONCURRENCY}")
    if not 0 < args.deadline_s <= MAX_DEADLINE_S:
        raise ConfigError(f"--deadline-s: seconds above 0 and at most {MAX_DEADLINE_S:g}")
    if not 0.0 <= args.min_pass_rate <= 1.0:
        raise ConfigError("--min-pass-rate: from 0 to 1")
    evaluate = _replica_flags(args)
    plan = EvalPlan(
        suite=args.suite,
        deployment=args.deployment,
        inference_key=key,
        gateway_url=args.url,
        concurrency=args.concurrency,
        deadline_s=args.deadline_s,
        min_pass_rate=args.min_pass_rate,
        model=args.call_as,
        evaluate=evaluate,
        like=args.like,
        runtime=args.runtime,
        ready_timeout_s=args.ready_timeout_s,
        canary=args.canary,
        rollout=args.rollout,
    )

    def progress(done: int, total: int) -> None:
        if sys.stderr.isatty():
            print(f"\r{done}/{total} cases", end="", file=sys.stderr, flush=True)

    with common.client(args) as api:
        run = trio.run(EvalRunner(plan, api, progress).run)
    if sys.stderr.isatty():
        print(file=sys.stderr)
    if args.json:
        print_json(run)
    else:
        _print_run(run)
    return EXIT_OK if run.passed else EXIT_FAILED


def _replica_flags(args: argparse.Namespace) -> ModelRef | None:
    """`--model NAME@VERSION` and the flags that go with it, checked; None without --model."""
    if args.canary and args.rollout:
        raise ConfigError("--canary or --rollout, one of them (a deployment never runs both)")
    if args.canary and (args.model is not None or args.call_as):
        raise ConfigError("--canary goes with --deployment alone (the canary's replicas are called by their own name)")
    if args.rollout and (args.model is not None or args.call_as):
        raise ConfigError("--rollout goes with --deployment alone (the new replicas are called by their own name)")
    if args.model is None:
        if args.like or args.runtime:
            raise ConfigError("--like and --runtime go with --model NAME@VERSION (a new evaluation replica)")
        return None
    name, at, version = args.model.partition("@")
    if not at or (problem := name_problem("model", name) or version_problem("version", version)):
        raise ConfigError(f"--model: NAME@VERSION, e.g. llama-8b@v2 ({problem if at else 'no @VERSION'})")
    if (args.like is None) == (args.runtime is None):
        raise ConfigError("--model: give --like DEPLOYMENT (run the replica like it) or --runtime NAME, one of them")
    if args.call_as:
        raise ConfigError("--call-as goes with --deployment (an evaluation replica is called by its name)")
    if not 0 < args.ready_timeout_s <= MAX_DEADLINE_S:
        raise ConfigError(f"--ready-timeout-s: seconds above 0 and at most {MAX_DEADLINE_S:g}")
    return ModelRef(model=name, version=version)


def _runs(args: argparse.Namespace) -> int:
    with common.client(args) as api:
        found = api.get("/api/v1/eval/runs", EvalRunList, params={"suite": args.suite, **common.page_params(args)})
    if args.json:
        print_json(found)
        return EXIT_OK
    rows: list[Cells] = [
        {
            "id": r.id,
            "suite": r.suite,
            "deployment": r.deployment,
            "model": f"{r.model}@{r.version}",
            "passed": "yes" if r.passed else "no",
            "metrics": ", ".join(f"{s.metric} {s.pass_rate:.3f}" for s in r.summaries),
        }
        for r in found.runs
    ]
    print(table(rows, ("id", "suite", "deployment", "model", "passed", "metrics")))
    print_more(found.next_cursor)
    return EXIT_OK


def _show(args: argparse.Namespace) -> int:
    with common.client(args) as api:
        run = api.get(f"/api/v1/eval/runs/{args.run_id}", EvalRun)
    if args.json:
        print_json(run)
        return EXIT_OK
    _print_run(run)
    rows: list[Cells] = [
        {
            "case": c.id,
            "metric": c.metric,
            "score": f"{c.score:.3f}",
            "passed": "yes" if c.passed else "no",
            "error": c.error,
            "ms": f"{c.e2e_ms:.0f}",
            "answer": c.answer[:60].replace("\n", " "),
        }
        for c in run.run.cases
    ]
    print()
    print(table(rows, ("case", "metric", "score", "passed", "error", "ms", "answer")))
    return EXIT_OK


def _compare(args: argparse.Namespace) -> int:
    with common.client(args) as api:
        found = api.get("/api/v1/eval/compare", EvalCompare, params={"a": args.a, "b": args.b})
    if args.json:
        print_json(found)
        return EXIT_OK
    if not found.same_suite:
        print("note: the runs are of different suites (or versions of one): compare with care")
    print(table([_diff_cells(d) for d in found.metrics], _DIFF_COLUMNS))
    for side, names in (("A", found.only_a), ("B", found.only_b)):
        if names:
            print(f"only in {side}: {', '.join(names)}")
    return EXIT_OK


_SUMMARY_COLUMNS: Final = ("metric", "cases", "passed", "pass_rate", "95% CI", "mean", "mean 95% CI", "errors")
_DIFF_COLUMNS: Final = ("metric", "A", "B", "B-A", "95% CI", "mean B-A", "mean 95% CI", "significant")


def _ci(pair: list[float]) -> str:
    return f"[{pair[0]:.3f}, {pair[1]:.3f}]"


def _summary_cells(s: MetricSummary) -> Cells:
    return {
        "metric": s.metric,
        "cases": s.cases,
        "passed": s.passed,
        "pass_rate": f"{s.pass_rate:.3f}",
        "95% CI": _ci(s.pass_rate_ci),
        "mean": f"{s.mean:.3f}",
        "mean 95% CI": _ci(s.mean_ci),
        "errors": s.errors,
    }


def _diff_cells(d: MetricDiff) -> Cells:
    return {
        "metric": d.metric,
        "A": f"{d.a_pass_rate:.3f}",
        "B": f"{d.b_pass_rate:.3f}",
        "B-A": f"{d.pass_rate_diff:+.3f}",
        "95% CI": _ci(d.pass_rate_diff_ci),
        "mean B-A": f"{d.mean_diff:+.3f}",
        "mean 95% CI": _ci(d.mean_diff_ci),
        "significant": "yes" if d.significant else "no",
    }


def _print_run(run: EvalRun) -> None:
    verdict = "passed" if run.passed else "failed"
    print(f"run {run.id}: {run.suite} on {run.deployment} ({run.model}@{run.version}): {verdict}")
    print(f"evaluation {run.evaluation or '- (not recorded: the version is retired)'}, measured")
    print(table([_summary_cells(s) for s in run.summaries], _SUMMARY_COLUMNS))
