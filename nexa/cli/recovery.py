"""`nexa recovery plan | finish`: a recovering controller's plan, and ending its recovery (admin)."""

from __future__ import annotations

import argparse
from typing import Any, Final

from nexa.cli import common
from nexa.cli.output import emit, print_json, table
from nexa.contracts.recovery import RecoveryFinished, RecoveryPlan

EXIT_OK: Final = 0


def add_commands(sub: Any, common_flags: argparse.ArgumentParser) -> None:
    recovery = sub.add_parser(
        "recovery", help="a controller started from a restored or older state (operator, admin)"
    ).add_subparsers(metavar="VERB", required=True)
    s = recovery.add_parser(
        "plan", parents=[common_flags], help="what ending recovery would change: re-pushed sets, stops, re-placements"
    )
    s.set_defaults(handler=_plan)
    s = recovery.add_parser(
        "finish", parents=[common_flags], help="end recovery now: a new epoch above every node's, then push (admin)"
    )
    s.set_defaults(handler=_finish)


def _plan(args: argparse.Namespace) -> int:
    with common.client(args) as c:
        plan = c.get("/api/v1/recovery/plan", RecoveryPlan)
    if args.json:
        print_json(plan)
        return EXIT_OK
    if not plan.recovering:
        print(f"not recovering (epoch {plan.epoch}): nothing would change")
        return EXIT_OK
    print(f"recovering: {plan.reason}")
    print(f"epoch {plan.epoch} now; sets will be signed at epoch {plan.next_epoch}\n")
    print("re-pushed sets:")
    pushes = [
        {
            "node": p.node_id,
            "accepted": f"{p.accepted_epoch}/{p.accepted_generation}",
            "will_sign": f"{p.epoch}/{p.generation}",
            "starts": ", ".join(p.start) or "-",
        }
        for p in plan.pushes
    ]
    print(table(pushes, ["node", "accepted", "will_sign", "starts"]))
    print("\nreplicas it would stop (not in the restored state):")
    stops = [
        {"node": s.node_id, "replica": s.assignment_id, "deployment": s.deployment, "state": s.state}
        for s in plan.stops
    ]
    print(table(stops, ["node", "replica", "deployment", "state"]))
    print("\nre-placements (if their node stays away):")
    moves = [{"deployment": r.deployment, "replica": r.replica_id, "node": r.node_id} for r in plan.replacements]
    print(table(moves, ["deployment", "replica", "node"]))
    print(f"\nnot heard from: {', '.join(plan.unheard) or 'none'}")
    return EXIT_OK


def _finish(args: argparse.Namespace) -> int:
    with common.client(args) as c:
        done = c.post("/api/v1/recovery/finish", RecoveryFinished)
    rows = [{"node": n, "set": "pushed now"} for n in done.pushed]
    rows += [{"node": n, "set": "at its next hello"} for n in done.unheard]
    if not args.json:
        print(f"recovery finished: epoch {done.epoch}")
    emit(args, done, rows, ["node", "set"])
    return EXIT_OK
