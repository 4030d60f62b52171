"""The `nexa` process: `main(argv)`, the parser's top level, the tools, and the exit codes.

The roles (`control`, `node`, `demo`, `sim-runtime`) are in `nexa.cli.roles`, the operator commands
(which call the controller's HTTP API through `nexa.client`) in one module per resource.

Exit codes: 0 success; 1 the operation failed (remote error, verify failed, cannot start);
2 bad usage or invalid configuration; 3 a running role stopped because its store became unusable
(corrupt, not a database, I/O failure, read-only). A role's loops that fail otherwise are
restarted (`nexa.supervision`), never an exit.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

from nexa import __version__, config
from nexa.cli import roles
from nexa.cli.output import terminal_safe_stdout
from nexa.contracts.text import visible_text
from nexa.errors import ConfigError, NexaError, RemoteError, StoreUnusable

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
EXIT_STORE_UNUSABLE: Final = 3
EXIT_INTERRUPTED: Final = 130

#: The commands `roles.add_commands` registers: a process started as one of them runs that role to
#: its end, so its parser holds the roles alone and the operator commands (and all they import:
#: tables, API contracts, the HTTP client) stay out of a node agent's memory.
ROLE_COMMANDS: Final = frozenset({"control", "node", "demo", "sim-runtime"})


def main(argv: Sequence[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = parser(roles_only=bool(argv) and argv[0] in ROLE_COMMANDS)
    args = p.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] | None = getattr(args, "handler", None)
    if handler is None:
        p.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        with terminal_safe_stdout():
            return handler(args)
    except ConfigError as exc:
        print(f"nexa: {visible_text(exc.message)}", file=sys.stderr)
        return EXIT_USAGE
    except RemoteError as exc:
        rid = f" (request {exc.request_id})" if exc.request_id else ""
        print(f"nexa: error: {exc.remote_code}: {visible_text(exc.message)}{rid}", file=sys.stderr)
        return EXIT_FAILED
    except NexaError as exc:
        print(f"nexa: error: {visible_text(exc.message)}", file=sys.stderr)
        # An unusable database is not fixed by a restart: its own exit code, for alerting.
        return EXIT_STORE_UNUSABLE if isinstance(exc, StoreUnusable) else EXIT_FAILED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


def parser(*, roles_only: bool = False) -> argparse.ArgumentParser:
    """The `nexa` command line; with `roles_only`, the long-running roles' commands alone (`ROLE_COMMANDS`)."""
    p = argparse.ArgumentParser(prog="nexa", description="LunaNexa model and GPU-cluster control plane")
    sub = p.add_subparsers(metavar="COMMAND")
    if roles_only:
        roles.add_commands(sub)
        return p
    from nexa.cli import (
        audit,
        backup,
        bench,
        deployments,
        docs,
        evals,
        evidence,
        gateway,
        keys,
        models,
        nodes,
        recovery,
        registry,
        retention,
        sim,
    )
    from nexa.cli.common import common_flags

    s = sub.add_parser("version", help="print the version")
    s.set_defaults(handler=_cmd_version)

    s = sub.add_parser("check-config", help="validate a config file (exit 0 valid, 2 invalid)")
    s.add_argument("file")
    s.add_argument(
        "--role",
        choices=("control", "node"),
        help="which config it is (default: whichever the file is; a file neither reads as is reported as the closer)",
    )
    s.set_defaults(handler=_cmd_check_config)

    s = sub.add_parser("keygen", help="print a new API key in nexa's format (for bootstrap.admin_key_file)")
    s.add_argument("--backup", action="store_true", help="a backup key instead (32 random bytes, base64)")
    s.add_argument(
        "--signing",
        action="store_true",
        help="an Ed25519 signing key instead, written to --out (PEM, 0600); prints its public key for"
        " [evidence] trusted_report_keys (nexa sim --sign-key, release-gate.sh --sign-key)",
    )
    s.add_argument("--out", metavar="FILE", help="write it to FILE (mode 0600, must not exist) instead of printing it")
    s.set_defaults(handler=_cmd_keygen)

    openapi_help = "print the HTTP API's OpenAPI 3.1 document (as GET /api/v1/openapi.json)"
    sub.add_parser("openapi", help=openapi_help).set_defaults(handler=_cmd_openapi)
    docs.add_commands(sub)

    roles.add_commands(sub)
    sim.add_commands(sub)

    # The operator commands, by resource.
    flags = common_flags()
    keys.add_commands(sub, flags)
    nodes.add_commands(sub, flags)
    audit.add_commands(sub, flags)
    registry.add_runtime_commands(sub, flags)
    models.add_commands(sub, flags)
    registry.add_alias_commands(sub, flags)
    deployments.add_commands(sub, flags)
    gateway.add_commands(sub, flags)
    backup.add_commands(sub, flags)
    recovery.add_commands(sub, flags)
    bench.add_commands(sub, flags)
    evals.add_commands(sub, flags)
    evidence.add_commands(sub, flags)
    retention.add_commands(sub, flags)
    return p


def _cmd_version(_: argparse.Namespace) -> int:
    print(f"nexa {__version__}")
    return EXIT_OK


def _cmd_check_config(args: argparse.Namespace) -> int:
    roles: dict[str, type[config.ControlConfig] | type[config.NodeConfig]] = {
        "control": config.ControlConfig,
        "node": config.NodeConfig,
    }
    if args.role is not None:
        config.load(args.file, roles[args.role])
        print(f"{args.file}: ok")
        return EXIT_OK
    refusals: dict[str, ConfigError] = {}
    for role, cls in roles.items():
        try:
            config.load(args.file, cls)
        except ConfigError as exc:
            if not exc.problems:  # unreadable: the same for either role
                raise
            refusals[role] = exc
        else:
            print(f"{args.file}: ok ({role} config)")
            return EXIT_OK
    if refusals["control"].problems == refusals["node"].problems:  # not TOML: the same either way
        raise refusals["control"]
    role, closer = min(refusals.items(), key=lambda item: len(item[1].problems))
    raise ConfigError(
        f"{closer} (read as a {role} config, the closer of the two; give --role control or --role node to choose)",
        problems=closer.problems,
    ) from None


def _cmd_openapi(_: argparse.Namespace) -> int:
    from nexa.control.http import openapi

    print(json.dumps(openapi.document(), indent=2, sort_keys=True))
    return EXIT_OK


def _cmd_keygen(args: argparse.Namespace) -> int:
    from nexa.control.access.accounts import new_api_key
    from nexa.security import generate_signing_key, new_backup_key, save_signing_key, write_key_file

    if args.signing:
        if not args.out or args.backup:
            raise ConfigError("--signing writes a private key: give --out FILE (and not --backup)")
        signing = generate_signing_key()
        save_signing_key(signing, Path(args.out))
        print(signing.public.b64)
        return EXIT_OK
    key = new_backup_key() if args.backup else new_api_key()[1]
    if args.out:
        write_key_file(Path(args.out), (key + "\n").encode(), private=True)
    else:
        print(key)
    return EXIT_OK
