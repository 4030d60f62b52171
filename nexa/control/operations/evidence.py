"""Release evidence: the controller's part of `nexa evidence` (`POST /api/v1/evidence`).

The client sends the bundle's files by digest, and the `nexa sim` summary and gate report it
holds; the controller adds what only it knows (its version and fingerprint, the audit head, the
benchmark check from the runs it stored), decides `release_ready`, and signs the manifest
(`security.sign_evidence`; `security.verify_signed` checks it offline). The manifest never
claims acceptance on the real fleet or a human approval.

The controller does not take the client's word for the sim and the gate: each is `verified` only
when it comes with a signature that holds by a key in `[evidence] trusted_report_keys` (the
release pipeline's, `nexa sim --sign-key`, `release-gate.sh --sign-key`). Anything else (no
signature, another key, a report changed after signing) is recorded and signed as `asserted`,
with why, and `release_ready` is false. A malformed signature or an oversize report is refused.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable, Sequence
from typing import Final

from nexa import __version__, security
from nexa.contracts.domain import Actor
from nexa.contracts.evidence import (
    MAX_REPORT_BYTES,
    MAX_REPORT_ITEMS,
    EvidenceManifest,
    EvidenceProvenance,
    EvidenceRequest,
    EvidenceSigned,
    GateReport,
    Origin,
    PartProvenance,
    ReleaseChecks,
    ReportSignature,
    SimSummary,
    StepVerdict,
)
from nexa.control import store as st
from nexa.control.access.accounts import audit_draft
from nexa.control.deployments import Deployments
from nexa.control.operations.benchmarks import Benchmarks, judge
from nexa.errors import BadSignature, ContractError
from nexa.security import PublicKey, SigningKey
from nexa.telemetry import Metrics

#: The most files one manifest lists, and the longest path of one.
MAX_FILES: Final = 1000
MAX_PATH_CHARS: Final = 255
_SHA256_RE: Final = re.compile(r"[0-9a-f]{64}")
_SIGNED_RUN: Final = {
    "sim": "nexa sim --json FILE --sign-key KEY",
    "gate": "builds/release-gate.sh --json FILE --sign-key KEY",
}
_NO_RUN: Final = "no benchmark recorded: run nexa bench concurrency --deployment NAME against each deployment"


def _report_problems(
    name: str, report: SimSummary | GateReport | None, items: int, signature: ReportSignature | None
) -> list[str]:
    """What is wrong with a report's size, or its signature's form (whether it holds is checked later)."""
    problems: list[str] = []
    if report is None:
        if signature is not None:
            problems.append(f"{name}_signature: a signature without its {name} report")
        return problems
    if items > MAX_REPORT_ITEMS:
        problems.append(f"{name}: at most {MAX_REPORT_ITEMS} steps or checks")
    else:
        try:
            size = len(security.report_body(report))
        except ValueError:
            size = 0
            problems.append(f"{name}: holds a number JSON cannot carry")
        if size > MAX_REPORT_BYTES:
            problems.append(f"{name}: at most {MAX_REPORT_BYTES} bytes of JSON, this is {size}")
    if signature is not None:
        try:
            security.parse_report_signature(signature)
        except ContractError as exc:
            problems.append(f"{name}_signature: {exc.message} (write the report again with --sign-key)")
    return problems


def request_problems(req: EvidenceRequest) -> list[str]:
    """What is wrong with an evidence request: its file list (relative paths, each once, sha256
    hex), an oversize report, a malformed signature."""
    problems = _report_problems("sim", req.sim, len(req.sim.steps) if req.sim else 0, req.sim_signature)
    problems += _report_problems("gate", req.gate, len(req.gate.checks) if req.gate else 0, req.gate_signature)
    if len(req.files) > MAX_FILES:
        problems.append(f"files: at most {MAX_FILES}")
    seen: set[str] = set()
    for i, f in enumerate(req.files[:MAX_FILES]):
        parts = f.path.split("/")
        if (
            not f.path
            or len(f.path) > MAX_PATH_CHARS
            or not f.path.isprintable()
            or f.path.startswith("/")
            or any(p in {"", ".", ".."} for p in parts)
            or "\\" in f.path
        ):
            problems.append(f"files[{i}].path: a relative path inside the bundle (no .., at most {MAX_PATH_CHARS})")
        elif f.path in seen:
            problems.append(f"files[{i}].path: {f.path} is listed twice")
        seen.add(f.path)
        if not _SHA256_RE.fullmatch(f.sha256):
            problems.append(f"files[{i}].sha256: 64 lowercase hex digits")
    return problems


class Evidence:
    """Builds and signs release-evidence manifests (see the module docstring)."""

    def __init__(
        self,
        store: st.Store,
        metrics: Metrics,
        deployments: Deployments,
        benchmarks: Benchmarks,
        *,
        signing_key: Callable[[], SigningKey],
        fingerprint: Callable[[], str],
        report_keys: Sequence[str] = (),
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._metrics = metrics
        self._deployments = deployments
        self._benchmarks = benchmarks
        self._signing_key = signing_key
        self._fingerprint = fingerprint
        self._clock = clock
        self._report_keys = frozenset(PublicKey.from_b64(k) for k in report_keys)

    def provenance(
        self, name: str, report: SimSummary | GateReport | None, signed: ReportSignature | None
    ) -> PartProvenance:
        """Whether `report` is verified (a trusted key's signature holds over it) or only asserted, and why."""
        flag = _SIGNED_RUN[name]
        if report is None:
            return PartProvenance(provenance=Origin.ABSENT)
        if signed is None:
            return PartProvenance(
                provenance=Origin.ASSERTED,
                note=f"the {name} report is not signed: write it with {flag}, a key in [evidence] trusted_report_keys",
            )
        key, _ = security.parse_report_signature(signed)  # its form was checked by request_problems
        if key not in self._report_keys:
            return PartProvenance(
                provenance=Origin.ASSERTED,
                signed_by=key.fingerprint,
                note=f"the {name} report is signed by key {key.fingerprint}, which this controller does not trust:"
                " add its public key to [evidence] trusted_report_keys, or sign with a trusted one",
            )
        try:
            security.verify_report(signed, report)
        except BadSignature:
            return PartProvenance(
                provenance=Origin.ASSERTED,
                signed_by=key.fingerprint,
                note=f"the {name} report's signature by key {key.fingerprint} does not verify: the report was"
                f" changed after it was signed; run it again with {flag}",
            )
        return PartProvenance(provenance=Origin.VERIFIED, signature=signed, signed_by=key.fingerprint)

    async def benchmark_check(self) -> tuple[bool, list[str]]:
        """Whether every deployment's latest run of each kind meets the deployment's objectives now."""
        objectives = {v.deployment.name: v.deployment for v in self._deployments.all()}
        runs = [r for r in await self._benchmarks.latest() if r.run.deployment in objectives]
        if not runs:
            return False, [_NO_RUN]
        reasons = []
        for run in runs:
            dep = objectives[run.run.deployment]
            verdict = judge(dep.objectives, dep.replicas, run.run.points)
            if not verdict.meets_objectives:
                shown = "; ".join(verdict.broken[:3]) + ("; …" if len(verdict.broken) > 3 else "")
                reasons.append(f"benchmark {run.id} ({run.run.kind.value} on {run.run.deployment}) breaks: {shown}")
        return not reasons, reasons

    async def sign(self, actor: Actor, req: EvidenceRequest) -> EvidenceSigned:
        """The signed manifest of `req` (400 with what is wrong; nothing is recorded then)."""
        if problems := request_problems(req):
            raise ContractError("invalid evidence request: " + "; ".join(problems), problems=tuple(problems))
        benchmarks_ok, reasons = await self.benchmark_check()
        sim_passed = req.sim is not None and req.sim.passed
        if req.sim is None:
            reasons.append("no nexa sim summary given: run nexa sim --json FILE and pass --sim FILE")
        elif not req.sim.passed:
            failed = [s.name for s in req.sim.steps if s.verdict is StepVerdict.FAIL]
            reasons.append("nexa sim did not pass" + (f": {', '.join(failed[:8])} failed" if failed else ""))
        gate_clean = req.gate is not None and req.gate.clean
        if req.gate is None:
            reasons.append("no release-gate report given: run builds/release-gate.sh --json FILE and pass --gate FILE")
        elif not req.gate.clean:
            failed = [c.name for c in req.gate.checks if not c.ok]
            reasons.append("the release gate is not clean" + (f": {', '.join(failed[:8])} failed" if failed else ""))
        provenance = EvidenceProvenance(
            sim=self.provenance("sim", req.sim, req.sim_signature),
            gate=self.provenance("gate", req.gate, req.gate_signature),
        )
        parts = (provenance.sim, provenance.gate)
        reasons += [f"asserted, not verified: {p.note}" for p in parts if p.provenance is Origin.ASSERTED]
        verified = all(p.provenance is Origin.VERIFIED for p in parts)
        seq, head = await self._store.run(st.audit_head)
        checks = ReleaseChecks(
            sim_passed=sim_passed, benchmarks_meet_objectives=benchmarks_ok, gate_clean=gate_clean, reasons=reasons
        )
        manifest = EvidenceManifest(
            created_at=self._clock(),
            nexa_version=__version__,
            controller_fingerprint=self._fingerprint(),
            audit_head_seq=seq,
            audit_head_hash=head,
            files=list(req.files),
            checks=checks,
            release_ready=sim_passed and benchmarks_ok and gate_clean and verified,
            provenance=provenance,
        )
        signed = security.sign_evidence(self._signing_key(), manifest)
        digest = hashlib.sha256(security.evidence_body(manifest)).hexdigest()
        detail = (
            f"release_ready {str(manifest.release_ready).lower()}; sim {provenance.sim.provenance.value}, gate"
            f" {provenance.gate.provenance.value}; {len(req.files)} file(s); manifest {digest}"
        )
        draft = audit_draft(actor, "evidence.sign", f"evidence/{digest[:16]}", None, manifest, detail=detail)
        event = await self._store.run(st.record_audit, draft)
        self._metrics.audit_events.labels(event.result.value).inc()
        return signed
