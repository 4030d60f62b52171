"""The release gate (`builds/release-gate.sh` runs this with the project's Python).

One line per check, `PASS name — detail` or `FAIL name — detail` (a failure's findings follow,
indented), then a closing line; exit 0 only when every check passed, 1 otherwise, 2 on bad usage.
`--json FILE` writes the `GateReport` (nexa.contracts.evidence) that `nexa evidence --gate` takes;
with `--sign-key KEY` a `SignedGateReport` (the report and an Ed25519 signature by KEY), which a
controller listing KEY's public half in `[evidence] trusted_report_keys` counts as verified.

Checks, in order (`--only a,b` runs some, for development and the gate's own tests):
  ruff-check, ruff-format, mypy, lint-imports   the quality gates
  sbom            CycloneDX JSON of the binary's Python dependencies (the runtime dependencies of
                  pyproject.toml and all they pull in, at the versions installed), written to
                  dist/sbom.cdx.json or `--sbom FILE`; it must list every runtime dependency
  secrets         detect-secrets over the tree (git's tracked and untracked, not ignored, files:
                  code, units, fixtures); known test values are listed, each with its reason, in
                  builds/gate/secrets-allowed.json
  images-pinned   every image reference in README and docs, units/, tests/fixtures/, builds/
                  carries @sha256: and 64 hex digits (scans.py says what counts as one)
  isolation       nothing a node runs or stores names anything outside the product's boundary
                  (scans.py defines the boundary)
  public-leaks    no node address, file path, container id, key or stack trace in any public
                  answer of a `nexa sim` run: `--sim-answers FILE` (with `--sim-state-dir DIR`,
                  the sim's state directory, for its keys), or this runs `nexa sim
                  --public-answers` itself
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

import scans
import tools

from nexa import security
from nexa.contracts import codec
from nexa.contracts.evidence import GateCheck, GateReport, SignedGateReport
from nexa.errors import ConfigError

QUALITY: Final = ("ruff-check", "ruff-format", "mypy", "lint-imports")
CHECKS: Final = (*QUALITY, "sbom", "secrets", "images-pinned", "isolation", "public-leaks")
#: Findings printed under a FAIL line (the rest are counted).
SHOWN: Final = 20
EXIT_USAGE: Final = 2


def _found(findings: list[str], what: str) -> tools.Result:
    if findings:
        more = f" (and {len(findings) - 1} more)" if len(findings) > 1 else ""
        return False, findings[0] + more, findings
    return True, what, []


def _public_leaks(args: argparse.Namespace) -> tools.Result:
    if args.sim_answers is not None:
        answers = Path(args.sim_answers)
        if not answers.is_file():
            return False, f"{answers}: no such file (write it with nexa sim --public-answers FILE)", []
        return _scan_answers(answers, Path(args.sim_state_dir) if args.sim_state_dir else None)
    with tempfile.TemporaryDirectory(prefix="nexa-gate-sim-") as tmp:
        answers, state = Path(tmp) / "answers.jsonl", Path(tmp) / "state"
        argv = [sys.executable, "-m", "nexa", "sim", "--public-answers", str(answers), "--state-dir", str(state)]
        done = subprocess.run(argv, cwd=args.root, capture_output=True, text=True, check=False)
        if not answers.is_file():
            tail = tools._last_line(done.stderr or done.stdout)
            return False, f"nexa sim --public-answers wrote no answers (exit {done.returncode}): {tail}", []
        ok, detail, findings = _scan_answers(answers, state)
        return ok, f"{detail} (nexa sim exit {done.returncode})", findings


def _scan_answers(answers: Path, state_dir: Path | None) -> tools.Result:
    lines = sum(1 for line in answers.read_text(encoding="utf-8", errors="replace").splitlines() if line.strip())
    if lines == 0:
        return False, f"{answers.name}: no public answer to scan (did the sim run?)", []
    keys = len(scans.state_secrets(state_dir))
    return _found(
        scans.leak_findings(answers, state_dir),
        f"{lines} public answers: no node address, path, container id, key ({keys} known) or trace",
    )


def run_check(name: str, args: argparse.Namespace, files: Callable[[], list[str]]) -> tools.Result:
    root: Path = args.root
    if name in QUALITY:
        return tools.quality(root, name)
    if name == "sbom":
        return tools.sbom(root, Path(args.sbom) if args.sbom else root / "dist" / "sbom.cdx.json")
    if name == "secrets":
        return tools.secrets(root, files())
    if name == "images-pinned":
        tree = files()
        scoped = [f for f in tree if scans.image_scope(f)]
        return _found(scans.image_findings(root, scoped), f"{len(scoped)} files: every image reference is pinned")
    if name == "isolation":
        return _found(
            scans.isolation_findings(root),
            "node.toml, the node's units and every adapter's command line name only the product's paths",
        )
    return _public_leaks(args)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="release-gate.sh", description=__doc__.split("\n\n")[0])
    p.add_argument("--root", type=Path, default=Path(__file__).resolve().parents[2], help="the tree to check")
    p.add_argument("--json", metavar="FILE", help="write the GateReport as JSON")
    p.add_argument("--sim-answers", metavar="FILE", help="nexa sim --public-answers output to scan")
    p.add_argument("--sim-state-dir", metavar="DIR", help="that sim's --state-dir (its keys are looked for)")
    p.add_argument("--sbom", metavar="FILE", help="where to write the SBOM (default dist/sbom.cdx.json)")
    p.add_argument("--only", metavar="A,B", help=f"run only these checks ({', '.join(CHECKS)})")
    p.add_argument(
        "--sign-key",
        metavar="FILE",
        help="with --json: sign the report with this Ed25519 key (nexa keygen --signing), writing a"
        " SignedGateReport that a controller trusting the key counts as verified",
    )
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    args.root = args.root.resolve()
    picked = CHECKS
    if args.only:
        picked = tuple(n.strip() for n in args.only.split(",") if n.strip())
        unknown = [n for n in picked if n not in CHECKS]
        if unknown:
            print(f"release-gate: unknown check {', '.join(unknown)} (known: {', '.join(CHECKS)})", file=sys.stderr)
            return EXIT_USAGE
    try:
        key = _signing_key(args)
    except ConfigError as exc:
        print(f"release-gate: {exc.message}", file=sys.stderr)
        return EXIT_USAGE
    cache: list[list[str]] = []

    def files() -> list[str]:
        if not cache:
            cache.append(scans.tree_files(args.root))
        return cache[0]

    started = time.time()
    checks = []
    for name in picked:
        try:
            ok, detail, findings = run_check(name, args, files)
        except (OSError, subprocess.SubprocessError, ValueError) as exc:
            ok, detail, findings = False, f"the check itself failed: {type(exc).__name__}: {exc}", []
        print(f"{'PASS' if ok else 'FAIL'} {name} — {detail}", flush=True)
        if not ok:
            for line in findings[:SHOWN]:
                print(f"    {line}")
            if len(findings) > SHOWN:
                print(f"    … {len(findings) - SHOWN} more")
        checks.append(GateCheck(name=name, ok=ok, detail=detail[:500]))
    report = GateReport(
        clean=all(c.ok for c in checks), checks=checks, started_at=started, duration_s=time.time() - started
    )
    failed = sum(not c.ok for c in checks)
    print(f"release gate: {'clean' if report.clean else 'NOT clean'} ({len(checks) - failed}/{len(checks)} passed)")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        written: GateReport | SignedGateReport = report
        if key is not None:
            written = SignedGateReport(report=report, signature=security.sign_report(key, report))
        Path(args.json).write_text(json.dumps(codec.api.unstructure(written), indent=2, sort_keys=True) + "\n")
    return 0 if report.clean else 1


def _signing_key(args: argparse.Namespace) -> security.SigningKey | None:
    if args.sign_key is None:
        return None
    if not args.json:
        raise ConfigError("--sign-key signs the --json report: give --json FILE too")
    return security.load_signing_key(Path(args.sign_key))


if __name__ == "__main__":
    sys.exit(main())
