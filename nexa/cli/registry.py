"""`nexa runtimes` and `nexa aliases`: runtime images and versioned aliases (operator)."""

from __future__ import annotations

import argparse
import sys
from typing import Any, Final

from nexa.cli import common, qualify
from nexa.cli.output import emit, print_json, ref
from nexa.cli.tables import ALIASES, RUNTIMES, platforms, print_image_configs
from nexa.contracts.groups import FabricAccess
from nexa.contracts.models import AliasDetail, AliasReceipt, ModelRef, RuntimeRegistered
from nexa.contracts.node import RuntimeKind

EXIT_OK: Final = 0
#: Every kind the controller takes (a hand-kept list once left `whispercpp` out).
RUNTIME_KINDS: Final = tuple(str(k) for k in RuntimeKind)
FABRIC_CHOICES: Final = tuple(str(f) for f in FabricAccess)


def add_runtime_commands(sub: Any, common_flags: argparse.ArgumentParser) -> None:
    runtimes = sub.add_parser("runtimes", help="runtime images (operator)").add_subparsers(
        metavar="VERB", required=True
    )
    s = runtimes.add_parser(
        "register", parents=[common_flags], help="register an image; its registry must hold the digest"
    )
    s.add_argument("name")
    s.add_argument("--kind", required=True, choices=RUNTIME_KINDS)
    s.add_argument("--version", required=True)
    s.add_argument("--image", required=True, help="registry/repository@sha256:<64 hex>")
    s.add_argument(
        "--host-network",
        action="store_true",
        help="run its containers in the node's network namespace (default: a namespace of their own)",
    )
    s.add_argument(
        "--fabric",
        choices=FABRIC_CHOICES,
        default="none",
        help="what a replica group's containers get for the fabric between its nodes: tcp (the node's network "
        "namespace, a larger /dev/shm), rdma (also its RDMA devices, IPC_LOCK, unlimited locked memory); "
        "default none",
    )
    s.set_defaults(handler=_runtimes_register)
    RUNTIMES.add(runtimes, common_flags)
    s = runtimes.add_parser("show", parents=[common_flags], help="the runtime and its newest qualifications")
    s.add_argument("name")
    s.set_defaults(handler=qualify.show_runtime)
    qualify.add_qualify_command(runtimes, common_flags)


def add_alias_commands(sub: Any, common_flags: argparse.ArgumentParser) -> None:
    aliases = sub.add_parser("aliases", help="versioned aliases (operator)").add_subparsers(
        metavar="VERB", required=True
    )
    ALIASES.add(aliases, common_flags)
    s = aliases.add_parser("promote", parents=[common_flags], help="point the alias at an Approved version")
    s.add_argument("alias")
    s.add_argument("--model", required=True)
    s.add_argument("--version", required=True)
    s.add_argument(
        "--adapter",
        type=common.model_version,
        metavar="NAME@VERSION",
        help="an Approved LoRA adapter for that version, served on it under this alias",
    )
    s.set_defaults(handler=_aliases_promote)
    s = aliases.add_parser("rollback", parents=[common_flags], help="undo the latest promotion")
    s.add_argument("alias")
    s.set_defaults(handler=_aliases_rollback)
    s = aliases.add_parser("history", parents=[common_flags], help="the alias and every change, oldest first")
    s.add_argument("alias")
    s.set_defaults(handler=_aliases_history)


def served(model: ModelRef | None, adapter: ModelRef | None) -> str:
    """What an alias serves: `name@version`, with `+adapter@version` when a LoRA adapter is served on it."""
    return ref(model) + (f"+{ref(adapter)}" if adapter is not None else "")


def print_alias_receipt(args: argparse.Namespace, r: AliasReceipt) -> None:
    if args.json:
        print_json(r)
    else:
        moved = f"{served(r.from_, r.from_adapter)} -> {served(r.to, r.adapter)}"
        print(f"alias {r.alias}: generation {r.generation}, {moved} ({r.action}; audit event {r.event_id})")


def _runtimes_register(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"name": args.name, "kind": args.kind, "version": args.version, "image": args.image}
    if args.host_network:
        body["host_network"] = True
    if args.fabric != "none":
        body["fabric"] = args.fabric
    with common.client(args) as c:
        out = c.post("/api/v1/runtimes", RuntimeRegistered, body=body)
    if args.json:
        print_json(out)
    else:
        print(f"runtime {out.name} registered: {out.kind} {out.version}, {out.image} ({out.media_type})")
        if out.fabric is not FabricAccess.NONE:
            print(f"fabric: {out.fabric} (a replica group's containers get it; see `nexa runtimes show`)")
        print(f"platforms: {platforms(out)}")
        print_image_configs(out)
        for warning in out.warnings:
            print(f"warning: {warning}", file=sys.stderr)
    return EXIT_OK


def _aliases_promote(args: argparse.Namespace) -> int:
    with common.client(args) as c:
        body = {"model": args.model, "version": args.version, "adapter": args.adapter}
        out = c.post(f"/api/v1/aliases/{args.alias}/promote", AliasReceipt, body=body)
    print_alias_receipt(args, out)
    return EXIT_OK


def _aliases_rollback(args: argparse.Namespace) -> int:
    with common.client(args) as c:
        out = c.post(f"/api/v1/aliases/{args.alias}/rollback", AliasReceipt)
    print_alias_receipt(args, out)
    return EXIT_OK


def _aliases_history(args: argparse.Namespace) -> int:
    with common.client(args) as c:
        out = c.get(f"/api/v1/aliases/{args.alias}", AliasDetail)
    rows = [
        {
            "generation": r.generation,
            "action": r.action,
            "from": ref(r.from_),
            "to": ref(r.to),
            "at": r.at,
            "actor": r.actor,
            "event": r.event_id,
        }
        for r in out.history
    ]
    if not args.json:
        print(f"alias {out.alias.name} -> {ref(out.alias.target)} (generation {out.alias.generation})")
    emit(args, out, rows, ("generation", "action", "from", "to", "at", "actor", "event"))
    return EXIT_OK
