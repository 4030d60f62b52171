"""Release evidence: benchmark runs, jobs, and the signed evidence manifest. Pure data and validation.

- A **benchmark run** (`BenchRunCreate`) is what `nexa bench` measured through the gateway, as a
  client does, step by step (`BenchPoint`). The controller stores it (`POST /api/v1/benchmarks`),
  judges it against the deployment's `ServiceObjectives` and answers a `BenchRun` with the
  `BenchVerdict` and a recommended concurrency per replica.
- A **job** (`Job`) is long-running work an operator follows in the console's Jobs page: benchmark
  runs and sim campaigns (which their client reports, `JobCreate`/`JobUpdate`), backups and
  rollouts (which the controller records itself).
- An **evidence manifest** (`EvidenceManifest`) lists what a release bundle holds, by digest, and
  the `release_ready` verdict; the controller signs it (`EvidenceSigned`) and `nexa evidence verify`
  checks it offline. It never claims acceptance on the real fleet or a human approval: those stay
  `required`.
- The bundle's other files (`Versions`, `Benchmarks`, `AuditHead`) are defined here too, so the
  format `nexa evidence verify` reads is documented in one place.
- A sim summary or gate report may come **signed** (`SignedSimSummary`, `SignedGateReport`: `nexa
  sim --sign-key`, `builds/release-gate.sh --sign-key`). The controller counts it as `verified` only
  when the signature holds and its key is one it trusts (`[evidence] trusted_report_keys`); anything
  else is `asserted` (`EvidenceProvenance`), and `release_ready` is never true over an asserted part.
"""

from __future__ import annotations

import enum
from typing import Final

import attrs

from nexa.contracts.api import SignedAuditCheckpoint
from nexa.contracts.bounds import MAX_BYTES, MAX_MS, MAX_UNIX_S, finite, whole

#: The most steps one benchmark run records.
MAX_POINTS: Final = 64
#: The longest free-text summary a job carries.
MAX_SUMMARY_CHARS: Final = 500
#: A concurrency or rate step's bound.
MAX_CONCURRENCY: Final = 100_000
#: The most steps of a sim summary, and checks of a gate report, an evidence request may carry ...
MAX_REPORT_ITEMS: Final = 256
#: ... and the largest either may be (its canonical JSON).
MAX_REPORT_BYTES: Final = 256 * 1024


class BenchKind(enum.StrEnum):
    CONCURRENCY = "concurrency"  # closed loop, a sweep 1, 2, 4 … N
    SATURATION = "saturation"  # open loop, rate steps until an objective breaks
    COLD_START = "cold-start"  # deploy → Ready → first token
    LONG_STREAM = "long-stream"
    MIXED = "mixed"  # chat plus embeddings, several tenants


@attrs.frozen(kw_only=True)
class ServiceObjectives:
    """What a deployment promises its clients; a benchmark step meets it when every set figure holds.

    Kept on the deployment (`DeploymentCreate.objectives`); None fields are not checked.
    """

    ttft_p95_ms: float | None = attrs.field(default=None, validator=finite(0, MAX_MS, optional=True))
    tpot_p95_ms: float | None = attrs.field(default=None, validator=finite(0, MAX_MS, optional=True))
    e2e_p95_ms: float | None = attrs.field(default=None, validator=finite(0, MAX_MS, optional=True))
    #: Failed share of requests (0..1) above which a step breaks the objective.
    max_error_rate: float = attrs.field(default=0.01, validator=finite(0, 1))


@attrs.frozen(kw_only=True)
class Percentiles:
    """Milliseconds; None where the step had no sample of it (no stream, no header)."""

    p50: float | None = attrs.field(default=None, validator=finite(0, MAX_MS, optional=True))
    p95: float | None = attrs.field(default=None, validator=finite(0, MAX_MS, optional=True))
    p99: float | None = attrs.field(default=None, validator=finite(0, MAX_MS, optional=True))


@attrs.frozen(kw_only=True)
class BenchPoint:
    """One step of a run: a concurrency (closed loop) or an offered rate (open loop)."""

    concurrency: int | None = attrs.field(default=None, validator=whole(1, MAX_CONCURRENCY, optional=True))
    rate_rps: float | None = attrs.field(default=None, validator=finite(0, MAX_CONCURRENCY, optional=True))
    duration_s: float = attrs.field(validator=finite(0, 86_400))
    requests: int = attrs.field(validator=whole(0, 2**40))
    #: Failed requests by error code (the envelope's `code`, or `transport`, `timeout`).
    errors: dict[str, int] = attrs.Factory(dict)
    ttft_ms: Percentiles = Percentiles()
    tpot_ms: Percentiles = Percentiles()
    e2e_ms: Percentiles = Percentiles()
    #: What the gateway said it added (`x-nexa-overhead-ms`), where it said so.
    overhead_ms: Percentiles = Percentiles()
    tokens_per_s: float = attrs.field(default=0.0, validator=finite(0, 1e9))
    requests_per_s: float = attrs.field(default=0.0, validator=finite(0, 1e9))


@attrs.frozen(kw_only=True)
class BenchRunCreate:
    """What `nexa bench` posts when a run ends."""

    deployment: str
    #: The model name the client called (the deployment's alias or model name).
    model: str
    kind: BenchKind
    started_at: float = attrs.field(validator=finite(0, MAX_UNIX_S))
    duration_s: float = attrs.field(validator=finite(0, 86_400 * 7))
    points: list[BenchPoint] = attrs.Factory(list)
    seed: int | None = attrs.field(default=None, validator=whole(0, 2**63 - 1, optional=True))
    #: `cold-start` only: seconds from the deploy request to Ready, and to the first token.
    cold_start_ready_s: float | None = attrs.field(default=None, validator=finite(0, 86_400, optional=True))
    cold_start_first_token_s: float | None = attrs.field(default=None, validator=finite(0, 86_400, optional=True))
    #: The least memory available on the deployment's nodes during the run (from `GET /api/v1/nodes`).
    memory_headroom_bytes: int | None = attrs.field(default=None, validator=whole(0, MAX_BYTES, optional=True))
    #: The job this run reported its progress to (`POST /api/v1/jobs`), finished by this post.
    job: str | None = None
    client_version: str = ""


@attrs.frozen(kw_only=True)
class BenchVerdict:
    meets_objectives: bool
    #: What broke, step by step ("c=16: ttft p95 812 ms > 500 ms"); empty when it meets them.
    broken: list[str] = attrs.Factory(list)
    #: The largest concurrency per replica whose step met every objective; None: no step did.
    recommended_concurrency: int | None = None


@attrs.frozen(kw_only=True)
class BenchRun:
    """A stored run: what was posted, the objectives it was judged against, and the verdict."""

    id: str
    recorded_at: float
    recorded_by: str
    replicas: int
    objectives: ServiceObjectives
    verdict: BenchVerdict
    run: BenchRunCreate


@attrs.frozen(kw_only=True)
class BenchRunList:
    runs: list[BenchRun]
    next_cursor: str | None = None


class JobKind(enum.StrEnum):
    BENCHMARK = "benchmark"
    SIM = "sim"
    BACKUP = "backup"
    ROLLOUT = "rollout"
    #: A runtime qualification (`nexa runtimes qualify`), run by the controller.
    QUALIFICATION = "qualification"
    #: An evaluation run (`nexa eval run`), reported by the CLI as a benchmark is.
    EVAL = "eval"


class JobState(enum.StrEnum):
    RUNNING = "running"
    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"


@attrs.frozen(kw_only=True)
class JobCreate:
    """A client-run job (`benchmark` or `sim`; backups and rollouts are recorded by the controller)."""

    kind: JobKind
    #: What it is about, for the list: "bench concurrency chat 1..32", "sim seed 7".
    title: str


@attrs.frozen(kw_only=True)
class JobUpdate:
    state: JobState = JobState.RUNNING
    #: Share done, 0..1; None: unknown.
    progress: float | None = attrs.field(default=None, validator=finite(0, 1, optional=True))
    summary: str = ""
    #: The API path of its record once there is one (`/api/v1/benchmarks/{id}`).
    link: str | None = None


@attrs.frozen(kw_only=True)
class Job:
    id: str
    kind: JobKind
    title: str
    state: JobState
    progress: float | None
    started_at: float
    #: None while running.
    finished_at: float | None
    updated_at: float
    summary: str = ""
    link: str | None = None


@attrs.frozen(kw_only=True)
class JobList:
    jobs: list[Job]
    next_cursor: str | None = None


class Requirement(enum.StrEnum):
    """A condition of a release the bundle cannot prove and never claims."""

    REQUIRED = "required"


@attrs.frozen(kw_only=True)
class EvidenceFile:
    """One file of the bundle, by its path inside the bundle directory."""

    path: str
    sha256: str
    size: int = attrs.field(validator=whole(0, MAX_BYTES))


@attrs.frozen(kw_only=True)
class ReleaseChecks:
    """The three facts `release_ready` is made of, each with why."""

    sim_passed: bool
    benchmarks_meet_objectives: bool
    gate_clean: bool
    reasons: list[str] = attrs.Factory(list)


@attrs.frozen(kw_only=True)
class EvidenceManifest:
    """The bundle's table of contents, signed by the controller (`security.sign`, kind `nexa-evidence-v1`)."""

    created_at: float
    nexa_version: str
    controller_fingerprint: str
    audit_head_seq: int
    audit_head_hash: str
    files: list[EvidenceFile]
    checks: ReleaseChecks
    release_ready: bool
    #: Always both `required`: the bundle proves neither.
    real_fleet_acceptance: Requirement = Requirement.REQUIRED
    human_approval: Requirement = Requirement.REQUIRED
    statement: str = (
        "release_ready covers the simulation, the benchmarks and the release gate only. Acceptance on "
        "the real fleet and a named human approval are still required; this bundle does not claim them."
    )
    #: Where the sim summary and the gate report come from. None: a manifest signed before
    #: provenance existed; it reads as both asserted, never as ready (and its signature leaves it out).
    provenance: EvidenceProvenance | None = None


class Origin(enum.StrEnum):
    """Where a part of `release_ready` comes from."""

    #: Signed by a key the controller trusts (`[evidence] trusted_report_keys`), and the signature holds.
    VERIFIED = "verified"
    #: The client's word only: unsigned, signed by a key the controller does not trust, or changed after signing.
    ASSERTED = "asserted"
    #: Not given.
    ABSENT = "absent"


@attrs.frozen(kw_only=True)
class ReportSignature:
    """A detached Ed25519 signature over a sim summary's or gate report's canonical JSON (API
    form), with kind `nexa-sim-report-v1` or `nexa-gate-report-v1` (`security.sign_report`)."""

    #: The signer's Ed25519 public key (base64 of the raw 32 bytes).
    public_key: str
    #: base64 of the 64-byte signature.
    signature: str


@attrs.frozen(kw_only=True)
class PartProvenance:
    provenance: Origin
    #: `verified`: the signature the controller checked (`nexa evidence verify` checks it again
    #: against the bundle's file).
    signature: ReportSignature | None = None
    #: The signing key's fingerprint, where the part was signed.
    signed_by: str = ""
    #: Why it is only asserted, and what to do.
    note: str = ""


@attrs.frozen(kw_only=True)
class EvidenceProvenance:
    """Per part of `release_ready`: `release_ready` needs both `verified`."""

    sim: PartProvenance
    gate: PartProvenance


@attrs.frozen(kw_only=True)
class EvidenceSigned:
    manifest: EvidenceManifest
    #: base64 Ed25519 over the manifest's canonical JSON, with kind `nexa-evidence-v1`.
    signature: str
    #: The controller's Ed25519 public key (base64), as `GET /version` names its fingerprint.
    public_key: str


class StepVerdict(enum.StrEnum):
    PASS = "pass"  # noqa: S105 (a verdict, not a password)
    FAIL = "fail"
    SKIPPED = "skipped"  # not picked by `--steps`, or after a step it needs failed


@attrs.frozen(kw_only=True)
class SimStep:
    name: str
    verdict: StepVerdict
    duration_s: float = attrs.field(validator=finite(0, 86_400))
    #: The step's figures (requests sent, failed, retried, p95 ms …): numbers and short strings.
    figures: dict[str, float | int | str] = attrs.Factory(dict)
    #: Why it failed (what was expected and what was seen); empty when it passed.
    detail: str = ""


@attrs.frozen(kw_only=True)
class SimSummary:
    """What `nexa sim --json FILE` writes; `passed` only when every step picked passed."""

    passed: bool
    nexa_version: str
    seed: int
    started_at: float
    duration_s: float
    steps: list[SimStep]


@attrs.frozen(kw_only=True)
class GateCheck:
    name: str
    ok: bool
    #: One line: what it checked, or what it found.
    detail: str = ""


@attrs.frozen(kw_only=True)
class GateReport:
    """What `builds/release-gate.sh --json FILE` writes; `clean` only when every check is ok."""

    clean: bool
    checks: list[GateCheck]
    started_at: float
    duration_s: float


@attrs.frozen(kw_only=True)
class SignedSimSummary:
    """What `nexa sim --json FILE --sign-key KEY` writes (`nexa evidence --sim` takes it or a bare `SimSummary`)."""

    summary: SimSummary
    signature: ReportSignature


@attrs.frozen(kw_only=True)
class SignedGateReport:
    """What `builds/release-gate.sh --json FILE --sign-key KEY` writes (`nexa evidence --gate` takes
    it or a bare `GateReport`)."""

    report: GateReport
    signature: ReportSignature


@attrs.frozen(kw_only=True)
class EvidenceRequest:
    """`POST /api/v1/evidence`: the client's parts; the controller adds its own and signs.

    The controller fills in the version, its fingerprint, the audit head and the benchmark check
    (from the runs it stored: the latest of each deployment and kind must meet its objectives),
    and decides `release_ready` from `sim`, `gate` and that check.
    """

    sim: SimSummary | None = None
    gate: GateReport | None = None
    #: Every file of the bundle the client wrote, by digest (the manifest lists them).
    files: list[EvidenceFile] = attrs.Factory(list)
    #: `sim`'s signature (`SignedSimSummary.signature`); without it the summary is only asserted.
    sim_signature: ReportSignature | None = None
    #: `gate`'s signature (`SignedGateReport.signature`); without it the report is only asserted.
    gate_signature: ReportSignature | None = None


# --- the files of a release-evidence bundle (`nexa evidence --out DIR`) besides the summaries above ---


@attrs.frozen(kw_only=True)
class RuntimeImage:
    """A registered runtime's image, by the digest the registry confirmed."""

    runtime: str
    kind: str
    version: str
    image: str
    digest: str


@attrs.frozen(kw_only=True)
class ModelVersion:
    """A model version and the digest of its artifact (a manifest's, or one object's)."""

    name: str
    version: str
    state: str
    artifact_sha256: str
    artifact_size_bytes: int


@attrs.frozen(kw_only=True)
class Versions:
    """`versions.json`."""

    nexa_version: str
    #: The released executable: its file name only (never the directory it was found in).
    binary: EvidenceFile | None
    #: Why `binary` is None (not a frozen executable and no `--binary`).
    binary_note: str = ""
    runtimes: list[RuntimeImage] = attrs.Factory(list)
    models: list[ModelVersion] = attrs.Factory(list)


@attrs.frozen(kw_only=True)
class DeploymentObjectives:
    """What a deployment promises now, and over how many replicas (what its runs are judged by)."""

    name: str
    replicas: int
    objectives: ServiceObjectives


@attrs.frozen(kw_only=True)
class Benchmarks:
    """`benchmarks.json`: the stored runs (newest first) and what each deployment promises now."""

    runs: list[BenchRun]
    deployments: list[DeploymentObjectives]


@attrs.frozen(kw_only=True)
class AuditHead:
    """`audit-head.json`."""

    checkpoint: SignedAuditCheckpoint | None
    note: str = ""
