"""`nexa quotas`, `nexa usage`, `nexa workloads` and `nexa receipts`: the gateway's records."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING, Any, Final

from nexa.cli import common
from nexa.cli.output import print_json, print_more
from nexa.cli.tables import QUOTA, QUOTA_SHOW, QUOTAS, USAGE, WORKLOAD, WORKLOADS
from nexa.contracts.api import ReceiptPublicKey
from nexa.contracts.gateway import SignedReceipt, WorkloadView
from nexa.contracts.usage import QuotaView, UsageReport

if TYPE_CHECKING:
    from nexa.security import PublicKey

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1

#: (flag, QuotaLimits field, help)
_QUOTA_FLAGS: Final = (
    ("concurrent", "concurrent_requests", "requests in flight at once"),
    ("rpm", "requests_per_minute", "requests per minute"),
    ("tpm", "tokens_per_minute", "tokens per minute (prompt + completion)"),
    ("tpd", "tokens_per_day", "tokens per UTC day"),
    ("audio-seconds-per-day", "audio_seconds_per_day", "seconds of audio transcribed or translated per UTC day"),
    ("speech-chars-per-day", "speech_characters_per_day", "characters spoken (text to speech) per UTC day"),
    ("images-per-day", "images_per_day", "images generated per UTC day"),
)


def add_commands(sub: Any, common_flags: argparse.ArgumentParser) -> None:
    quotas = sub.add_parser("quotas", help="per-tenant limits (admin)").add_subparsers(metavar="VERB", required=True)
    s = quotas.add_parser("set", parents=[common_flags], help="replace a tenant's limits (a limit left out: none)")
    s.add_argument("tenant")
    for flag, _, text in _QUOTA_FLAGS:
        s.add_argument(f"--{flag}", type=int, default=None, help=text)
    s.add_argument(
        "--adapter-tokens-per-day",
        type=_adapter_limit,
        action="append",
        default=[],
        metavar="NAME=N",
        help="tokens per UTC day of the LoRA adapter NAME (its model name: all its versions; 0 refuses it);"
        " repeatable, one per adapter",
    )
    s.set_defaults(handler=_quotas_set)
    s = quotas.add_parser("show", parents=[common_flags], help="limits and current use: one tenant, or all with limits")
    s.add_argument("tenant", nargs="?")
    s.set_defaults(handler=_quotas_show)

    s = sub.add_parser("usage", parents=[common_flags], help="usage by tenant, model and UTC day (audit, admin)")
    s.add_argument(
        "--since", type=common.when, help="2027-01-31 (UTC), an ISO time or Unix seconds; default 30 days ago"
    )
    s.add_argument("--until", type=common.when, help="the same forms; default now")
    s.add_argument("--tenant")
    s.add_argument("--model")
    s.add_argument("--csv", action="store_true", help="print CSV (the controller's export)")
    common.page_flags(s)
    s.set_defaults(handler=_usage)

    workloads = sub.add_parser("workloads", help="canonical workloads of your tenant (inference)").add_subparsers(
        metavar="VERB", required=True
    )
    WORKLOADS.add(workloads, common_flags)
    for verb, text in (("status", "state"), ("cancel", "cancel it"), ("receipt", "its signed receipt (JSON)")):
        s = workloads.add_parser(verb, parents=[common_flags], help=text)
        s.add_argument("workload_id")
        s.set_defaults(handler=_workloads_action, verb=verb)

    receipts = sub.add_parser("receipts", help="signed workload receipts").add_subparsers(metavar="VERB", required=True)
    s = receipts.add_parser("verify", parents=[common_flags], help="check a receipt file's signature (exit 1 if bad)")
    s.add_argument("file")
    s.add_argument(
        "--public-key",
        action="append",
        help="a controller key (base64, or @FILE: a key, or the JSON of `nexa receipts key --json` with the"
        " retired keys too); repeatable; offline, picked by the receipt's key id. Without it, fetched from --url",
    )
    s.set_defaults(handler=_receipts_verify)
    s = receipts.add_parser("key", parents=[common_flags], help="print the controller's receipt-signing public key")
    s.set_defaults(handler=_receipts_key)


def _adapter_limit(text: str) -> tuple[str, int]:
    """`--adapter-tokens-per-day NAME=N` → (NAME, N); the controller checks NAME."""
    name, eq, count = text.partition("=")
    if not eq or not name.strip() or not count.strip().isdecimal():
        raise argparse.ArgumentTypeError(
            f"not NAME=N: {text!r} (the adapter's model name and a whole number of tokens, e.g. ner-lora=50000)"
        )
    return name.strip(), int(count)


def _quotas_set(args: argparse.Namespace) -> int:
    body: dict[str, object] = {field: getattr(args, flag.replace("-", "_")) for flag, field, _ in _QUOTA_FLAGS}
    adapters = dict(args.adapter_tokens_per_day)
    if len(adapters) < len(args.adapter_tokens_per_day):
        print("nexa: an adapter is named twice in --adapter-tokens-per-day; give each one once", file=sys.stderr)
        return EXIT_FAILED
    body["adapter_tokens_per_day"] = adapters
    with common.client(args) as c:
        out = c.put(f"/api/v1/quotas/{args.tenant}", QuotaView, body=body)
    QUOTA.emit(args, out, [out])
    return EXIT_OK


def _quotas_show(args: argparse.Namespace) -> int:
    return (QUOTA_SHOW if args.tenant else QUOTAS).run(args)


def _usage(args: argparse.Namespace) -> int:
    params = {
        "since": None if args.since is None else str(args.since),
        "until": None if args.until is None else str(args.until),
        "tenant": args.tenant,
        "model": args.model,
        **common.page_params(args),
    }
    with common.client(args) as c:
        if args.csv:
            sys.stdout.write(c.text("GET", "/api/v1/usage", params={**params, "format": "csv"}))
            return EXIT_OK
        out = c.get("/api/v1/usage", UsageReport, params=params)
    USAGE.emit(args, out, out.rows)
    if not args.json:
        print_more(out.next_cursor)
    return EXIT_OK


def _workloads_action(args: argparse.Namespace) -> int:
    path = f"/api/v1/workloads/{args.workload_id}"
    with common.client(args) as c:
        if args.verb == "receipt":
            print_json(c.get(path + "/receipt", SignedReceipt))
            return EXIT_OK
        out = c.get(path, WorkloadView) if args.verb == "status" else c.post(path + "/cancel", WorkloadView)
    WORKLOAD.emit(args, out, [out])
    return EXIT_OK


def _receipts_verify(args: argparse.Namespace) -> int:
    from nexa import security
    from nexa.contracts import codec
    from nexa.errors import BadSignature

    signed = codec.loads(codec.api, common.read_file(args.file), SignedReceipt)
    keys: dict[str, PublicKey] = {}
    for given in args.public_key or []:
        text = common.read_file(given[1:]).decode("ascii", "replace") if given.startswith("@") else given
        if text.lstrip().startswith("{"):  # `nexa receipts key --json`: current and retired keys
            listed = codec.loads(codec.api, text, ReceiptPublicKey)
            keys |= _keys_of(listed)
        else:
            pub = security.PublicKey.from_b64(text)
            keys[pub.fingerprint] = pub
    if not keys:
        with common.client(args) as c:
            keys = _keys_of(c.get("/api/v1/receipts/public-key", ReceiptPublicKey))
    try:
        pub = security.verify_receipt_among(keys, signed)
    except BadSignature as exc:
        print(f"receipt {signed.receipt.receipt_id}: INVALID ({exc.message})")
        return EXIT_FAILED
    r = signed.receipt
    print(
        f"receipt {r.receipt_id}: valid — workload {r.workload_id}, {r.state.value}, "
        f"{r.model}@{r.model_version}, {r.prompt_tokens}+{r.completion_tokens} tokens, key {pub.fingerprint}"
    )
    return EXIT_OK


def _keys_of(listed: ReceiptPublicKey) -> dict[str, PublicKey]:
    """Key id → key of an answer of `GET /api/v1/receipts/public-key` (its current key at least)."""
    from nexa import security

    keys = {k.key_id: security.PublicKey.from_b64(k.public_key) for k in listed.keys}
    current = security.PublicKey.from_b64(listed.public_key)
    return {current.fingerprint: current, **keys}


def _receipts_key(args: argparse.Namespace) -> int:
    with common.client(args) as c:
        listed = c.get("/api/v1/receipts/public-key", ReceiptPublicKey)
    if args.json:
        print_json(listed)
    else:
        print(listed.public_key)
    return EXIT_OK
