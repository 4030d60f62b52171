"""`nexa keys`, `nexa tenants` and `nexa tokens`: API keys, tenants and node enrollment tokens (admin)."""

from __future__ import annotations

import argparse
import time
from typing import Any, Final

from nexa.cli import common
from nexa.cli.output import print_json
from nexa.cli.tables import KEY_DETAIL, KEY_REVOKED, KEYS, TENANT, TENANTS, Show
from nexa.contracts.api import (
    ControllerKeysRotated,
    EnrollmentTokenCreated,
    KeyCreated,
    KeyRotated,
    KeyView,
    TenantView,
)
from nexa.contracts.domain import Priority

EXIT_OK: Final = 0
ROLES: Final = ("admin", "operator", "inference", "audit", "monitoring", "retention-reader")


def add_commands(sub: Any, common_flags: argparse.ArgumentParser) -> None:
    keys = sub.add_parser("keys", help="API keys (admin)").add_subparsers(metavar="VERB", required=True)
    s = keys.add_parser("create", parents=[common_flags], help="create a key; its secret is printed once")
    s.add_argument("--role", required=True, choices=ROLES)
    s.add_argument("--tenant", help="required for role inference")
    s.add_argument("--name", default="")
    s.add_argument("--expires", type=common.duration, help="lifetime, e.g. 90d, 12h (default: never expires)")
    s.add_argument(
        "--priorities",
        type=_priorities,
        help="priority classes an inference key may ask for, e.g. interactive,standard,batch (default: standard,batch)",
    )
    s.set_defaults(handler=_keys_create)
    KEYS.add(keys, common_flags)
    s = keys.add_parser("show", parents=[common_flags])
    s.add_argument("key_id")
    s.set_defaults(handler=Show(path="/api/v1/keys/{key_id}", answer=KeyView, view=KEY_DETAIL).run)
    s = keys.add_parser("rotate", parents=[common_flags], help="issue a successor key; the old one works for --grace")
    s.add_argument("key_id")
    s.add_argument("--grace", default="1d", type=common.duration, help="how long the old key still works (default 1d)")
    s.add_argument("--expires", type=common.duration, help="the successor's lifetime (default: the old key's)")
    s.set_defaults(handler=_keys_rotate)
    s = keys.add_parser(
        "rotate-controller",
        parents=[common_flags],
        help="new controller signing and Curve keys, announced to every node; the old key is kept for receipts",
    )
    s.set_defaults(handler=_keys_rotate_controller)
    s = keys.add_parser("revoke", parents=[common_flags])
    s.add_argument("key_id")
    s.set_defaults(handler=_keys_revoke)

    tenants = sub.add_parser("tenants", help="tenants (admin)").add_subparsers(metavar="VERB", required=True)
    s = tenants.add_parser("create", parents=[common_flags])
    s.add_argument("tenant_id")
    s.add_argument("--display-name", default="")
    s.set_defaults(handler=_tenants_create)
    TENANTS.add(tenants, common_flags)

    tokens = sub.add_parser("tokens", help="one-time node enrollment tokens (admin)").add_subparsers(
        metavar="VERB", required=True
    )
    s = tokens.add_parser("create", parents=[common_flags], help="create a token; it is printed once")
    s.add_argument("--ttl", default="15m", type=common.duration, help="lifetime, e.g. 900, 90s, 15m, 2h (default 15m)")
    s.add_argument("--labels", default="", help="labels the node gets: k=v,k2=v2")
    s.set_defaults(handler=_tokens_create)


def _priorities(text: str) -> list[str]:
    names = [p.strip() for p in text.split(",") if p.strip()]
    known = [p.value for p in Priority]
    if not names or any(n not in known for n in names):
        raise argparse.ArgumentTypeError(f"a comma-separated list of {', '.join(known)}")
    return names


def _keys_create(args: argparse.Namespace) -> int:
    body: dict[str, object] = {
        "role": args.role,
        "name": args.name,
        "tenant": args.tenant,
        "expires_in_s": args.expires,
    }
    if args.priorities is not None:
        body["priorities"] = args.priorities
    with common.client(args) as c:
        out = c.post("/api/v1/keys", KeyCreated, body=body)
    if args.json:
        print_json(out)
    else:
        info = out.info
        print(f"created key {info.id} (role {info.role}{', tenant ' + info.tenant if info.tenant else ''})")
        print(f"expires: {_when(info.expires_at)}")
        if info.role == "inference":
            print(f"priorities: {', '.join(info.priorities)}")
        print("secret (shown only this once):")
        print(out.key)
    return EXIT_OK


def _keys_rotate(args: argparse.Namespace) -> int:
    body = {"grace_s": args.grace, "expires_in_s": args.expires}
    with common.client(args) as c:
        out = c.post(f"/api/v1/keys/{args.key_id}/rotate", KeyRotated, body=body)
    if args.json:
        print_json(out)
    else:
        print(f"rotated key {out.previous.id}: it keeps working until {_when(out.previous.expires_at)}")
        print(f"successor {out.info.id} (role {out.info.role}), expires: {_when(out.info.expires_at)}")
        print("secret (shown only this once):")
        print(out.key)
    return EXIT_OK


def _keys_rotate_controller(args: argparse.Namespace) -> int:
    with common.client(args) as c:
        out = c.post("/api/v1/controller/rotate-keys", ControllerKeysRotated)
    if args.json:
        print_json(out)
    else:
        print(f"controller keys rotated: key {out.key_id} signs from now on (was {out.previous_key_id})")
        print(f"announced to {out.announced_to} connected nodes; the others are told when they reconnect")
        print(f"nodes accept the previous key until {_when(out.overlap_until)} ([nodes] key_overlap_s);")
        print("a node offline until then must be enrolled again. Receipts signed before still verify.")
        print(f"new controller fingerprint (what new enrollment tokens carry): {out.controller_fingerprint}")
    return EXIT_OK


def _when(at: float | None) -> str:
    return "never" if at is None else time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(at))


def _keys_revoke(args: argparse.Namespace) -> int:
    with common.client(args) as c:
        out = c.delete(f"/api/v1/keys/{args.key_id}", KeyView)
    KEY_REVOKED.emit(args, out, [out])
    return EXIT_OK


def _tenants_create(args: argparse.Namespace) -> int:
    with common.client(args) as c:
        out = c.post("/api/v1/tenants", TenantView, body={"id": args.tenant_id, "display_name": args.display_name})
    TENANT.emit(args, out, [out])
    return EXIT_OK


def _tokens_create(args: argparse.Namespace) -> int:
    body = {"ttl_s": args.ttl, "labels": common.labels(args.labels)}
    with common.client(args) as c:
        out = c.post("/api/v1/enrollment-tokens", EnrollmentTokenCreated, body=body)
    if args.json:
        print_json(out)
    else:
        expires = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(out.expires_at))
        print(f"enrollment token {out.id} (single use, expires {expires}); shown only this once:")
        print(out.token)
        if out.controller_fingerprint:
            # Also inside the token (after the `.`): the node refuses a controller with other keys.
            print(f"controller fingerprint: {out.controller_fingerprint}")
        print(f"on the node: nexa node enroll --controller {args.url} --token {out.token}")
    return EXIT_OK
