"""`nexa sim`: the scripted campaign on a local cluster (`nexa.sim`); exit 0 only when every step
picked passed, 1 when one failed, 2 for an unknown step name."""

from __future__ import annotations

import argparse
import os
import sys
from functools import partial
from pathlib import Path
from typing import Any, Final

from nexa.errors import ConfigError

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_INTERRUPTED: Final = 130


def add_commands(sub: Any) -> None:
    s = sub.add_parser("sim", help="a scripted campaign on a local four-node cluster, step by step, with a verdict")
    s.add_argument("--steps", help="comma-separated steps to run (default: all, in order)")
    s.add_argument("--seed", type=int, default=1, help="makes the load and the choices reproducible (default 1)")
    s.add_argument("--json", dest="json_file", metavar="FILE", help="write the SimSummary as JSON to FILE")
    s.add_argument(
        "--public-answers", metavar="FILE", help="write every non-2xx public answer (and a sample of 2xx) as JSON lines"
    )
    s.add_argument(
        "--sign-key",
        metavar="FILE",
        help="with --json: sign the summary with this Ed25519 key (nexa keygen --signing), writing a"
        " SignedSimSummary that a controller trusting the key counts as verified in nexa evidence",
    )
    s.add_argument("--state-dir", default=".nexa/sim", help="the sim's own directory, emptied at start")
    s.add_argument(
        "--report-to",
        metavar="URL",
        help="also record the campaign as a `sim` job (progress, verdict) on this controller, e.g. "
        "$NEXA_URL; its operator key from --report-token or $NEXA_TOKEN",
    )
    s.add_argument("--report-token", help="the operator key for --report-to (default $NEXA_TOKEN)")
    s.add_argument("--log-level", default=os.environ.get("NEXA_LOG_LEVEL", "warning"))
    s.set_defaults(handler=_cmd_sim)


def _say(line: str) -> None:
    print(line, flush=True)


def _cmd_sim(args: argparse.Namespace) -> int:
    import trio

    from nexa import security
    from nexa.contracts import codec
    from nexa.contracts.evidence import SignedSimSummary, SimSummary
    from nexa.sim import run
    from nexa.sim.campaign import UnknownSteps, pick, table
    from nexa.sim.steps import NAMES
    from nexa.telemetry import setup_logging

    try:
        picked = pick(NAMES, args.steps)
    except UnknownSteps as exc:
        raise ConfigError(f"--steps: {exc}") from None
    if args.seed < 0:
        raise ConfigError("--seed: a whole number, 0 or more")
    key = None
    if args.sign_key:
        if not args.json_file:
            raise ConfigError("--sign-key signs the --json summary: give --json FILE too")
        key = security.load_signing_key(Path(args.sign_key))
    setup_logging(args.log_level)
    answers = Path(args.public_answers) if args.public_answers else None
    report_to = None
    if args.report_to:
        token = args.report_token or os.environ.get("NEXA_TOKEN", "")
        if not token:
            raise ConfigError("--report-to needs an operator key: --report-token KEY or $NEXA_TOKEN")
        report_to = (args.report_to.rstrip("/"), token)
    try:
        summary = trio.run(
            partial(
                run.campaign,
                Path(args.state_dir),
                picked,
                seed=args.seed,
                say=_say,
                public_answers=answers,
                report_to=report_to,
            )
        )
    except BaseException as exc:  # Ctrl-C comes alone or wrapped by the nurseries
        if not run.interrupted(exc):
            raise
        print("nexa sim: interrupted; everything it started is stopped", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(table(summary))
    if args.json_file:
        written: SimSummary | SignedSimSummary = summary
        if key is not None:
            written = SignedSimSummary(summary=summary, signature=security.sign_report(key, summary))
        Path(args.json_file).write_text(codec.dumps(codec.api, written) + "\n")
    sys.stdout.flush()
    return EXIT_OK if summary.passed else EXIT_FAILED
