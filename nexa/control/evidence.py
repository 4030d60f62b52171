"""Release evidence: the controller's part of `nexa evidence` (`POST /api/v1/evidence`).

The client sends the bundle's files by digest, and the `nexa sim` summary and gate report it
holds; the controller adds what only it knows (its version and fingerprint, the audit head, the
benchmark check from the runs it stored), decides `release_ready`, and signs the manifest
(`security.sign_evidence`; `security.verify_signed` checks it offline). The manifest never
claims acceptance on the real fleet or a human approval.
"""

from __future__ import annotations

import hashlib
import re
import time
from collections.abc import Callable
from typing import Final

from nexa import __version__, security
from nexa.contracts.evidence import EvidenceManifest, EvidenceRequest, EvidenceSigned, ReleaseChecks, StepVerdict
from nexa.control import store as st
from nexa.control.benchmarks import Benchmarks, judge
from nexa.control.deployments import Deployments
from nexa.control.registry import Actor, audit_draft
from nexa.errors import ContractError
from nexa.security import SigningKey
from nexa.telemetry import Metrics

#: The most files one manifest lists, and the longest path of one.
MAX_FILES: Final = 1000
MAX_PATH_CHARS: Final = 255
_SHA256_RE: Final = re.compile(r"[0-9a-f]{64}")
_NO_RUN: Final = "no benchmark recorded: run nexa bench concurrency --deployment NAME against each deployment"


def request_problems(req: EvidenceRequest) -> list[str]:
    """What is wrong with an evidence request's file list (relative paths, each once, sha256 hex)."""
    problems: list[str] = []
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
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._store = store
        self._metrics = metrics
        self._deployments = deployments
        self._benchmarks = benchmarks
        self._signing_key = signing_key
        self._fingerprint = fingerprint
        self._clock = clock

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
            release_ready=sim_passed and benchmarks_ok and gate_clean,
        )
        signed = security.sign_evidence(self._signing_key(), manifest)
        digest = hashlib.sha256(security.evidence_body(manifest)).hexdigest()
        detail = f"release_ready {str(manifest.release_ready).lower()}; {len(req.files)} file(s); manifest {digest}"
        draft = audit_draft(actor, "evidence.sign", f"evidence/{digest[:16]}", None, manifest, detail=detail)
        event = await self._store.run(st.record_audit, draft)
        self._metrics.audit_events.labels(event.result.value).inc()
        return signed
