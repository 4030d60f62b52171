"""`nexa deployments change` and `nexa deployments rollout status|pause|resume|undo`: a new runtime
or settings rolled out under watch, and an operator's hand on the rollout (operator)."""

from __future__ import annotations

import argparse
import time
from typing import Any, Final

from nexa.cli import common
from nexa.cli.output import print_json, ref
from nexa.cli.tables import DEPLOYMENT
from nexa.contracts import codec
from nexa.contracts.deployments import DeploymentView, RolloutPolicy, RolloutStatus, SuiteRunBy
from nexa.errors import ConfigError

EXIT_OK: Final = 0


def add_commands(deployments: Any, common_flags: argparse.ArgumentParser) -> None:
    """The verbs under `nexa deployments` this module serves."""
    s = deployments.add_parser(
        "change",
        parents=[common_flags],
        help="roll out a new runtime (image) or settings, one replica at a time under watch",
    )
    s.add_argument("name")
    s.add_argument("--runtime", help="another registered runtime (a new image)")
    s.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a runtime setting to change (repeat; VALUE read as JSON, else text); the others stay",
    )
    s.add_argument(
        "--soak-s", type=float, help="seconds each new replica is watched before the next (default: as set, else 30)"
    )
    s.add_argument(
        "--min-requests", type=int, help="fewer requests than this decide nothing (default: as set, else 20)"
    )
    s.add_argument(
        "--adapter-weight",
        type=float,
        help="the share of a moved alias's requests its new adapter version takes while it soaks in place "
        "(vLLM, sim; 0.01 to 1; default: as set, else 0.1)",
    )
    gate = s.add_mutually_exclusive_group()
    gate.add_argument(
        "--suite",
        help="after its soak, each new replica waits for a passing run of this suite against the new "
        "replicas (the controller's own, as --suite-tenant; or --suite-run-by operator); a failing run reverts",
    )
    gate.add_argument("--no-suite", action="store_true", help="remove the rollout policy's suite gate")
    s.add_argument(
        "--suite-min-pass-rate",
        type=float,
        help="with --suite: each metric's least pass rate (0 to 1; default 1)",
    )
    suite_run_flags(s)
    s.set_defaults(handler=_change)
    rollout = deployments.add_parser(
        "rollout", help="the rollout in progress: status, pause, resume, undo"
    ).add_subparsers(metavar="VERB", required=True)
    for verb, text in (
        ("status", "the rollout in progress and its steps"),
        ("pause", "replace no further replica until resumed (watching goes on)"),
        ("resume", "go on with a paused rollout"),
        ("undo", "stop the rollout and return its changed replicas to the last good spec"),
    ):
        s = rollout.add_parser(verb, parents=[common_flags], help=text)
        s.add_argument("name")
        s.set_defaults(handler=_rollout, verb=verb)


def _change(args: argparse.Namespace) -> int:
    from nexa.cli.deployments import _settings  # here: that module imports this one

    if args.suite_min_pass_rate is not None and not args.suite:
        raise ConfigError("--suite-min-pass-rate goes with --suite SUITE")
    check_gate_flags(args)
    body: dict[str, Any] = {}
    if args.runtime:
        body["runtime"] = args.runtime
    with common.client(args) as c:
        dep = c.get(f"/api/v1/deployments/{args.name}", DeploymentView).deployment
        flags = (args.soak_s, args.min_requests, args.adapter_weight)
        if any(f is not None for f in flags) or args.suite or args.no_suite:
            # The policy is sent whole: each field the flags leave out stays as it is.
            policy = dep.rollout_policy or RolloutPolicy()
            body["rollout_policy"] = {
                "soak_s": policy.soak_s if args.soak_s is None else args.soak_s,
                "min_requests": policy.min_requests if args.min_requests is None else args.min_requests,
                "suite": _gate(args, policy),
                "adapter_weight": policy.adapter_weight if args.adapter_weight is None else args.adapter_weight,
            }
        if args.settings:
            options = dep.options
            body["options"] = {
                "port": options.port,
                "command": options.command,
                "env": options.env,
                "health_command": options.health_command,
                "settings": {**options.settings, **_settings(args.settings)},
                "extra_args": options.extra_args,
            }
        if not body:
            raise ConfigError(
                "nothing to change: give --runtime, --set NAME=VALUE, --soak-s, --min-requests, --adapter-weight, "
                "--suite or --no-suite"
            )
        out = c.post(f"/api/v1/deployments/{args.name}/change", DeploymentView, body=body)
    DEPLOYMENT.emit(args, out, [out])
    if not args.json and out.deployment.rollout is not None:
        print(f"rolling out under watch: nexa deployments rollout status {args.name}")
    return EXIT_OK


def suite_run_flags(s: argparse.ArgumentParser) -> None:
    """Who runs a suite gate's run (`nexa deployments change`, `nexa deployments canary`)."""
    s.add_argument(
        "--suite-tenant",
        help="with --suite: the tenant the controller runs the suite as, through the gateway (its quotas "
        "and limits apply, the usage is its own); required unless --suite-run-by operator",
    )
    s.add_argument(
        "--suite-run-by",
        choices=[r.value for r in SuiteRunBy],
        help="with --suite: who runs it: the controller, as soon as it is wanted (default), or an "
        "operator with `nexa eval run SUITE --deployment NAME --rollout|--canary`",
    )


def gate_body(args: argparse.Namespace, rate: float) -> dict[str, Any]:
    """The suite gate `--suite` and its flags ask for (JSON)."""
    body: dict[str, Any] = {"suite": args.suite, "min_pass_rate": rate}
    if args.suite_run_by is not None:
        body["run_by"] = args.suite_run_by
    if args.suite_tenant is not None:
        body["tenant"] = args.suite_tenant
    return body


def check_gate_flags(args: argparse.Namespace) -> None:
    """Refuse --suite-tenant or --suite-run-by without --suite."""
    for flag, value in (("--suite-tenant", args.suite_tenant), ("--suite-run-by", args.suite_run_by)):
        if value is not None and not args.suite:
            raise ConfigError(f"{flag} goes with --suite SUITE")


def _gate(args: argparse.Namespace, policy: RolloutPolicy) -> dict[str, Any] | None:
    """The policy's suite gate as the flags leave it (JSON; `_change` checked them)."""
    if args.no_suite:
        return None
    if args.suite:
        return gate_body(args, 1.0 if args.suite_min_pass_rate is None else args.suite_min_pass_rate)
    kept = policy.suite
    return None if kept is None else codec.api.unstructure(kept)


def _rollout(args: argparse.Namespace) -> int:
    path = f"/api/v1/deployments/{args.name}/rollout"
    with common.client(args) as c:
        verb = args.verb
        out = c.get(path, RolloutStatus) if verb == "status" else c.post(f"{path}/{verb}", RolloutStatus)
    if args.json:
        print_json(out)
        return EXIT_OK
    print_status(out)
    return EXIT_OK


def print_status(status: RolloutStatus) -> None:
    """A rollout's state, its watch and its steps, for people."""
    r = status.rollout
    if r is None:
        held = f"; {ref(status.held_model)} is held (a rollout to it was reverted)" if status.held_model else ""
        print(f"deployment {status.deployment}: no rollout in progress (runtime {status.runtime}){held}")
        return
    state = "paused" if r.paused else "rolling"
    print(
        f"deployment {status.deployment}: {state} ({r.reason}) {ref(r.from_)} -> {ref(r.to)}, "
        f"runtime {status.runtime}: {status.new} new, {status.old} old replica(s) left"
    )
    if r.policy is not None and r.in_place:
        print(
            f"watch    in place: the new adapter versions take {r.policy.adapter_weight:.0%} of their aliases' "
            f"requests and soak {r.policy.soak_s:g} s, passing from {r.policy.min_requests} requests"
        )
    elif r.policy is not None:
        print(f"watch    each new replica soaks {r.policy.soak_s:g} s, from {r.policy.min_requests} requests")
    if status.suite is not None:
        print(f"suite    {status.suite}")
    for soak in r.soaks:
        state = "passed" if soak.passed else "waits for its suite" if soak.suite_wait else "soaking"
        print(f"soak     {soak.replica_id} on {', '.join(soak.node_ids)}: {state}")
    for step in r.steps:
        at = time.strftime("%H:%M:%S", time.gmtime(step.at))
        print(f"{at}Z {step.what:<9} {step.detail}")
