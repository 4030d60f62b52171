"""`nexa audit`: list, verify and sign the head of the audit chain (audit, admin)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import Any, Final

from nexa.cli import common
from nexa.cli.output import print_json
from nexa.cli.tables import AUDIT
from nexa.contracts.api import AuditVerdict, ReceiptPublicKey, SignedAuditCheckpoint

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1


def add_commands(sub: Any, common_flags: argparse.ArgumentParser) -> None:
    audit = sub.add_parser("audit", help="the audit chain (audit, admin)").add_subparsers(metavar="VERB", required=True)
    s = AUDIT.add(audit, common_flags)
    s.add_argument("--action")
    s.add_argument("--actor", help="key id")
    s.add_argument("--target")
    s.add_argument("--since", type=float, help="unix seconds")
    s.add_argument("--until", type=float, help="unix seconds")
    # Deprecated, before every list took `--cursor`: the seq of the last event seen (`?after=`).
    s.add_argument("--after", type=int, help=argparse.SUPPRESS)
    s = audit.add_parser("verify", parents=[common_flags], help="recompute the chain; exit 1 if it is broken")
    s.add_argument(
        "--against",
        metavar="HEAD_FILE",
        help="also check a checkpoint saved by `nexa audit head`: its signature, and that the chain still holds it",
    )
    s.add_argument(
        "--public-key",
        help="with --against: the controller's signing key (base64, or @FILE). Without it, fetched from --url",
    )
    s.set_defaults(handler=_audit_verify)
    s = audit.add_parser(
        "head", parents=[common_flags], help="print the chain's head (seq, sha256) signed by the controller; keep it"
    )
    s.set_defaults(handler=_audit_head)


def _audit_head(args: argparse.Namespace) -> int:
    with common.client(args) as c:
        print_json(c.get("/api/v1/audit/head", SignedAuditCheckpoint))
    return EXIT_OK


def _audit_verify(args: argparse.Namespace) -> int:
    from nexa.contracts import codec

    against = None
    with common.client(args) as c:
        if args.against is not None:
            against = _checked_audit_head(args, lambda: c.get("/api/v1/receipts/public-key", ReceiptPublicKey))
            if against is None:
                return EXIT_FAILED
        body = None if against is None else {"against": codec.api.unstructure(against)}
        out = c.post("/api/v1/audit/verify", AuditVerdict, body=body)
    if args.json:
        print_json(out)
    elif out.ok:
        held = f"; it holds the signed checkpoint at seq {against.checkpoint.seq}" if against else ""
        print(f"audit chain ok: {out.checked} events verified{held}")
    else:
        print(
            f"audit chain BROKEN at event seq {out.first_bad_seq} (id {out.first_bad_id}): {out.reason}; "
            f"{out.checked} events before it verified",
            file=sys.stderr,
        )
    return EXIT_OK if out.ok else EXIT_FAILED


def _checked_audit_head(
    args: argparse.Namespace, fetch: Callable[[], ReceiptPublicKey]
) -> SignedAuditCheckpoint | None:
    """The `--against` file, once its signature verifies with the controller's key (here, not only
    on the controller); None, after saying why, when it does not."""
    from nexa import security
    from nexa.contracts import codec
    from nexa.errors import BadSignature

    signed = codec.loads(codec.api, common.read_file(args.against), SignedAuditCheckpoint)

    def controller_key() -> str:
        # The current key, or the retired one that signed it (the controller lists both).
        known = fetch()
        embedded = signed.public_key.strip()
        return next((k.public_key for k in known.keys if k.public_key == embedded), known.public_key)

    pub = common.public_key(args.public_key, controller_key)
    try:
        security.verify_audit_checkpoint(pub, signed)
    except BadSignature as exc:
        print(f"audit checkpoint {args.against}: INVALID ({exc.message})", file=sys.stderr)
        return None
    return signed
