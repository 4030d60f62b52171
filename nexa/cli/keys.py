"""`nexa keys`, `nexa tenants` and `nexa tokens`: API keys, tenants and node enrollment tokens (admin)."""

from __future__ import annotations

import argparse
import time
from typing import Any, Final

from nexa.cli import common
from nexa.cli.output import print_json
from nexa.cli.tables import KEY_REVOKED, KEYS, TENANT, TENANTS
from nexa.contracts.api import EnrollmentTokenCreated, KeyCreated, KeyView, TenantView

EXIT_OK: Final = 0
ROLES: Final = ("admin", "operator", "inference", "audit", "monitoring")


def add_commands(sub: Any, common_flags: argparse.ArgumentParser) -> None:
    keys = sub.add_parser("keys", help="API keys (admin)").add_subparsers(metavar="VERB", required=True)
    s = keys.add_parser("create", parents=[common_flags], help="create a key; its secret is printed once")
    s.add_argument("--role", required=True, choices=ROLES)
    s.add_argument("--tenant", help="required for role inference")
    s.add_argument("--name", default="")
    s.set_defaults(handler=_keys_create)
    KEYS.add(keys, common_flags)
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


def _keys_create(args: argparse.Namespace) -> int:
    body = {"role": args.role, "name": args.name, "tenant": args.tenant}
    with common.client(args) as c:
        out = c.post("/api/v1/keys", KeyCreated, body=body)
    if args.json:
        print_json(out)
    else:
        info = out.info
        print(f"created key {info.id} (role {info.role}{', tenant ' + info.tenant if info.tenant else ''})")
        print("secret (shown only this once):")
        print(out.key)
    return EXIT_OK


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
