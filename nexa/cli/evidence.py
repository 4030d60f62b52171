"""`nexa evidence --out DIR` (operator: write a release-evidence bundle the controller signs) and
`nexa evidence verify DIR` (offline: check one).

A bundle is a directory of JSON files and a README, listed by size and sha256 in `manifest.json`
(the `EvidenceSigned` answer of `POST /api/v1/evidence`):
- `versions.json`: nexa's version, the binary (its file name, size and sha256), each runtime's
  image reference and digest, each model version's artifact digest;
- `sim-summary.json` (`--sim FILE`, a `SimSummary` from `nexa sim --json`), `gate.json`
  (`--gate FILE`, a `GateReport` from `builds/release-gate.sh --json`), `benchmarks.json` (the
  runs the controller stored, newest first, and each deployment's objectives and replicas);
- `audit-head.json`: the audit chain's head signed by the controller, when the key may read it
  (audit or admin role; the manifest carries the head either way);
- `qualifications.json`: every runtime qualification (`nexa runtimes qualify`), newest first, each
  signed by the controller (`nexa evidence verify` checks each signature too);
- `README.txt`: what `release_ready` covers, and what it never does.

`release_ready` holds only when the sim passed, every deployment's latest run of each kind meets
its objectives, and the gate is clean, and the sim summary and gate report are both `verified`:
signed (`nexa sim --sign-key`, `release-gate.sh --sign-key`, giving a `SignedSimSummary` or
`SignedGateReport` file) by a key the controller trusts. The manifest's `provenance` says which
part is `verified` and which only `asserted` (a bare report, or one signed by another key or changed
after signing); `verify` prints it and checks each verified part's signature against the bundle's
file. A manifest signed before provenance existed reads as asserted, never as ready. Acceptance on
the real fleet and a named human approval stay required: the bundle never claims them.
"""

from __future__ import annotations

import argparse
import errno
import hashlib
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Final, TypeVar

from nexa import __version__
from nexa.cli import common
from nexa.contracts import codec
from nexa.contracts.api import SignedAuditCheckpoint
from nexa.contracts.deployments import DeploymentList
from nexa.contracts.evidence import (
    MAX_REPORT_BYTES,
    AuditHead,
    Benchmarks,
    BenchRun,
    BenchRunList,
    DeploymentObjectives,
    EvidenceFile,
    EvidenceManifest,
    EvidenceRequest,
    EvidenceSigned,
    GateReport,
    ModelVersion,
    Origin,
    PartProvenance,
    ReportSignature,
    RuntimeImage,
    SignedGateReport,
    SignedSimSummary,
    SimSummary,
    StepVerdict,
    Versions,
)
from nexa.contracts.models import ModelList, RuntimeList
from nexa.contracts.qualification import QualificationList
from nexa.errors import ConfigError, Conflict, ContractError, RemoteError

T = TypeVar("T")
S = TypeVar("S")

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
VERSIONS: Final = "versions.json"
SIM: Final = "sim-summary.json"
BENCHMARKS: Final = "benchmarks.json"
GATE: Final = "gate.json"
AUDIT_HEAD: Final = "audit-head.json"
QUALIFICATIONS: Final = "qualifications.json"
README: Final = "README.txt"
MANIFEST: Final = "manifest.json"
#: `evidence verify` reads no bundle file past this (its JSON files are kilobytes to a few MiB) ...
MAX_BUNDLE_FILE_BYTES: Final = 64 * 2**20
#: ... and no manifest past this.
MAX_MANIFEST_BYTES: Final = 4 * 2**20
#: The largest `--sim` or `--gate` file read (the controller takes a report of at most MAX_REPORT_BYTES of JSON).
_MAX_REPORT_FILE_BYTES: Final = 4 * MAX_REPORT_BYTES
_FORBIDDEN: Final = 403
_PAGE: Final = "200"


README_TEXT: Final = f"""LunaNexa release evidence
=========================

This directory is a release-evidence bundle written by `nexa evidence`. {MANIFEST} lists every
other file by size and sha256 and is signed by the controller (Ed25519, kind nexa-evidence-v1).
Check it offline with:

    nexa evidence verify DIR --public-key KEY

(KEY: the controller's signing key: `public_key` of GET /api/v1/receipts/public-key.
Without --public-key the check proves the bundle is intact, not who signed it; compare the
fingerprint it prints with the controller_fingerprint of GET /version.)

release_ready covers three things only: the `nexa sim` campaign passed ({SIM}), every
deployment's latest benchmark of each kind meets its service objectives ({BENCHMARKS}), and the
release gate is clean ({GATE}).

The controller signs release_ready true only over what it could verify. The manifest's provenance
names, for the sim summary and the gate report, where each comes from:
  verified  signed by the release pipeline's key (`nexa sim --sign-key`, `release-gate.sh
            --sign-key`), a key the controller trusts ([evidence] trusted_report_keys); the
            signature is in the manifest and `nexa evidence verify` checks it against the file;
  asserted  the client's word only: unsigned, signed by a key the controller does not trust, or
            changed after it was signed (the note says which). It is recorded and signed as
            given, and release_ready is false;
  absent    not given.
A manifest without provenance (signed before it existed) reads as asserted, never as ready.

{QUALIFICATIONS} holds every runtime qualification (`nexa runtimes qualify`): which runtime
image digest passed or failed which step on which node architecture and GPU model, each record
signed by the controller (kind nexa-qualification-v1; `nexa evidence verify` checks them). They
inform release_ready's reader; they are not part of it.

It does NOT cover acceptance on the real fleet, and it is NOT a release approval. Both are still
required: acceptance tests on the production hardware, and a named human who approves the
release. This bundle does not claim either.
"""


def add_commands(sub: Any, common_flags: argparse.ArgumentParser) -> None:
    evidence = sub.add_parser(
        "evidence",
        parents=[common_flags],
        usage="nexa evidence --out DIR [--sim FILE] [--gate FILE] [--binary PATH] | nexa evidence verify DIR",
        help="write a release-evidence bundle signed by the controller (operator); `nexa evidence verify DIR`",
        description="Writes versions, the sim summary, benchmark runs, the gate report and the audit head into"
        " DIR, has the controller sign their digests (POST /api/v1/evidence) and prints release_ready with each"
        " failing reason and where the sim and gate reports come from: verified (signed by a key in the"
        " controller's [evidence] trusted_report_keys) or asserted (never release-ready)."
        " `nexa evidence verify DIR` checks a bundle offline.",
    )
    evidence.add_argument("--out", metavar="DIR", help="a new or empty directory to write the bundle into")
    evidence.add_argument(
        "--sim",
        metavar="FILE",
        help="the summary `nexa sim --json FILE` wrote; verified only when signed (--sign-key) by a trusted key",
    )
    evidence.add_argument(
        "--gate",
        metavar="FILE",
        help="the report `builds/release-gate.sh --json FILE` wrote; verified only when signed (--sign-key) by a"
        " trusted key",
    )
    evidence.add_argument("--binary", metavar="PATH", help="the nexa executable released (default: this one if frozen)")
    evidence.set_defaults(handler=_write)
    verbs = evidence.add_subparsers(metavar="VERB", prog="nexa evidence")
    s = verbs.add_parser("verify", help="check a bundle offline: signature, every file, release_ready; exit 1 if not")
    s.add_argument("dir", metavar="DIR")
    s.add_argument(
        "--public-key",
        metavar="B64|FILE",
        help="the controller's signing key (base64, or a file holding it). Without it: integrity, not origin",
    )
    s.set_defaults(handler=_verify)


# --- nexa evidence --out DIR --------------------------------------------------------------------


def _decoded(path: str, kind: type[T], flag: str, data: bytes) -> T:
    try:
        return codec.loads(codec.api, data, kind)
    except ContractError as exc:
        raise ConfigError(f"{flag} {path}: not a {kind.__name__} ({exc.message})") from None


def _report(
    path: str, kind: type[T], signed_kind: type[S], unwrap: Callable[[S], tuple[T, ReportSignature]], flag: str
) -> tuple[T, ReportSignature | None]:
    """A report file: bare (`kind`, only asserted) or signed (`signed_kind`: the report and its signature)."""
    data = common.read_file(path)
    if len(data) > _MAX_REPORT_FILE_BYTES:
        raise ConfigError(f"{flag} {path}: over {_MAX_REPORT_FILE_BYTES} bytes, not a report nexa writes")
    try:
        parsed = json.loads(data)
    except (ValueError, UnicodeDecodeError):
        parsed = None
    if isinstance(parsed, dict) and "signature" in parsed:
        return unwrap(_decoded(path, signed_kind, flag, data))
    return _decoded(path, kind, flag, data), None


def _out_dir(text: str | None) -> Path:
    if text is None:
        raise ConfigError(
            "name the directory to write: nexa evidence --out DIR (or check one: nexa evidence verify DIR)"
        )
    out = Path(text)
    if out.is_symlink() or (out.exists() and (not out.is_dir() or any(out.iterdir()))):
        raise Conflict(f"{out} exists and is not an empty directory: name a new or empty one for --out")
    return out


class _BundleDir:
    """The `--out` directory, opened once (never through a symlink) and written by that handle: a
    file is created there, never replaced (`O_EXCL`) nor followed (`O_NOFOLLOW`), so a symlink
    planted after the checks makes the write fail instead of writing elsewhere."""

    def __init__(self, out: Path) -> None:
        out.mkdir(parents=True, exist_ok=True)
        try:
            self._fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise Conflict(f"cannot use {out} for --out ({exc.strerror}): name a new or empty directory") from None
        self._out = out

    def write(self, name: str, data: bytes) -> None:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            fd = os.open(name, flags, 0o644, dir_fd=self._fd)
        except OSError as exc:
            raise Conflict(f"cannot write {self._out / name} ({exc.strerror}): something else put it there") from None
        with os.fdopen(fd, "wb") as f:
            f.write(data)

    def close(self) -> None:
        os.close(self._fd)


def _binary(given: str | None) -> tuple[EvidenceFile | None, str]:
    if given is None and not getattr(sys, "frozen", False):
        return None, "not run from the frozen binary: pass --binary dist/nexa to record the one released"
    path = Path(given or sys.executable)
    data = common.read_file(str(path))
    return EvidenceFile(path=path.name, size=len(data), sha256=hashlib.sha256(data).hexdigest()), ""


def _all_pages(c: Any, path: str, page: type[T], items: str, params: dict[str, str | None]) -> list[Any]:
    out: list[Any] = []
    cursor = None
    while True:
        answer = c.get(path, page, params={**params, "cursor": cursor})
        out.extend(getattr(answer, items))
        cursor = answer.next_cursor
        if cursor is None:
            return out


def _dump(value: object) -> bytes:
    return (json.dumps(codec.api.unstructure(value), indent=2, sort_keys=True) + "\n").encode()


def _signed_into(c: Any, out: Path, request: EvidenceRequest, files: dict[str, bytes]) -> EvidenceSigned:
    """Has the controller sign `request`, then writes `files` and the manifest into `out`; a refusal
    leaves nothing behind."""
    made = not out.exists()
    bundle = _BundleDir(out)
    try:
        signed: EvidenceSigned = c.post("/api/v1/evidence", EvidenceSigned, body=codec.api.unstructure(request))
    except BaseException:
        bundle.close()
        if made:
            out.rmdir()  # still empty
        raise
    try:
        for name, data in files.items():
            bundle.write(name, data)
        bundle.write(MANIFEST, _dump(signed))
    finally:
        bundle.close()
    return signed


def _write(args: argparse.Namespace) -> int:
    from nexa import security

    out = _out_dir(args.out)
    sim, sim_signature = (
        _report(args.sim, SimSummary, SignedSimSummary, lambda s: (s.summary, s.signature), "--sim")
        if args.sim
        else (None, None)
    )
    gate, gate_signature = (
        _report(args.gate, GateReport, SignedGateReport, lambda g: (g.report, g.signature), "--gate")
        if args.gate
        else (None, None)
    )
    binary, note = _binary(args.binary)
    files: dict[str, bytes] = {}
    with common.client(args) as c:
        runtimes = c.get("/api/v1/runtimes", RuntimeList).runtimes
        models = c.get("/api/v1/models", ModelList).models
        deployments = _all_pages(c, "/api/v1/deployments", DeploymentList, "deployments", {"limit": _PAGE})
        runs = _all_pages(c, "/api/v1/benchmarks", BenchRunList, "runs", {"limit": _PAGE})
        qualified = _all_pages(c, "/api/v1/qualifications", QualificationList, "qualifications", {"limit": _PAGE})
        try:
            head = AuditHead(checkpoint=c.get("/api/v1/audit/head", SignedAuditCheckpoint))
        except RemoteError as exc:
            if exc.status != _FORBIDDEN:
                raise
            head = AuditHead(
                checkpoint=None,
                note="this key may not read the audit head (audit or admin role): the manifest's audit_head_seq and"
                " audit_head_hash, signed by the controller, are the head; `nexa audit head` with an audit key"
                " gives a checkpoint to compare",
            )
        versions = Versions(
            nexa_version=__version__,
            binary=binary,
            binary_note=note,
            runtimes=[
                RuntimeImage(
                    runtime=r.name,
                    kind=str(r.kind),
                    version=r.version,
                    image=r.image,
                    digest=r.image.rpartition("@")[2],
                )
                for r in runtimes
            ],
            models=[
                ModelVersion(
                    name=m.name,
                    version=m.version,
                    state=str(m.state),
                    artifact_sha256=m.artifact.sha256,
                    artifact_size_bytes=m.artifact.size_bytes,
                )
                for m in models
            ],
        )
        files[VERSIONS] = _dump(versions)
        if sim is not None:
            files[SIM] = _dump(sim)
        files[BENCHMARKS] = _dump(
            Benchmarks(
                runs=runs,
                deployments=[
                    DeploymentObjectives(
                        name=v.deployment.name, replicas=v.deployment.replicas, objectives=v.deployment.objectives
                    )
                    for v in deployments
                ],
            )
        )
        if gate is not None:
            files[GATE] = _dump(gate)
        files[AUDIT_HEAD] = _dump(head)
        files[QUALIFICATIONS] = _dump(QualificationList(qualifications=qualified))
        files[README] = README_TEXT.encode()
        listed = [
            EvidenceFile(path=name, sha256=hashlib.sha256(data).hexdigest(), size=len(data))
            for name, data in sorted(files.items())
        ]
        request = EvidenceRequest(
            sim=sim, gate=gate, files=listed, sim_signature=sim_signature, gate_signature=gate_signature
        )
        signed = _signed_into(c, out, request, files)
    m = signed.manifest
    key = security.PublicKey.from_b64(signed.public_key)
    if args.json:
        print(json.dumps(codec.api.unstructure(signed), indent=2, sort_keys=True))
        return EXIT_OK
    print(f"evidence bundle written to {out}: {len(listed)} files and {MANIFEST}")
    print(f"signed by the controller (key {key.fingerprint}, controller fingerprint {m.controller_fingerprint})")
    print(f"release_ready: {str(m.release_ready).lower()}")
    for reason in m.checks.reasons:
        print(f"  - {reason}")
    _print_provenance(m)
    print(m.statement)
    return EXIT_OK


def _print_provenance(m: EvidenceManifest) -> None:
    if m.provenance is None:
        print("provenance: none recorded (signed before provenance existed): sim and gate read as asserted")
        return
    for name, part in (("sim", m.provenance.sim), ("gate", m.provenance.gate)):
        by = f" (signed by key {part.signed_by})" if part.signed_by else ""
        print(f"{name}: {part.provenance.value}{by}")


# --- nexa evidence verify DIR -------------------------------------------------------------------


def _trusted_key(given: str | None) -> str | None:
    if given is None:
        return None
    path = Path(given.removeprefix("@"))
    if given.startswith("@") or path.is_file():
        return common.read_file(str(path)).decode("ascii", "replace").strip()
    return given.strip()


def _read_bounded(path: Path, limit: int = MAX_BUNDLE_FILE_BYTES) -> bytes:
    """A bundle file's bytes, never through a symlink and never more than `limit` (OSError past it)."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise OSError(errno.EFBIG, f"over {limit} bytes")
    return data


def _bundle_files(root: Path) -> set[str]:
    return {p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() or p.is_symlink()}


def _file_problems(root: Path, manifest: EvidenceManifest) -> list[str]:
    problems = []
    present = _bundle_files(root)
    listed = {f.path for f in manifest.files}
    for f in manifest.files:
        path = root / f.path
        if f.path not in present or not path.is_file() or path.is_symlink():
            problems.append(f"{f.path}: missing (the manifest lists it)")
            continue
        try:
            data = _read_bounded(path, min(f.size, MAX_BUNDLE_FILE_BYTES))
        except OSError:
            problems.append(f"{f.path}: over the manifest's {f.size} bytes, or unreadable (changed after signing)")
            continue
        if len(data) != f.size:
            problems.append(f"{f.path}: {len(data)} bytes, the manifest says {f.size} (changed after signing)")
        elif hashlib.sha256(data).hexdigest() != f.sha256:
            problems.append(f"{f.path}: sha256 differs from the manifest's (changed after signing)")
    problems += [f"{p}: not in the manifest (an extra file)" for p in sorted(present - listed - {MANIFEST})]
    return problems


def _load_listed(root: Path, manifest: EvidenceManifest, name: str, kind: type[T], problems: list[str]) -> T | None:
    if name not in {f.path for f in manifest.files} or not (root / name).is_file():
        return None
    try:
        return codec.loads(codec.api, _read_bounded(root / name), kind)
    except OSError:
        problems.append(f"{name}: unreadable or over {MAX_BUNDLE_FILE_BYTES} bytes")
        return None
    except ContractError as exc:
        problems.append(f"{name}: not a {kind.__name__} ({exc.message})")
        return None


def recompute(root: Path, manifest: EvidenceManifest) -> tuple[dict[str, bool], list[str]]:
    """The three release checks from the bundle's own files (as the controller decides them), and
    the files that could not be read."""
    from nexa.control.operations.benchmarks import judge

    problems: list[str] = []
    sim = _load_listed(root, manifest, SIM, SimSummary, problems)
    gate = _load_listed(root, manifest, GATE, GateReport, problems)
    bench = _load_listed(root, manifest, BENCHMARKS, Benchmarks, problems)
    sim_passed = sim is not None and sim.passed and all(s.verdict is not StepVerdict.FAIL for s in sim.steps)
    gate_clean = gate is not None and gate.clean and all(c.ok for c in gate.checks)
    benchmarks_ok = False
    if bench is not None:
        current = {d.name: d for d in bench.deployments}
        latest: dict[tuple[str, str], BenchRun] = {}
        for run in bench.runs:
            key = (run.run.deployment, run.run.kind.value)
            if run.run.deployment in current and (
                key not in latest or (run.recorded_at, run.id) > (latest[key].recorded_at, latest[key].id)
            ):
                latest[key] = run
        benchmarks_ok = bool(latest) and all(
            judge(
                current[r.run.deployment].objectives, current[r.run.deployment].replicas, r.run.points
            ).meets_objectives
            for r in latest.values()
        )
    return {"sim_passed": sim_passed, "benchmarks_meet_objectives": benchmarks_ok, "gate_clean": gate_clean}, problems


def _provenance_problems(root: Path, manifest: EvidenceManifest) -> list[str]:
    """Each `verified` part's signature checked again, over the bundle's file."""
    from nexa import security
    from nexa.errors import BadSignature

    assert manifest.provenance is not None
    problems: list[str] = []
    parts: tuple[tuple[str, PartProvenance, type[SimSummary] | type[GateReport]], ...] = (
        (SIM, manifest.provenance.sim, SimSummary),
        (GATE, manifest.provenance.gate, GateReport),
    )
    for name, part, kind in parts:
        if part.provenance is not Origin.VERIFIED:
            continue
        report = _load_listed(root, manifest, name, kind, [])
        if part.signature is None or report is None:
            problems.append(f"provenance: {name} is verified in the manifest, but its signature or file is missing")
            continue
        try:
            key = security.verify_report(part.signature, report)
        except (BadSignature, ContractError):
            problems.append(f"provenance: {name}: the signature in the manifest does not verify over the file")
            continue
        if key.fingerprint != part.signed_by:
            problems.append(f"provenance: {name}: signed by key {key.fingerprint}, the manifest says {part.signed_by}")
    return problems


def verify_bundle(root: Path, trusted_public_key: str | None) -> tuple[EvidenceSigned | None, list[str]]:
    """Every problem of the bundle in `root` (empty: it holds), offline."""
    from nexa import security

    if not root.is_dir():
        return None, [f"{root}: no such directory"]
    try:
        signed = codec.loads(codec.api, _read_bounded(root / MANIFEST, MAX_MANIFEST_BYTES), EvidenceSigned)
    except OSError:
        return None, [f"{MANIFEST}: missing or unreadable"]
    except ContractError as exc:
        return None, [f"{MANIFEST}: not a signed evidence manifest ({exc.message})"]
    problems = [f"{MANIFEST}: {p}" for p in security.verify_signed(signed, trusted_public_key)]
    manifest = signed.manifest
    problems += _file_problems(root, manifest)
    checks, unreadable = recompute(root, manifest)
    problems += unreadable
    for name, value in checks.items():
        claimed = getattr(manifest.checks, name)
        if claimed != value:
            problems.append(
                f"release rule: {name} is {str(value).lower()} from the files, the manifest says {str(claimed).lower()}"
            )
    ready = all(checks.values())
    if manifest.provenance is not None:
        problems += _provenance_problems(root, manifest)
        ready = ready and all(
            p.provenance is Origin.VERIFIED for p in (manifest.provenance.sim, manifest.provenance.gate)
        )
    if manifest.release_ready != ready:
        problems.append(
            f"release rule: release_ready is {str(ready).lower()} from the files, the manifest says"
            f" {str(manifest.release_ready).lower()}"
        )
    qualified = _load_listed(root, manifest, QUALIFICATIONS, QualificationList, problems)
    for q in qualified.qualifications if qualified is not None else []:
        key = trusted_public_key or signed.public_key
        problems += [f"{QUALIFICATIONS}: {q.qualification.id}: {p}" for p in security.verify_qualification(q, key)]
    if (root / AUDIT_HEAD).is_file() and AUDIT_HEAD in {f.path for f in manifest.files}:
        head = _load_listed(root, manifest, AUDIT_HEAD, AuditHead, problems)
        if head is not None and head.checkpoint is not None:
            problems += _audit_head_problems(head.checkpoint, signed, trusted_public_key)
    return signed, problems


def _audit_head_problems(cp: SignedAuditCheckpoint, signed: EvidenceSigned, trusted: str | None) -> list[str]:
    from nexa import security
    from nexa.errors import BadSignature

    try:
        security.verify_audit_checkpoint(security.PublicKey.from_b64(trusted or signed.public_key), cp)
    except (BadSignature, ContractError) as exc:
        return [f"{AUDIT_HEAD}: {exc.message}"]
    m = signed.manifest
    if cp.checkpoint.seq > m.audit_head_seq or (
        cp.checkpoint.seq == m.audit_head_seq and cp.checkpoint.sha256 != m.audit_head_hash
    ):
        return [f"{AUDIT_HEAD}: seq {cp.checkpoint.seq} does not precede the manifest's head {m.audit_head_seq}"]
    return []


def _verify(args: argparse.Namespace) -> int:
    from nexa import security

    trusted = _trusted_key(args.public_key)
    signed, problems = verify_bundle(Path(args.dir), trusted)
    if signed is not None:
        m = signed.manifest
        try:
            key = security.PublicKey.from_b64(signed.public_key).fingerprint
        except ContractError:
            key = "(unreadable)"
        print(f"manifest of {len(m.files)} files, nexa {m.nexa_version}, signed by key {key}")
        print(f"controller fingerprint {m.controller_fingerprint}: compare it with GET /version's")
        if trusted is None:
            print("no --public-key: this proves the bundle is intact, not who signed it")
        if m.provenance is None and m.release_ready:
            print(
                "release_ready: false: the manifest says true, but it records no provenance (signed before it"
                " existed), so its sim and gate are only asserted"
            )
        else:
            print(f"release_ready: {str(m.release_ready).lower()} (sim, benchmarks and gate only)")
        for reason in m.checks.reasons:
            print(f"  - {reason}")
        _print_provenance(m)
        print("real-fleet acceptance: required; human approval: required (the bundle claims neither)")
    if problems:
        for problem in problems:
            print(f"FAIL {problem}", file=sys.stderr)
        print(f"evidence bundle {args.dir}: {len(problems)} problem(s)", file=sys.stderr)
        return EXIT_FAILED
    print(f"evidence bundle {args.dir}: ok (signature, every file's size and sha256, no extra file, release rule)")
    return EXIT_OK
