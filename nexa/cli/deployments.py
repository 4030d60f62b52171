"""`nexa deployments` and `nexa capacity`: desired state, placement, canaries and rollouts (operator)."""

from __future__ import annotations

import argparse
import json
from typing import Any, Final

from nexa.cli import common, idle, rollouts
from nexa.cli.output import print_json, ref, size_text, table
from nexa.cli.registry import print_alias_receipt
from nexa.cli.tables import DEPLOYMENT, DEPLOYMENTS, Show
from nexa.contracts.deployments import DeploymentView, PlacementView, ReplicaScore, RolloutResult
from nexa.contracts.placement import PlacementDecision
from nexa.errors import ConfigError

EXIT_OK: Final = 0


def add_commands(sub: Any, common_flags: argparse.ArgumentParser) -> None:
    deployments = sub.add_parser("deployments", help="desired state and placement (operator)").add_subparsers(
        metavar="VERB", required=True
    )
    s = deployments.add_parser("create", parents=[common_flags], help="place and start a deployment")
    _deployment_flags(s)
    s.set_defaults(handler=_deployments_create)
    DEPLOYMENTS.add(deployments, common_flags)
    for verb, handler in (("show", _SHOW.run), ("placement", _deployments_placement)):
        s = deployments.add_parser(verb, parents=[common_flags])
        s.add_argument("name")
        s.set_defaults(handler=handler)
    s = deployments.add_parser("scale", parents=[common_flags])
    s.add_argument("name")
    s.add_argument("replicas", type=int)
    s.set_defaults(handler=_deployments_scale)
    s = deployments.add_parser(
        "update", parents=[common_flags], help="change a deployment's routing weights or service objectives"
    )
    s.add_argument("name")
    _routing_flags(s, default=None)
    _objective_flags(s)
    s.set_defaults(handler=_deployments_update)
    s = deployments.add_parser("delete", parents=[common_flags], help="stop every replica and forget the deployment")
    s.add_argument("name")
    s.set_defaults(handler=_deployments_delete)
    s = deployments.add_parser("canary", parents=[common_flags], help="run another version beside it on extra replicas")
    s.add_argument("name")
    s.add_argument("--model", required=True)
    s.add_argument("--version", required=True)
    s.add_argument("--replicas", type=int, default=1)
    s.add_argument("--weight", type=float, required=True, help="share of requests for the canary (0..1, exclusive)")
    s.add_argument("--max-error-rate", type=float, default=0.05, help="roll back above this error rate")
    s.add_argument("--max-p95-ms", type=float, help="roll back above this p95 latency (default: not checked)")
    s.add_argument("--window-s", type=float, default=60.0, help="the window the figures cover")
    s.add_argument("--min-requests", type=int, default=20, help="fewer requests in the window decide nothing")
    s.add_argument(
        "--suite",
        help="promote only once this suite passed against the canary (the controller's own run once it is "
        "Ready, as --suite-tenant; or --suite-run-by operator: `nexa eval run --canary`)",
    )
    s.add_argument("--suite-min-pass-rate", type=float, default=1.0, help="with --suite: each metric's least (1)")
    rollouts.suite_run_flags(s)
    s.set_defaults(handler=_deployments_canary)
    for verb, text in (
        ("promote", "make the canary's version the deployment's (its alias moves too)"),
        ("rollback", "remove the canary, or return to the version before the last promotion"),
    ):
        s = deployments.add_parser(verb, parents=[common_flags], help=text)
        s.add_argument("name")
        s.set_defaults(handler=_deployment_rollout, verb=verb)
    rollouts.add_commands(deployments, common_flags)
    idle.add_commands(deployments, common_flags)
    capacity = sub.add_parser("capacity", help="what would fit (operator)").add_subparsers(
        metavar="VERB", required=True
    )
    s = capacity.add_parser("forecast", parents=[common_flags], help="would this deployment fit, and where")
    _deployment_flags(s)
    s.set_defaults(handler=_capacity_forecast)


def _deployment_flags(s: argparse.ArgumentParser) -> None:
    s.add_argument("name")
    s.add_argument("--runtime", required=True, help="a registered runtime")
    target = s.add_mutually_exclusive_group(required=True)
    target.add_argument("--alias", help="deploy what this alias points at")
    target.add_argument("--model", metavar="NAME:VERSION", help="deploy a pinned, Approved model version")
    s.add_argument("--replicas", type=int, default=1)
    s.add_argument(
        "--nodes-per-replica",
        type=int,
        default=1,
        metavar="N",
        help="nodes each replica spans (1..16): above 1, a group of N ranks on nodes sharing a fabric",
    )
    s.add_argument("--accelerators", type=int, default=0, help="GPUs per replica (per rank, on its node, for a group)")
    s.add_argument("--memory-bytes", type=int, help="memory per replica (default: the model's)")
    s.add_argument("--cpus", type=float, default=1.0)
    s.add_argument("--policy", choices=("spread", "binpack"), default="spread")
    s.add_argument("--selector", default="", help="node labels: k=v,k2=v2")
    s.add_argument("--data-classes", default="", help="comma-separated")
    s.add_argument("--port", type=int, default=18000, help="first loopback port for the runtime")
    s.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="NAME=VALUE",
        help="a runtime setting (repeat; VALUE read as JSON: 8192, true, 0.5, else text), e.g. tool_call_parser=hermes",
    )
    s.add_argument(
        "--extra-arg",
        dest="extra_args",
        action="append",
        default=[],
        metavar="ARG",
        help="one more argument for the runtime, after the adapter's (repeat; write a flag as --extra-arg=--flag)",
    )
    _routing_flags(s, default=1.0)
    _objective_flags(s)
    idle.idle_flags(s)


#: `--slo-*` flag → the `ServiceObjectives` field it sets.
_SLO_FLAGS: Final = {
    "slo_ttft_p95_ms": "ttft_p95_ms",
    "slo_tpot_p95_ms": "tpot_p95_ms",
    "slo_e2e_p95_ms": "e2e_p95_ms",
    "slo_max_error_rate": "max_error_rate",
}


#: What an `--slo-*-ms` flag takes to stop checking that figure.
_OFF: Final = "off"


def _ms_or_off(text: str) -> float | str:
    if text == _OFF:
        return _OFF
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: milliseconds (a number), or {_OFF} to stop checking it") from None


def _objective_flags(s: argparse.ArgumentParser) -> None:
    """The service objectives `nexa bench` runs are judged against (default: unchanged, or unchecked)."""
    for flag, what in (
        ("--slo-ttft-p95-ms", "time to first token, p95 (ms)"),
        ("--slo-tpot-p95-ms", "time per output token, p95 (ms)"),
        ("--slo-e2e-p95-ms", "end-to-end latency, p95 (ms)"),
    ):
        s.add_argument(flag, type=_ms_or_off, help=f"objective: {what} at most this; `{_OFF}`: not checked")
    s.add_argument("--slo-max-error-rate", type=float, help="objective: failed share of requests at most this (0..1)")


def _objectives_given(args: argparse.Namespace) -> dict[str, float | None]:
    """The objectives the flags set (None: `off`, no longer checked); flags left out are not in it."""
    return {
        field: None if v == _OFF else v for flag, field in _SLO_FLAGS.items() if (v := getattr(args, flag)) is not None
    }


def _routing_flags(s: argparse.ArgumentParser, *, default: float | None) -> None:
    keep = " (default: unchanged)" if default is None else f" (default {default:g})"
    s.add_argument(
        "--routing-queue", type=float, default=default, help="weight of queued + in-flight requests, 0..100" + keep
    )
    s.add_argument("--routing-kv-cache", type=float, default=default, help="weight of KV-cache pressure, 0..100" + keep)
    s.add_argument("--routing-prefix", type=float, default=default, help="weight of prefix affinity, 0..100" + keep)


def _settings(given: list[str]) -> dict[str, object]:
    """`--set NAME=VALUE` flags as settings: a VALUE that reads as a JSON scalar is that (8192,
    0.5, true), anything else is text (`hermes`)."""
    out: dict[str, object] = {}
    for item in given:
        name, sep, text = item.partition("=")
        if not sep or not name:
            raise ConfigError(f"--set takes NAME=VALUE, not {item!r}")
        try:
            value = json.loads(text)
        except ValueError:
            value = text
        out[name] = value if isinstance(value, bool | int | float | str) else text
    return out


def _deployment_body(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": args.name,
        "runtime": args.runtime,
        "replicas": args.replicas,
        "resources": {"accelerators": args.accelerators, "memory_bytes": args.memory_bytes, "cpus": args.cpus},
        "options": {"port": args.port, "settings": _settings(args.settings), "extra_args": list(args.extra_args)},
        "placement": {
            "policy": args.policy,
            "node_selector": common.labels(args.selector),
            "data_classes": [c for c in args.data_classes.split(",") if c],
        },
        "routing": {"queue": args.routing_queue, "kv_cache": args.routing_kv_cache, "prefix": args.routing_prefix},
        "objectives": _objectives_given(args),
        "nodes_per_replica": args.nodes_per_replica,
        **idle.idle_body(args),
    }
    if args.alias:
        body["alias"] = args.alias
    else:
        name, sep, version = args.model.partition(":")
        if not sep:
            raise ConfigError("--model takes NAME:VERSION")
        body["model"] = {"model": name, "version": version}
    return body


def print_rollout(view: DeploymentView) -> None:
    """The canary and the rollout of a deployment, when it has them."""
    dep = view.deployment
    if (canary := dep.canary) is not None:
        o = canary.objective
        p95 = "-" if o.max_p95_ms is None else f"{o.max_p95_ms:g} ms"
        print(
            f"canary   {ref(canary.model)}: {view.canary_ready}/{canary.replicas} Ready, "
            f"weight {canary.weight:g}; objective: error rate <= {o.max_error_rate:g}, p95 <= {p95}, "
            f"over {o.window_s:g} s, from {o.min_requests} requests"
        )
        if (gate := canary.suite) is not None:
            who = f"the controller runs it as tenant {gate.tenant}" if gate.by_controller else "an operator runs it"
            print(
                f"suite    {gate.suite} (every pass rate >= {gate.min_pass_rate:g}) before promotion: {who} "
                f"(`nexa eval run {gate.suite} --deployment {dep.name} --canary` counts too; the newest decides)"
            )
    if (rollout := dep.rollout) is not None and rollout.in_place:
        moved = ", ".join(
            f"{alias} ({ref(was)} -> {ref(dep.loras[alias])})" for alias, was in sorted(dep.moved_loras().items())
        )
        weight = rollout.policy.adapter_weight if rollout.policy is not None else 0.0
        print(
            f"rollout  adapters {moved} in place: the new versions take {weight:.0%} of their requests while they soak"
        )
    elif rollout is not None:
        print(
            f"rollout  {ref(rollout.from_)} -> {ref(rollout.to)} ({rollout.reason}): "
            f"{view.rollout_new} new, {view.rollout_old} old replica(s) left"
        )
    if dep.loras:
        print("adapters " + ", ".join(f"{alias} ({ref(a)})" for alias, a in sorted(dep.loras.items())))
    if dep.held_loras:
        held = ", ".join(f"{alias} ({ref(a)})" for alias, a in sorted(dep.held_loras.items()))
        print(f"held     adapters {held}: reverted, not rolled out again while the aliases serve them")


def print_groups(view: DeploymentView) -> None:
    """Each group replica of a deployment: its state, then its members by rank (rank 0 the head)."""
    dep = view.deployment
    states = {g.replica_id: g for g in view.groups}
    for replica in dep.placed + (dep.canary.placed if dep.canary else []):
        if not replica.members:
            continue
        status = states.get(replica.id)
        state = "-" if status is None else f"{status.state}: {status.detail}" if status.detail else status.state
        canary = " (canary)" if status is not None and status.canary else ""
        print(f"group    {replica.id}{canary}, {len(replica.members)} nodes: {state}")
        reported = {m.rank: m.state for m in status.members} if status is not None else {}
        for m in replica.members:
            head = " (head)" if m.rank == 0 else ""
            runs = f", {reported[m.rank]}" if reported.get(m.rank) else ""
            print(f"  rank {m.rank}{head}: {m.node_id}, GPUs {', '.join(m.gpus) or '-'}{runs}")


def _print_show(view: DeploymentView) -> None:
    """`deployments show`: the rollout, the groups, the routing weights and each replica's score terms now."""
    print_rollout(view)
    print_groups(view)
    idle.print_sleep(view)
    w = view.deployment.routing
    print(f"routing  weights: queue {w.queue:g}, kv_cache {w.kv_cache:g}, prefix {w.prefix:g} (lower score wins)")
    o = view.deployment.objectives

    def ms(value: float | None) -> str:
        return "-" if value is None else f"{value:g} ms"

    print(
        f"slo      ttft p95 {ms(o.ttft_p95_ms)}, tpot p95 {ms(o.tpot_p95_ms)}, e2e p95 {ms(o.e2e_p95_ms)}, "
        f"max error rate {o.max_error_rate:g}"
    )
    if (m := view.memory) is not None:
        measured = "not measured yet" if m.measured_bytes is None else f"measured {size_text(m.measured_bytes)}"
        print(
            f"memory   declared {size_text(m.declared_bytes)} + engine overhead {size_text(m.overhead_bytes)}, "
            f"{measured}; placement reserves {size_text(m.reserved_bytes)} per replica"
        )
        for r in m.replicas:
            print(f"  {r.replica_id} on {r.node_id}: measured {size_text(r.measured_bytes)}")
    if view.replica_scores:
        print(table([_score_row(s) for s in view.replica_scores], _SCORE_COLUMNS))


_SCORE_COLUMNS: Final = ("replica", "node", "queue", "in_flight", "kv", "affinity", "score", "report")


def _score_row(s: ReplicaScore) -> dict[str, Any]:
    def figure(value: float | None) -> str:
        return "-" if value is None else f"{value:g}"

    if s.report == "failing":
        report = f"metrics failing: {s.metrics_error}"
    elif s.report_age_s is None:
        report = s.report
    else:
        report = f"{s.report} ({s.report_age_s:.1f} s)"
    return {
        "replica": s.replica_id + (" (canary)" if s.canary else ""),
        "node": s.node_id,
        "queue": figure(s.queue_reported),
        "in_flight": s.in_flight,
        "kv": figure(s.kv_cache_ratio),
        "affinity": f"-{s.affinity_bonus:g}",
        "score": f"{s.score:.2f}",
        "report": report,
    }


_SHOW: Final = Show(path="/api/v1/deployments/{name}", answer=DeploymentView, view=DEPLOYMENT, after=_print_show)


def _deployments_create(args: argparse.Namespace) -> int:
    with common.client(args) as c:
        out = c.post("/api/v1/deployments", DeploymentView, body=_deployment_body(args))
    DEPLOYMENT.emit(args, out, [out])
    return EXIT_OK


def _deployments_canary(args: argparse.Namespace) -> int:
    body = {
        "model": {"model": args.model, "version": args.version},
        "replicas": args.replicas,
        "weight": args.weight,
        "objective": {
            "max_error_rate": args.max_error_rate,
            "max_p95_ms": args.max_p95_ms,
            "window_s": args.window_s,
            "min_requests": args.min_requests,
        },
    }
    rollouts.check_gate_flags(args)
    if args.suite:
        body["suite"] = rollouts.gate_body(args, args.suite_min_pass_rate)
    with common.client(args) as c:
        out = c.post(f"/api/v1/deployments/{args.name}/canary", DeploymentView, body=body)
    DEPLOYMENT.emit(args, out, [out])
    if not args.json:
        print_rollout(out)
    return EXIT_OK


def _deployment_rollout(args: argparse.Namespace) -> int:
    with common.client(args) as c:
        out = c.post(f"/api/v1/deployments/{args.name}/{args.verb}", RolloutResult)
    if args.json:
        print_json(out)
        return EXIT_OK
    print(table(DEPLOYMENT.rows([out.deployment]), DEPLOYMENT.columns))
    print_rollout(out.deployment)
    if out.alias is not None:
        print_alias_receipt(args, out.alias)
    return EXIT_OK


def _deployments_scale(args: argparse.Namespace) -> int:
    with common.client(args) as c:
        out = c.post(f"/api/v1/deployments/{args.name}/scale", DeploymentView, body={"replicas": args.replicas})
    DEPLOYMENT.emit(args, out, [out])
    return EXIT_OK


def _deployments_update(args: argparse.Namespace) -> int:
    given = {"queue": args.routing_queue, "kv_cache": args.routing_kv_cache, "prefix": args.routing_prefix}
    objectives = _objectives_given(args)
    if all(v is None for v in given.values()) and not objectives:
        raise ConfigError(
            "nothing to update: give --routing-queue, --routing-kv-cache, --routing-prefix or an --slo-* flag"
        )
    with common.client(args) as c:
        current = c.get(f"/api/v1/deployments/{args.name}", DeploymentView).deployment
        out = None
        if any(v is not None for v in given.values()):
            r = current.routing
            body = {"queue": r.queue, "kv_cache": r.kv_cache, "prefix": r.prefix}
            body.update({k: v for k, v in given.items() if v is not None})
            out = c.post(f"/api/v1/deployments/{args.name}/routing", DeploymentView, body=body)
        if objectives:
            o = current.objectives
            slo: dict[str, float | None] = {
                "ttft_p95_ms": o.ttft_p95_ms,
                "tpot_p95_ms": o.tpot_p95_ms,
                "e2e_p95_ms": o.e2e_p95_ms,
                "max_error_rate": o.max_error_rate,
            }
            out = c.post(f"/api/v1/deployments/{args.name}/objectives", DeploymentView, body={**slo, **objectives})
    assert out is not None
    DEPLOYMENT.emit(args, out, [out])
    return EXIT_OK


def _deployments_delete(args: argparse.Namespace) -> int:
    with common.client(args) as c:
        out = c.delete(f"/api/v1/deployments/{args.name}", DeploymentView)
    DEPLOYMENT.emit(args, out, [out])
    return EXIT_OK


def _print_decision(decision: PlacementDecision | None) -> None:
    if decision is None:
        print("no placement decision yet")
        return
    verdict = "fits" if decision.feasible else f"does not fit: {decision.reason}"
    print(f"{decision.request.deployment}: {verdict}")
    host_network = decision.request.host_network
    print("network: " + ("host (the runtime's opt-in)" if host_network else "private namespace per replica"))
    for why in decision.swaps:
        print(f"swap: {why}")
    rows = []
    for e in decision.explanations:
        failed = [f"{f.name} ({f.detail})" for f in e.filters if not f.passed]
        terms = " ".join(f"{t.name}={t.value:.2f}x{t.weight:g}" for t in e.terms)
        if (memory := e.runtime_memory) and e.eligible:
            how = "derived from the reservation" if memory.derived else "as set"
            batch = f" {memory.batch_flag} {memory.batch}" if memory.batch is not None else ""
            kv = f", a {size_text(memory.kv_cache_bytes)} KV cache" if memory.kv_cache_bytes is not None else ""
            terms += (
                f"; {memory.unbounded}" if memory.unbounded else f"; {memory.flag} {memory.value}{batch} ({how}{kv})"
            )
        rows.append(
            {
                "node": e.node_id,
                "eligible": "yes" if e.eligible else "no",
                "score": f"{e.score:.2f}" if e.eligible else "-",
                "replicas": e.replicas_placed,
                "why": "; ".join(failed) or terms or "-",
            }
        )
    print(table(rows, ("node", "eligible", "score", "replicas", "why")))
    for f in decision.fabrics:
        print(f.detail if f.fabric is not None else f"no fabric: {', '.join(f.nodes)}: never grouped")


def _deployments_placement(args: argparse.Namespace) -> int:
    with common.client(args) as c:
        out = c.get(f"/api/v1/deployments/{args.name}/placement", PlacementView)
    if args.json:
        print_json(out)
    else:
        _print_decision(out.decision)
        if out.process:
            print("runs: " + " ".join(out.process))
    return EXIT_OK


def _capacity_forecast(args: argparse.Namespace) -> int:
    with common.client(args) as c:
        out = c.post("/api/v1/capacity/forecast", PlacementDecision, body=_deployment_body(args))
    if args.json:
        print_json(out)
    else:
        _print_decision(out)
    return EXIT_OK
