"""The model registry: runtimes, model versions and their lifecycle, evaluations, aliases.

Authoritative in memory (placement and the gateway read it without touching SQLite), written
through to the store: each change commits first, with its audit event in the same transaction,
and only then changes the in-memory view. Verification is done here, by the controller itself:
the registry is asked for the runtime's manifest, the artifact is streamed from the store and
hashed, and a configured trusted key must have signed its digest. No request can claim a
verdict.

Lifecycle (anything else is `IllegalTransition`, 409, and changes nothing):

    register ─► Candidate ─verify─► Verified ─evaluate(pass)─► Evaluated ─approve─► Approved
                                        ▲                         │
                                        └──── evaluate(fail) ─────┘   (the latest evaluation decides)
    retire: from any state but Retired ─► Retired  (not while an alias points at the version)

A refusal reached by checking a source (registry, store, signature, licence) is audited with
result `rejected`; a request the state machine forbids is not audited (nothing was attempted).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Final

import attrs
import trio

from nexa.config import ModelsConfig
from nexa.contracts.domain import Actor, AuditEvent, AuditResult, EventId
from nexa.contracts.groups import FabricAccess
from nexa.contracts.models import (
    AliasAction,
    AliasPromote,
    AliasReceipt,
    AliasRecord,
    EvaluationCreate,
    EvaluationRecord,
    LicenseRecord,
    LicenseSet,
    ModelArtifact,
    ModelCreate,
    ModelKind,
    ModelRecord,
    ModelRef,
    ModelState,
    RuntimeCreate,
    RuntimeRecord,
    Verification,
    VerifyRequest,
    base_problems,
    evaluation_problems,
    license_problems,
    model_problems,
    name_problem,
    runtime_problems,
    signature_problem,
    version_problem,
)
from nexa.control import store as st
from nexa.control.access.accounts import audit_draft
from nexa.control.registry.gguf_figures import read_figures
from nexa.control.registry.lora import check_adapter_file, check_alias_adapter, check_bases, served_key
from nexa.control.registry.outbound import Outbound
from nexa.errors import (
    AlreadyExists,
    ApprovalRequirementsUnmet,
    ArtifactDigestMismatch,
    BadSignature,
    Conflict,
    ContractError,
    IllegalTransition,
    LicenseInvalid,
    ModelInUse,
    ModelNotApproved,
    NexaError,
    NoRollbackTarget,
    NotFound,
    SignatureRejected,
    Unavailable,
    VerificationFailed,
)
from nexa.security import PublicKey, verify_digest
from nexa.telemetry import Metrics

log = logging.getLogger(__name__)

_S = ModelState
#: Action → the states it may start from.
ALLOWED_FROM: Final[dict[str, frozenset[ModelState]]] = {
    "verify": frozenset({_S.CANDIDATE}),
    "evaluate": frozenset({_S.VERIFIED, _S.EVALUATED}),
    "approve": frozenset({_S.EVALUATED}),
    "retire": frozenset({_S.CANDIDATE, _S.VERIFIED, _S.EVALUATED, _S.APPROVED}),
    "license": frozenset({_S.CANDIDATE, _S.VERIFIED, _S.EVALUATED, _S.APPROVED}),
}
_PAST: Final = {
    "verify": "verified",
    "evaluate": "evaluated",
    "approve": "approved",
    "retire": "retired",
    "license": "relicensed",
}


def _invalid(what: str, problems: list[str]) -> ContractError:
    return ContractError(f"invalid {what}: " + "; ".join(problems), problems=tuple(problems))


class ModelRegistry:
    """Runtimes, models, evaluations and aliases; see the module docstring for the rules."""

    def __init__(
        self,
        cfg: ModelsConfig,
        store: st.Store,
        metrics: Metrics,
        outbound: Outbound,
        *,
        runtimes: list[RuntimeRecord],
        models: list[ModelRecord],
        evaluations: list[EvaluationRecord],
        aliases: list[AliasRecord],
        history: list[AliasReceipt],
    ) -> None:
        self._cfg = cfg
        self._store = store
        self._metrics = metrics
        self._outbound = outbound
        self._trusted_key = PublicKey.from_b64(cfg.trusted_signing_key) if cfg.trusted_signing_key else None
        self._runtimes = {r.name: r for r in runtimes}
        self._models = {(m.name, m.version): m for m in models}
        self._evaluations: defaultdict[tuple[str, str], list[EvaluationRecord]] = defaultdict(list)
        for evaluation in evaluations:
            self._evaluations[(evaluation.model, evaluation.version)].append(evaluation)
        #: Moves on whenever an evaluation is kept or the registry is read again: what is made from
        #: the evaluations (a canary's share while its suite gate waits, `views.serving`) is made again.
        self.evaluations_version = 0
        self._aliases = {a.name: a for a in aliases}
        self._history: defaultdict[str, list[AliasReceipt]] = defaultdict(list)
        for receipt in history:
            self._history[receipt.alias].append(receipt)
        # Serialises every check-then-commit, so two requests never both pass a check on one state.
        # Network checks (registry, store) run outside it.
        self._lock = trio.Lock()
        self._verifying: set[tuple[str, str]] = set()
        self._alias_listeners: list[Callable[[AliasReceipt], None]] = []

    @classmethod
    async def load(cls, cfg: ModelsConfig, store: st.Store, metrics: Metrics, outbound: Outbound) -> ModelRegistry:
        runtimes = await store.run(st.load_runtimes)
        models, evaluations = await store.run(st.load_models)
        aliases, history = await store.run(st.load_aliases)
        return cls(
            cfg,
            store,
            metrics,
            outbound,
            runtimes=runtimes,
            models=models,
            evaluations=evaluations,
            aliases=aliases,
            history=history,
        )

    async def refresh(self) -> None:
        """Re-read runtimes, models, evaluations and aliases that another controller on the store
        changed (`follow.ChangeFeed`). Under the lock every change here takes, so none is undone by
        an older read. Alias listeners are not told: the reconciler compares state, not events."""
        async with self._lock:
            runtimes = await self._store.read(st.load_runtimes)
            models, evaluations = await self._store.read(st.load_models)
            aliases, history = await self._store.read(st.load_aliases)
            self._runtimes = {r.name: r for r in runtimes}
            self._models = {(m.name, m.version): m for m in models}
            self._evaluations = defaultdict(list)
            for evaluation in evaluations:
                self._evaluations[(evaluation.model, evaluation.version)].append(evaluation)
            self.evaluations_version += 1
            self._aliases = {a.name: a for a in aliases}
            self._history = defaultdict(list)
            for receipt in history:
                self._history[receipt.alias].append(receipt)

    async def _audited(self, fn: Callable[..., AuditEvent], *args: object) -> AuditEvent:
        event = await self._store.run(fn, *args)
        self._metrics.audit_events.labels(event.result.value).inc()
        return event

    async def _reject(self, actor: Actor, action: str, target: str, exc: NexaError) -> None:
        """Audit a refusal reached by checking a source; the caller re-raises."""
        draft = audit_draft(
            actor, action, target, result=AuditResult.REJECTED, detail=f"{exc.code}: {exc.message}"[:300]
        )
        await self._audited(st.record_audit, draft)

    # ---- runtimes --------------------------------------------------------------------------------

    def runtimes(self) -> list[RuntimeRecord]:
        return sorted(self._runtimes.values(), key=lambda r: r.name)

    def runtime(self, name: str) -> RuntimeRecord:
        runtime = self._runtimes.get(name)
        if runtime is None:
            raise NotFound(f"no runtime {name}")
        return runtime

    async def register_runtime(self, actor: Actor, req: RuntimeCreate) -> RuntimeRecord:
        """Register a runtime image after its registry confirmed the digest; nothing is kept otherwise."""
        problems = runtime_problems(req)
        if problems:
            raise _invalid("runtime", problems)
        if req.name in self._runtimes:
            raise AlreadyExists(f"runtime {req.name} exists")
        target = f"runtime/{req.name}"
        try:
            manifest = await self._outbound.check_image(req.image)
        except VerificationFailed as exc:
            await self._reject(actor, "runtime.register", target, exc)
            raise
        async with self._lock:
            if req.name in self._runtimes:
                raise AlreadyExists(f"runtime {req.name} exists")
            runtime = RuntimeRecord(
                name=req.name,
                kind=req.kind,
                version=req.version,
                image=req.image,
                media_type=manifest.media_type,
                registered_at=time.time(),
                registered_by=actor.key_id,
                host_network=req.host_network,
                platforms=list(manifest.platforms),
                image_configs=list(manifest.configs),
                fabric=req.fabric,
            )
            # The opt-ins past today's hardening are said in the event itself, besides the record's digest.
            opt_ins = [*(["host network"] if runtime.host_network else []), *_fabric_words(runtime.fabric)]
            draft = audit_draft(actor, "runtime.register", target, None, runtime, detail="; ".join(opt_ins))
            await self._audited(st.insert_runtime, runtime, draft)
            self._runtimes[runtime.name] = runtime
        log.info(
            "runtime %s registered: %s (%s network, fabric %s)",
            runtime.name,
            runtime.image,
            "host" if runtime.host_network else "private",
            runtime.fabric,
        )
        return runtime

    # ---- models: queries -------------------------------------------------------------------------

    def models(self, *, name: str | None = None, state: ModelState | None = None) -> list[ModelRecord]:
        found = (
            m for m in self._models.values() if (name is None or m.name == name) and (state is None or m.state is state)
        )
        return sorted(found, key=lambda m: (m.name, m.registered_at, m.version))

    def model(self, name: str, version: str) -> ModelRecord:
        model = self._models.get((name, version))
        if model is None:
            raise NotFound(f"no model {name}@{version}")
        return model

    def evaluations(self, name: str, version: str) -> list[EvaluationRecord]:
        self.model(name, version)
        return list(self._evaluations.get((name, version), ()))

    def aliases_of(self, name: str, version: str) -> list[str]:
        """The aliases serving the version now: as their model, or as the LoRA adapter on it."""
        ref = ModelRef(model=name, version=version)
        return sorted(a.name for a in self._aliases.values() if ref in (a.target, a.adapter))

    def loras_on(self, base: ModelRef) -> list[tuple[str, ModelRecord]]:
        """The LoRA adapters aliases serve on version `base` now, by alias name: (alias, adapter)
        for each alias pointing at `base` with an Approved adapter. What its replicas load."""
        found = []
        for alias in sorted(self._aliases.values(), key=lambda a: a.name):
            if alias.target == base and alias.adapter is not None:
                adapter = self._models.get((alias.adapter.model, alias.adapter.version))
                if adapter is not None and adapter.state is ModelState.APPROVED:
                    found.append((alias.name, adapter))
        return found

    def lora_set(self, base: ModelRef) -> dict[str, ModelRef]:
        """`loras_on(base)` as a deployment records it (`Deployment.loras`): adapter version by alias."""
        return {alias: ModelRef(model=r.name, version=r.version) for alias, r in self.loras_on(base)}

    # ---- models: lifecycle ----------------------------------------------------------------------

    async def register_model(self, actor: Actor, req: ModelCreate) -> ModelRecord:
        problems = model_problems(req)
        if problem := self._outbound.artifact_problem(req.artifact):
            problems.append(problem)
        if problems:
            raise _invalid("model", problems)
        check_bases(f"{req.name}@{req.version}", req.kind, req.format, req.base, self.model)
        artifact = req.artifact
        if artifact.files:
            # The record carries the manifest as the controller computed it: files in path order,
            # the digest of its canonical bytes and the total; the store must hold every file.
            manifest = artifact.manifest()
            artifact = ModelArtifact(
                uri=artifact.uri,
                sha256=manifest.digest,
                size_bytes=manifest.size_bytes,
                files=list(manifest.files),
                entry=manifest.entry,
            )
            if (req.name, req.version) in self._models:
                raise AlreadyExists(f"model {req.name}@{req.version} exists; register a new version instead")
            try:
                await self._outbound.check_artifact_objects(req.artifact)  # named as the request lists them
            except (VerificationFailed, ArtifactDigestMismatch) as exc:
                await self._reject(actor, "model.register", f"model/{req.name}/{req.version}", exc)
                raise
        now = time.time()
        model = ModelRecord(
            name=req.name,
            version=req.version,
            artifact=artifact,
            format=req.format,
            memory_bytes=req.memory_bytes,
            provenance=req.provenance,
            license=_license_record(req.license, actor, now) if req.license else None,
            signature=req.signature,
            state=ModelState.CANDIDATE,
            registered_at=now,
            registered_by=actor.key_id,
            state_changed_at=now,
            state_changed_by=actor.key_id,
            kind=req.kind,
            base=list(req.base),
        )
        async with self._lock:
            if (model.name, model.version) in self._models:
                raise AlreadyExists(f"model {model.key} exists; register a new version instead")
            check_bases(model.key, model.kind, model.format, model.base, self.model)  # retired meanwhile?
            draft = audit_draft(actor, "model.register", _target(model), None, model)
            await self._audited(st.insert_model, model, draft)
            self._models[(model.name, model.version)] = model
        log.info("model %s registered (Candidate)", model.key)
        return model

    def _allowed(self, model: ModelRecord, action: str) -> None:
        allowed = ALLOWED_FROM[action]
        if model.state not in allowed:
            states = ", ".join(sorted(s.value for s in allowed))
            raise IllegalTransition(
                f"model {model.key} is {model.state.value}; it cannot be {_PAST[action]} (only from {states})",
                model=model.key,
                state=model.state.value,
                action=action,
            )

    async def _commit(
        self, actor: Actor, action: str, before: ModelRecord, after: ModelRecord, detail: str = ""
    ) -> None:
        draft = audit_draft(actor, f"model.{action}", _target(before), before, after, detail=detail)
        await self._audited(st.update_model, after, before.state, draft)
        self._models[(after.name, after.version)] = after

    async def set_license(self, actor: Actor, name: str, version: str, req: LicenseSet) -> ModelRecord:
        problems = license_problems(req, field="(body)")
        if problems:
            raise _invalid("licence", problems)
        async with self._lock:
            before = self.model(name, version)
            self._allowed(before, "license")
            after = attrs.evolve(before, license=_license_record(req, actor, time.time()))
            await self._commit(actor, "license", before, after)
        return after

    async def verify(self, actor: Actor, name: str, version: str, req: VerifyRequest) -> ModelRecord:
        """Candidate → Verified, after the controller streamed and hashed the artifact itself.

        On a mismatch (digest, size, missing object, signature) the model stays Candidate, the
        refusal is audited as `rejected`, and the typed error propagates. A store that cannot be
        reached raises Unavailable and changes nothing.
        """
        if req.signature is not None and (problem := signature_problem("signature", req.signature)):
            raise _invalid("verification request", [problem])
        key = (name, version)
        async with self._lock:
            model = self.model(name, version)
            self._allowed(model, "verify")
            if problem := self._outbound.artifact_problem(model.artifact):
                raise _invalid(f"verification of {model.key}", [problem])
            if key in self._verifying:
                raise Conflict(f"model {model.key} is being verified already")
            self._verifying.add(key)
        try:
            signature = req.signature or model.signature
            try:
                fingerprint = self._check_signature(model, signature)
                with trio.fail_after(self._cfg.verify_timeout_s):
                    check = await self._outbound.verify_artifact(model.artifact)
                    if model.kind is ModelKind.LORA:
                        gguf, gguf_problem = None, ""
                        lora_detail = await check_adapter_file(self._outbound, model, self.model)
                    else:
                        gguf, gguf_problem = await read_figures(self._outbound, model)
                        lora_detail = ""
            except (VerificationFailed, ArtifactDigestMismatch) as exc:
                await self._reject(actor, "model.verify", _target(model), exc)
                log.warning("model %s failed verification: %s", model.key, exc.code)
                raise
            except trio.TooSlowError:
                raise Unavailable(
                    f"verifying {model.key} took longer than models.verify_timeout_s ({self._cfg.verify_timeout_s:g} s)"
                ) from None
            async with self._lock:
                before = self.model(name, version)
                self._allowed(before, "verify")  # retired meanwhile?
                now = time.time()
                after = attrs.evolve(
                    before,
                    signature=signature,
                    state=ModelState.VERIFIED,
                    state_changed_at=now,
                    state_changed_by=actor.key_id,
                    verification=Verification(
                        verified_at=now,
                        verified_by=actor.key_id,
                        sha256=check.sha256,
                        size_bytes=check.size_bytes,
                        signature_key=fingerprint,
                        seconds=round(check.seconds, 3),
                        gguf=gguf,
                        gguf_problem=gguf_problem,
                    ),
                )
                detail = f"sha256 {check.sha256}, {check.size_bytes} bytes" + (
                    f", signed by key {fingerprint}" if fingerprint else ""
                )
                if gguf is not None:
                    detail += f", GGUF {gguf.architecture} of {gguf.context_length} tokens' context"
                elif gguf_problem:
                    detail += ", no GGUF figures (its header could not be read)"
                if lora_detail:
                    detail += f", {lora_detail}"
                await self._commit(actor, "verify", before, after, detail)
        finally:
            self._verifying.discard(key)
        log.info("model %s verified", after.key)
        return after

    def _check_signature(self, model: ModelRecord, signature: str | None) -> str | None:
        """The trusted key's fingerprint when its signature over the digest verifies; None when no key is set."""
        if self._trusted_key is None:
            return None
        if signature is None:
            raise SignatureRejected(
                f"a trusted signing key is configured: {model.key} needs a detached signature over its sha256 digest"
            )
        try:
            verify_digest(self._trusted_key, signature, model.artifact.sha256)
        except BadSignature:
            raise SignatureRejected(
                f"the signature of {model.key} does not verify with the trusted key {self._trusted_key.fingerprint}"
            ) from None
        return self._trusted_key.fingerprint

    async def evaluate(
        self, actor: Actor, name: str, version: str, req: EvaluationCreate
    ) -> tuple[EvaluationRecord, ModelRecord]:
        """Record an evaluation: a pass makes a Verified model Evaluated, a failure makes an Evaluated one Verified."""
        problems = evaluation_problems(req)
        if problems:
            raise _invalid("evaluation", problems)
        async with self._lock:
            before = self.model(name, version)
            self._allowed(before, "evaluate")
            now = time.time()
            evaluation = EvaluationRecord(
                id="eval_" + secrets.token_hex(8),
                model=name,
                version=version,
                suite=req.suite,
                metrics=dict(req.metrics),
                passed=req.passed,
                evidence=req.evidence,
                recorded_at=now,
                recorded_by=actor.key_id,
            )
            state = ModelState.EVALUATED if req.passed else ModelState.VERIFIED
            after = attrs.evolve(before, last_evaluation=evaluation.id)
            if state is not before.state:
                after = attrs.evolve(after, state=state, state_changed_at=now, state_changed_by=actor.key_id)
            detail = f"{evaluation.id} suite {req.suite}: {'passed' if req.passed else 'failed'}"[:300]
            draft = audit_draft(actor, "model.evaluate", _target(before), before, after, detail=detail)
            await self._audited(st.insert_evaluation, evaluation, after, before.state, draft)
            self._models[(name, version)] = after
            self._evaluations[(name, version)].append(evaluation)
            self.evaluations_version += 1
        return evaluation, after

    async def record_measured(self, actor: Actor, evaluation: EvaluationRecord) -> EvaluationRecord | None:
        """Keep a measured evaluation (`nexa eval run`) as `evaluate` keeps an operator's: a pass makes
        a Verified version Evaluated, a failure an Evaluated one Verified; an Approved version keeps
        its state (the record stands beside it). None when the version is retired (nothing kept)."""
        async with self._lock:
            before = self.model(evaluation.model, evaluation.version)
            if before.state is ModelState.RETIRED:
                return None
            now = evaluation.recorded_at
            after = attrs.evolve(before, last_evaluation=evaluation.id)
            if before.state in ALLOWED_FROM["evaluate"]:
                state = ModelState.EVALUATED if evaluation.passed else ModelState.VERIFIED
                if state is not before.state:
                    after = attrs.evolve(after, state=state, state_changed_at=now, state_changed_by=actor.key_id)
            verdict = "passed" if evaluation.passed else "failed"
            detail = f"{evaluation.id} suite {evaluation.suite} measured on {evaluation.deployment}: {verdict}"
            draft = audit_draft(actor, "model.evaluate", _target(before), before, after, detail=detail[:300])
            await self._audited(st.insert_evaluation, evaluation, after, before.state, draft)
            self._models[(evaluation.model, evaluation.version)] = after
            self._evaluations[(evaluation.model, evaluation.version)].append(evaluation)
            self.evaluations_version += 1
        return evaluation

    def unmet_requirements(self, name: str, version: str) -> list[str]:
        """What `[models] approval_requires` asks that the version's newest measured evaluation of
        each suite does not show, one line each (empty: all met)."""
        missing = []
        evaluations = self._evaluations.get((name, version), [])
        for need in self._cfg.approval_requires:
            measured = [e for e in evaluations if e.measured and e.suite == need.suite]
            what = f"suite {need.suite}" + (f" metric {need.metric} >= {need.min:g}" if need.metric else " passed")
            if not measured:
                missing.append(f"{what}: no measured result (run `nexa eval run {need.suite} --deployment ...`)")
                continue
            newest = max(measured, key=lambda e: e.recorded_at)
            if not need.metric:
                if not newest.passed:
                    missing.append(f"{what}: the newest measured run ({newest.run}) failed")
            elif need.metric not in newest.metrics:
                missing.append(f"{what}: the newest measured run ({newest.run}) has no metric {need.metric}")
            elif newest.metrics[need.metric] < need.min:
                got = newest.metrics[need.metric]
                missing.append(f"{what}: the newest measured run ({newest.run}) has {got:g}")
        return missing

    async def approve(self, actor: Actor, name: str, version: str) -> ModelRecord:
        """Evaluated → Approved, only while the licence is accepted and not expired, and with the
        measured results `[models] approval_requires` names."""
        async with self._lock:
            before = self.model(name, version)
            self._allowed(before, "approve")
            now = time.time()
            problem = "it has no licence record" if before.license is None else before.license.problem_at(now)
            if problem is not None:
                exc = LicenseInvalid(f"model {before.key} cannot be approved: {problem}", model=before.key)
                await self._reject(actor, "model.approve", _target(before), exc)
                raise exc
            if missing := self.unmet_requirements(name, version):
                unmet = ApprovalRequirementsUnmet(
                    f"model {before.key} cannot be approved: [models] approval_requires is not met: "
                    + "; ".join(missing),
                    model=before.key,
                    missing=tuple(missing),
                )
                await self._reject(actor, "model.approve", _target(before), unmet)
                raise unmet
            after = attrs.evolve(before, state=ModelState.APPROVED, state_changed_at=now, state_changed_by=actor.key_id)
            await self._commit(actor, "approve", before, after)
        log.info("model %s approved", after.key)
        return after

    async def retire(self, actor: Actor, name: str, version: str) -> ModelRecord:
        async with self._lock:
            before = self.model(name, version)
            self._allowed(before, "retire")
            pointing = self.aliases_of(name, version)
            if pointing:
                raise ModelInUse(
                    f"model {before.key} is the target of alias(es) {', '.join(pointing)}; "
                    "promote or roll them back first",
                    model=before.key,
                    aliases=tuple(pointing),
                )
            after = attrs.evolve(
                before, state=ModelState.RETIRED, state_changed_at=time.time(), state_changed_by=actor.key_id
            )
            await self._commit(actor, "retire", before, after)
        log.info("model %s retired", after.key)
        return after

    # ---- aliases ---------------------------------------------------------------------------------

    def aliases(self) -> list[AliasRecord]:
        return sorted(self._aliases.values(), key=lambda a: a.name)

    def on_alias_change(self, listener: Callable[[AliasReceipt], None]) -> None:
        """Call `listener` (sync, must not block) after every committed alias move."""
        self._alias_listeners.append(listener)

    def alias(self, name: str) -> tuple[AliasRecord, list[AliasReceipt]]:
        alias = self._aliases.get(name)
        if alias is None:
            raise NotFound(f"no alias {name}")
        return alias, list(self._history.get(name, ()))

    def resolve(self, name: str) -> ModelRecord:
        """The Approved model an alias points at now (what routing and placement serve)."""
        alias, _ = self.alias(name)
        model = self.model(alias.target.model, alias.target.version)
        if model.state is not ModelState.APPROVED:
            raise ModelNotApproved(f"alias {name} points at {model.key}, which is {model.state.value}", model=model.key)
        return model

    async def promote(self, actor: Actor, name: str, req: AliasPromote) -> AliasReceipt:
        """Point the alias at an Approved model version, as a new generation."""
        problems = [
            p
            for p in (
                name_problem("alias", name),
                name_problem("model", req.model),
                version_problem("version", req.version),
            )
            if p
        ]
        if req.adapter is not None:  # the same name and version rules as a base's
            problems += [p.replace("base[0]", "adapter") for p in base_problems(ModelKind.LORA, [req.adapter]) if p]
        if problems:
            raise _invalid("promotion", problems)
        async with self._lock:
            model = self.model(req.model, req.version)
            if model.state is not ModelState.APPROVED:
                raise ModelNotApproved(
                    f"alias {name} may point only at an Approved model; {model.key} is {model.state.value}",
                    model=model.key,
                )
            to = ModelRef(model=model.name, version=model.version)
            adapter = check_alias_adapter(name, model, req.adapter, self.model)
            current = self._aliases.get(name)
            if current is not None and (current.target, current.adapter) == (to, adapter):
                # Idempotent: a retried promotion gets the receipt of the one that took effect.
                return self._history[name][-1]
            return await self._move(actor, name, current, to, AliasAction.PROMOTE, adapter=adapter)

    async def rollback(self, actor: Actor, name: str) -> AliasReceipt:
        """Undo the latest promotion not yet rolled back: back to what the alias pointed at before it."""
        async with self._lock:
            current, history = self.alias(name)
            found = _rollback_target(history)
            if found is None:
                raise NoRollbackTarget(f"alias {name} has no earlier promotion to roll back to", alias=name)
            to, adapter = found
            model = self.model(to.model, to.version)
            if model.state is not ModelState.APPROVED:
                raise ModelNotApproved(
                    f"alias {name} would roll back to {model.key}, which is {model.state.value}", model=model.key
                )
            check_alias_adapter(name, model, adapter, self.model)
            return await self._move(actor, name, current, to, AliasAction.ROLLBACK, adapter=adapter)

    async def _move(
        self,
        actor: Actor,
        name: str,
        current: AliasRecord | None,
        to: ModelRef,
        action: AliasAction,
        *,
        adapter: ModelRef | None = None,
    ) -> AliasReceipt:
        now = time.time()
        generation = (current.generation if current else 0) + 1
        after = AliasRecord(
            name=name, target=to, generation=generation, updated_at=now, updated_by=actor.key_id, adapter=adapter
        )
        receipt = AliasReceipt(
            alias=name,
            generation=generation,
            action=action,
            from_=current.target if current else None,
            to=to,
            at=now,
            actor=actor.key_id,
            event_id=EventId(""),
            adapter=adapter,
            from_adapter=current.adapter if current else None,
        )
        detail = f"generation {generation}: {served_key(current) if current else '(none)'} -> {served_key(after)}"
        draft = audit_draft(actor, f"alias.{action.value}", f"alias/{name}", current, after, detail=detail)
        receipt = await self._store.run(st.save_alias, after, current.generation if current else 0, receipt, draft)
        self._metrics.audit_events.labels(AuditResult.OK.value).inc()
        self._aliases[name] = after
        self._history[name].append(receipt)
        log.info("alias %s -> %s (generation %d, %s)", name, to.key, generation, action.value)
        for listener in self._alias_listeners:
            listener(receipt)
        return receipt


def _target(model: ModelRecord) -> str:
    return f"model/{model.name}/{model.version}"


def _license_record(req: LicenseSet, actor: Actor, now: float) -> LicenseRecord:
    return LicenseRecord(
        spdx_id=req.spdx_id,
        terms_sha256=req.terms_sha256,
        accepted_by=req.accepted_by,
        expires_at=req.expires_at,
        recorded_at=now,
        recorded_by=actor.key_id,
    )


def _rollback_target(history: list[AliasReceipt]) -> tuple[ModelRef, ModelRef | None] | None:
    """Replay the history as a stack: a promotion pushes what it replaced (the version and the
    adapter served on it), a rollback pops it."""
    stack: list[tuple[ModelRef, ModelRef | None] | None] = []
    for receipt in history:
        if receipt.action is AliasAction.PROMOTE:
            stack.append(None if receipt.from_ is None else (receipt.from_, receipt.from_adapter))
        elif stack:
            stack.pop()
    return stack[-1] if stack else None


def _fabric_words(fabric: FabricAccess) -> list[str]:
    return [] if fabric is FabricAccess.NONE else [f"fabric {fabric}"]
