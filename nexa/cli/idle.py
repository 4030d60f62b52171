"""`nexa deployments wake|sleep|idle` and the sleep-when-idle flags of `deployments create` (operator)."""

from __future__ import annotations

import argparse
import time
from typing import Any, Final

from nexa.cli import common
from nexa.cli.tables import DEPLOYMENT
from nexa.contracts.deployments import DeploymentView

EXIT_OK: Final = 0


def add_commands(deployments: Any, common_flags: argparse.ArgumentParser) -> None:
    """`wake`, `sleep` and `idle` under `nexa deployments`."""
    for verb, text in (
        ("wake", "wake a sleeping deployment now (answers at once; `show` says when it is awake)"),
        ("sleep", "put a deployment to sleep now: its containers stop, the artifact stays on the node"),
    ):
        s = deployments.add_parser(verb, parents=[common_flags], help=text)
        s.add_argument("name")
        s.set_defaults(handler=_by_hand, verb=verb)
    s = deployments.add_parser(
        "idle", parents=[common_flags], help="set when a deployment sleeps when idle (replaces its idle settings)"
    )
    s.add_argument("name")
    idle_flags(s)
    s.set_defaults(handler=_set_idle)


def idle_flags(s: argparse.ArgumentParser) -> None:
    """The sleep-when-idle flags of `deployments create` and `deployments idle`."""
    s.add_argument(
        "--idle-after-s",
        type=float,
        metavar="SECONDS",
        help="sleep after this long without requests (needs --min-replicas 0; default: never sleeps)",
    )
    s.add_argument("--min-replicas", type=int, help="0: may sleep when idle (with --idle-after-s)")
    s.add_argument(
        "--evictable",
        action="store_true",
        help="swap on demand may put it to sleep, while idle, to make room for another deployment that wakes",
    )


def idle_body(args: argparse.Namespace) -> dict[str, Any]:
    """The request fields the sleep-when-idle flags give."""
    return {"idle_after_s": args.idle_after_s, "min_replicas": args.min_replicas, "evictable": args.evictable}


def print_sleep(view: DeploymentView) -> None:
    """`deployments show`: awake or asleep, its last request and its last wake, when it sleeps."""
    dep, sleep = view.deployment, view.sleep
    if sleep is None:
        return
    last = "none since the controller started"
    if sleep.last_request_at is not None:
        last = f"{max(0.0, time.time() - sleep.last_request_at):.1f} s ago"
    wake = "-" if sleep.last_wake_s is None else f"{sleep.last_wake_s:.2f} s"
    policy = "never sleeps"
    if dep.idle_after_s is not None:
        policy = f"sleeps after {dep.idle_after_s:g} s idle" + (", evictable" if dep.evictable else "")
    if sleep.sleeps_in_s is not None:
        policy += f" (in {sleep.sleeps_in_s:.1f} s)"
    print(f"sleep    {sleep.state}; last request {last}; time to wake {wake}; {policy}")


def _by_hand(args: argparse.Namespace) -> int:
    with common.client(args) as c:
        out = c.post(f"/api/v1/deployments/{args.name}/{args.verb}", DeploymentView)
    DEPLOYMENT.emit(args, out, [out])
    return EXIT_OK


def _set_idle(args: argparse.Namespace) -> int:
    with common.client(args) as c:
        out = c.post(f"/api/v1/deployments/{args.name}/idle", DeploymentView, body=idle_body(args))
    DEPLOYMENT.emit(args, out, [out])
    return EXIT_OK
