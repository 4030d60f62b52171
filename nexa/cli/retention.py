"""`nexa retention`: payload retention policies (admin), retained records (`retention-reader`
reads them, decrypted by the controller; every read is audited) and purges (admin)."""

from __future__ import annotations

import argparse
from typing import Any, Final

from nexa.cli import common
from nexa.cli.output import print_json
from nexa.cli.tables import Listing, Show, View
from nexa.contracts.retention import (
    RetainedList,
    RetainedPayload,
    RetainedRecord,
    RetentionPolicy,
    RetentionPolicyList,
    RetentionPurged,
)

EXIT_OK: Final = 0

POLICY: Final = View[RetentionPolicy](
    columns=("name", "ttl_s", "tenants", "updated_by"),
    row=lambda p: {"name": p.name, "ttl_s": p.ttl_s, "tenants": ",".join(p.tenants), "updated_by": p.updated_by},
)
POLICIES: Final = Listing(
    path="/api/v1/retention/policies", page=RetentionPolicyList, items=lambda p: p.policies, view=POLICY
)
POLICY_SHOW: Final = Show(path="/api/v1/retention/policies/{name}", answer=RetentionPolicy, view=POLICY)
RECORD: Final = View[RetainedRecord](
    columns=("id", "request_id", "tenant", "policy", "api", "stored_at", "expires_at", "request_bytes", "answer_bytes"),
    row=lambda r: {
        "id": r.id,
        "request_id": r.request_id,
        "tenant": r.tenant,
        "policy": r.policy,
        "api": r.api,
        "stored_at": r.stored_at,
        "expires_at": r.expires_at,
        "request_bytes": r.request_bytes,
        "answer_bytes": r.answer_bytes,
    },
)
RECORDS: Final = Listing(
    path="/api/v1/retention/records",
    page=RetainedList,
    items=lambda p: p.records,
    view=RECORD,
    query=("request_id", "tenant", "policy"),
    next_cursor=lambda p: p.next_cursor,
)


def add_commands(sub: Any, common_flags: argparse.ArgumentParser) -> None:
    verbs = sub.add_parser(
        "retention", help="payload retention: policies (admin), retained records (retention-reader), purges (admin)"
    ).add_subparsers(metavar="VERB", required=True)
    s = verbs.add_parser("policies", parents=[common_flags], help="list the retention policies (admin)")
    s.set_defaults(handler=POLICIES.run)
    s = verbs.add_parser("policy", parents=[common_flags], help="show one retention policy (admin)")
    s.add_argument("name")
    s.set_defaults(handler=POLICY_SHOW.run)
    s = verbs.add_parser(
        "set-policy", parents=[common_flags], help="create or replace a policy: how long, and which tenants may use it"
    )
    s.add_argument("name")
    s.add_argument("--ttl", type=float, required=True, metavar="SECONDS", help="how long payloads are kept")
    s.add_argument(
        "--tenant", action="append", required=True, dest="tenants", help="a tenant that may use it (repeatable)"
    )
    s.set_defaults(handler=_set_policy)
    s = verbs.add_parser("delete-policy", parents=[common_flags], help="delete a policy (kept payloads stay to TTL)")
    s.add_argument("name")
    s.set_defaults(handler=_delete_policy)
    s = RECORDS.add(verbs, common_flags, help_text="retained records: ids, sizes, times (retention-reader, admin)")
    s.add_argument("--request-id", dest="request_id")
    s.add_argument("--tenant")
    s.add_argument("--policy")
    s = verbs.add_parser(
        "show", parents=[common_flags], help="a retained request and its answer, decrypted (retention-reader; audited)"
    )
    s.add_argument("record_id")
    s.set_defaults(handler=_show)
    s = verbs.add_parser("purge", parents=[common_flags], help="delete retained payloads now (admin; audited)")
    which = s.add_mutually_exclusive_group(required=True)
    which.add_argument("--request-id", dest="request_id")
    which.add_argument("--tenant")
    which.add_argument("--policy")
    s.set_defaults(handler=_purge)


def _set_policy(args: argparse.Namespace) -> int:
    with common.client(args) as c:
        out = c.put(
            f"/api/v1/retention/policies/{args.name}",
            RetentionPolicy,
            body={"ttl_s": args.ttl, "tenants": args.tenants},
        )
    POLICY.emit(args, out, [out])
    return EXIT_OK


def _delete_policy(args: argparse.Namespace) -> int:
    with common.client(args) as c:
        out = c.delete(f"/api/v1/retention/policies/{args.name}", RetentionPolicy)
    POLICY.emit(args, out, [out])
    return EXIT_OK


def _show(args: argparse.Namespace) -> int:
    with common.client(args) as c:
        print_json(c.get(f"/api/v1/retention/records/{args.record_id}", RetainedPayload))
    return EXIT_OK


def _purge(args: argparse.Namespace) -> int:
    body = {"request_id": args.request_id, "tenant": args.tenant, "policy": args.policy}
    with common.client(args) as c:
        out = c.post("/api/v1/retention/purge", RetentionPurged, body={k: v for k, v in body.items() if v is not None})
    if args.json:
        print_json(out)
    else:
        print(f"purged {out.purged} retained payload(s)")
    return EXIT_OK
