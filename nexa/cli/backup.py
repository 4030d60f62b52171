"""`nexa backup` (admin, through the controller's API) and `nexa restore` (offline, on the new host)."""

from __future__ import annotations

import argparse
import hashlib
from pathlib import Path
from typing import Any, Final

from nexa.cli import common
from nexa.cli.output import print_json
from nexa.cli.tables import BACKUPS
from nexa.contracts.backup import BackupView
from nexa.errors import BackupDamaged, ConfigError, Conflict

EXIT_OK: Final = 0
_OUT_HELP: Final = "where to write the backup (mode 0600; must not exist)"
_KEY_HELP: Final = (
    "file with the backup key (base64 or hex; default: $NEXA_BACKUP_KEY). Make one: nexa keygen --backup --out FILE"
)


def add_commands(sub: Any, common_flags: argparse.ArgumentParser) -> None:
    backup = sub.add_parser(
        "backup",
        parents=[common_flags],
        usage="nexa backup --out FILE | nexa backup {create,list} ... (-h each)",
        help="back up the controller now (admin): `nexa backup --out FILE`; `nexa backup list`",
        description="`nexa backup --out FILE`: the controller makes a backup (online, audited as backup.created)"
        " into its [backup] dir, sealed with its backup key; this downloads it to FILE (mode 0600)."
        " Restore with `nexa restore`. `nexa backup list`: the backups in [backup] dir, oldest first.",
    )
    backup.add_argument("--out", metavar="FILE", help=_OUT_HELP)
    backup.set_defaults(handler=_backup)
    verbs = backup.add_subparsers(metavar="VERB", prog="nexa backup")
    after = _after_verb_flags()
    s = verbs.add_parser("create", parents=[after], help="the same as `nexa backup --out FILE`")
    s.add_argument("--out", metavar="FILE", default=argparse.SUPPRESS, help=_OUT_HELP)
    s.set_defaults(handler=_backup)
    BACKUPS.add(verbs, after, help_text="the backups in [backup] dir, oldest first (name, epoch, audit head, size)")

    s = sub.add_parser(
        "restore",
        help="restore a backup into a new, empty state directory (offline, before starting `nexa control`)",
        description="Checks the key, every byte (AES-256-GCM), the manifest's signature, each part's sha256"
        " and the audit chain, then moves the state into DIR; refuses, writing nothing, otherwise.",
    )
    s.add_argument("file", metavar="FILE")
    s.add_argument("--state-dir", required=True, metavar="DIR", help="absent or empty directory to restore into")
    s.add_argument("--key-file", metavar="FILE", help=_KEY_HELP)
    s.add_argument(
        "--public-key", help="the controller's signing key (base64, or @FILE) the manifest must be signed with"
    )
    s.add_argument("--json", action="store_true", help="print JSON for scripts")
    s.set_defaults(handler=_restore)


def _after_verb_flags() -> argparse.ArgumentParser:
    """`--url`, `--token`, `--json` again after a verb, left unset when not given there: an argparse
    sub-parser's defaults would overwrite the values given before the verb (`nexa backup --json list`)."""
    flags = argparse.ArgumentParser(add_help=False, argument_default=argparse.SUPPRESS)
    flags.add_argument(
        "--url", help="controller URL ($NEXA_URL; https: checked against the system's CAs or $NEXA_CA_FILE)"
    )
    flags.add_argument("--token", help="API key ($NEXA_TOKEN)")
    flags.add_argument("--json", action="store_true", help="print JSON for scripts")
    return flags


def _backup(args: argparse.Namespace) -> int:
    from nexa import security

    if args.out is None:
        raise ConfigError("name the file to write: nexa backup --out FILE (or list them: nexa backup list)")
    out = Path(args.out)
    if out.exists():
        raise Conflict(f"{out} exists already: name a new file for --out")
    with common.client(args) as c:
        view = c.post("/api/v1/backups", BackupView, body={})
        data = c.download(f"/api/v1/backups/{view.name}")
    if len(data) != view.size or hashlib.sha256(data).hexdigest() != view.sha256:
        raise BackupDamaged(f"the download of {view.name} does not match its size and sha256: run it again")
    security.write_key_file(out, data, private=True)
    if args.json:
        print_json(view)
    else:
        print(
            f"backup {view.name} written to {out} ({view.size} bytes, epoch {view.epoch},"
            f" audit head {view.audit_head_seq}, sha256 {view.sha256})"
        )
    return EXIT_OK


def _restore(args: argparse.Namespace) -> int:
    from nexa.control.operations.backup import check_key_source, restore

    key = check_key_source(args.key_file)
    trusted = None if args.public_key is None else common.public_key(args.public_key, lambda: "")
    result = restore(common.read_file(args.file), Path(args.state_dir), key, trusted=trusted)
    if args.json:
        print_json(result)
    else:
        m = result.manifest
        print(
            f"restored into {result.state_dir}: epoch {m.epoch}, audit chain ok ({result.audit_events_verified}"
            f" events, head {m.audit_head_seq}), made {m.created_at:.0f} by nexa {m.nexa_version}",
        )
        print(f"next: nexa control --state-dir {result.state_dir}")
    return EXIT_OK
