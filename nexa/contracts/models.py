"""The registry's vocabulary: runtimes, models (licence, provenance, lifecycle), evaluations,
aliases with their receipts, and the HTTP bodies that create and change them. Pure data.

The `*_problems` functions check a request and name every bad field (`field: problem`); the
controller calls them before it changes anything. Records are minted by the controller only:
no request body carries a state, a verification or a timestamp of its own.
"""

from __future__ import annotations

import enum
import math
import re
from typing import ClassVar, Final
from urllib.parse import urlparse

import attrs

from nexa.contracts.domain import NAME_RE, EventId, KeyId
from nexa.contracts.groups import FabricAccess
from nexa.contracts.kvcache import GgufFigures
from nexa.contracts.manifest import ArtifactLocation, manifest_problems
from nexa.contracts.node import RuntimeKind
from nexa.contracts.runtime import IMAGE_BY_DIGEST_RE, SHA256_RE

#: Versions people choose: `v1`, `2024.06`, `1.2.0-rc1`, `Q4_K_M`. Safe in a URL path segment.
VERSION_RE: Final = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,62}[A-Za-z0-9])?$")
#: An SPDX licence identifier or expression: `Apache-2.0`, `MIT OR Apache-2.0`, `LicenseRef-acme`.
SPDX_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.+:() -]{0,127}$")
#: Metric names in an evaluation record: `accuracy`, `mmlu.5shot`, `latency_p95_ms`.
METRIC_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:/-]{0,63}$")
#: S3 bucket names (path-style addressing).
_BUCKET_RE: Final = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_SIGNATURE_B64_RE: Final = re.compile(r"^[A-Za-z0-9+/]{86}==$")  # 64 bytes in standard base64
MAX_METRICS: Final = 100
#: The most base model versions one LoRA adapter may name.
MAX_LORA_BASES: Final = 16
#: Far beyond any model, small enough for every JSON reader (2^53).
MAX_BYTES: Final = 2**53


class ModelState(enum.StrEnum):
    """A model version's lifecycle: Candidate → Verified → Evaluated → Approved, and Retired from any."""

    CANDIDATE = "Candidate"
    VERIFIED = "Verified"
    EVALUATED = "Evaluated"
    APPROVED = "Approved"
    RETIRED = "Retired"


class ModelKind(enum.StrEnum):
    """What a model version is. `model`: weights a runtime serves on their own; `lora`: a LoRA
    adapter, served only on a replica of one of the base versions it names (`ModelCreate.base`),
    loaded by the runtime beside them (`nexa.contracts.lora`)."""

    MODEL = "model"
    LORA = "lora"


class ModelFormat(enum.StrEnum):
    """How the model's bytes are laid out. `safetensors`: a Hugging Face directory (vLLM, SGLang);
    `gguf`: one GGUF file or a split GGUF's shards (llama.cpp); `tensorrt`: an engine or checkpoint
    directory; `tar`: an archive, mounted as the one file it is (nothing unpacks it: push the
    directory itself with `nexa models push`); `ggml`: a whisper.cpp model file (`ggml-*.bin`).
    stable-diffusion.cpp takes one checkpoint file (`gguf` or `safetensors`, told apart by its
    content) or a diffusers directory (`safetensors`, a manifest)."""

    GGUF = "gguf"
    SAFETENSORS = "safetensors"
    ONNX = "onnx"
    TENSORRT = "tensorrt"
    TAR = "tar"
    GGML = "ggml"


# --- runtimes ------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ImagePlatform:
    """One platform an image offers, as OCI names it: `linux/arm64/v8` is os, architecture, variant."""

    os: str
    architecture: str
    variant: str = ""

    def __str__(self) -> str:
        return "/".join(p for p in (self.os, self.architecture, self.variant) if p)


@attrs.frozen(kw_only=True)
class ImageConfig:
    """What one platform's image config says runs (the OCI image config's `config` object), as the
    registry served it by digest when the runtime was registered. Empty fields: the image sets none."""

    platform: ImagePlatform
    #: `Entrypoint`: what a container runs before its command unless the entrypoint is set.
    entrypoint: list[str] = attrs.Factory(list)
    #: `Cmd`: the default arguments (nexa always replaces them).
    cmd: list[str] = attrs.Factory(list)
    #: `User` (`uid`, `uid:gid` or a name); "": root.
    user: str = ""
    #: `Env`, `NAME=value` each, in the image's order.
    env: list[str] = attrs.Factory(list)
    working_dir: str = ""
    #: `ExposedPorts`' keys (`8080/tcp`), sorted.
    exposed_ports: list[str] = attrs.Factory(list)

    def env_value(self, name: str) -> str | None:
        """The image's value of environment variable `name`, None if it sets none."""
        for item in self.env:
            key, sep, value = item.partition("=")
            if sep and key == name:
                return value
        return None


@attrs.frozen(kw_only=True)
class RuntimeCreate:
    name: str
    kind: RuntimeKind
    version: str
    #: `registry/repository@sha256:<64 hex>`; the controller checks the registry holds it.
    image: str
    #: Run this runtime's containers in the node's own network namespace instead of one of their
    #: own (they can then bind any node address and reach whatever the node reaches). An explicit,
    #: audited opt-in, for runtimes that need it (e.g. multi-node collectives); off by default.
    host_network: bool = False
    #: What a replica group's containers of this runtime get to use the fabric between its nodes
    #: (`contracts.groups.FabricAccess`): `tcp` the node's network namespace and a larger /dev/shm,
    #: `rdma` also the node's RDMA devices, IPC_LOCK and unlimited locked memory. An explicit,
    #: audited opt-in; `none` by default, and never for a replica on one node.
    fabric: FabricAccess = FabricAccess.NONE


@attrs.frozen(kw_only=True)
class RuntimeRecord:
    """An approved model server image, pinned by the digest its registry confirmed."""

    name: str
    kind: RuntimeKind
    version: str
    image: str
    #: The manifest's media type as the registry reported it when the digest was checked.
    media_type: str
    registered_at: float
    registered_by: KeyId | None
    #: See RuntimeCreate.host_network: False means each container gets its own network namespace.
    host_network: bool = False
    #: The platforms the image's index (or its single manifest's config) names, as the registry
    #: served them when the digest was checked. Empty: unknown (records from before platforms
    #: were read), which filters no node.
    platforms: list[ImagePlatform] = attrs.Factory(list)
    #: What each platform's image config says runs (entrypoint, command, user, env, working
    #: directory, exposed ports), read from the registry at registration. Empty: unknown (records
    #: from before configs were read); the adapter's program is then set as the entrypoint as is.
    image_configs: list[ImageConfig] = attrs.Factory(list)
    #: See RuntimeCreate.fabric (records from before it: none).
    fabric: FabricAccess = FabricAccess.NONE

    def image_config(self, arch: str | None = None) -> ImageConfig | None:
        """The image config of the linux platform with architecture `arch` (any, if None or none
        matches: the first); None when no config is known."""
        linux = [c for c in self.image_configs if c.platform.os == "linux"] or list(self.image_configs)
        for config in linux:
            if arch is not None and config.platform.architecture == arch:
                return config
        return linux[0] if linux else None

    @property
    def image_archs(self) -> tuple[str, ...] | None:
        """The architectures a (Linux) node needs to run the image, for placement; None: no filter.

        None when the platforms are unknown, and for `sim`, which runs as a process on the node,
        never from its (placeholder) image. An image with no linux platform gives `()`: no node.
        """
        if not self.platforms or self.kind is RuntimeKind.SIM:
            return None
        return tuple(sorted({p.architecture for p in self.platforms if p.os == "linux"}))


@attrs.frozen(kw_only=True)
class RuntimeRegistered(RuntimeRecord):
    """The answer to registering a runtime: the record, and what the operator should know now
    (for example that no enrolled node has an architecture the image offers)."""

    warnings: list[str] = attrs.Factory(list)


@attrs.frozen(kw_only=True)
class RuntimeList:
    runtimes: list[RuntimeRecord]


# --- models --------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ModelArtifact(ArtifactLocation):
    """The artifact a model version claims: the files of a manifest under an S3 prefix, or one
    object; `sha256` is the manifest's digest (the object's own for one object), `size_bytes`
    the total. In a request with `files`, both may be left out: the controller computes them."""


@attrs.frozen(kw_only=True)
class Provenance:
    """Where the weights came from (a URL, a hub revision, a training run) and who signed them."""

    source: str
    signer: str = ""


@attrs.frozen(kw_only=True)
class LicenseSet:
    """A licence as an operator records it: an SPDX id or the sha256 of custom terms (exactly one)."""

    spdx_id: str | None = None
    terms_sha256: str | None = None
    #: Who accepted the terms for this organisation (a person or a ticket); unset: not accepted yet.
    accepted_by: str | None = None
    #: Unix seconds; unset: the acceptance does not expire.
    expires_at: float | None = None


@attrs.frozen(kw_only=True)
class LicenseRecord:
    spdx_id: str | None
    terms_sha256: str | None
    accepted_by: str | None
    expires_at: float | None
    recorded_at: float
    recorded_by: KeyId | None

    def problem_at(self, now: float) -> str | None:
        """Why this licence does not allow use at `now`, or None when it does."""
        if not self.accepted_by:
            return "its licence has not been accepted (accepted_by is not set)"
        if self.expires_at is not None and self.expires_at <= now:
            return "its licence acceptance has expired"
        return None


@attrs.frozen(kw_only=True)
class Verification:
    """What the controller itself established about the artifact (never taken from a request)."""

    verified_at: float
    verified_by: KeyId | None
    sha256: str
    size_bytes: int
    #: Fingerprint of the trusted key whose signature over the digest verified; None: no key is configured.
    signature_key: str | None
    seconds: float
    #: A GGUF model's attention figures, read from its (entry) file's header once the bytes
    #: verified: what llama.cpp's context is sized by on unified-memory nodes. None: not a GGUF
    #: model, or `gguf_problem` says why they could not be read.
    gguf: GgufFigures | None = None
    gguf_problem: str = ""


@attrs.frozen(kw_only=True)
class ModelCreate:
    name: str
    version: str
    artifact: ModelArtifact
    format: ModelFormat
    #: Memory to schedule against: weights plus the runtime's overhead (KV cache, activations).
    memory_bytes: int
    provenance: Provenance
    license: LicenseSet | None = None
    #: Detached Ed25519 signature (base64) over the artifact's 32-byte sha256 digest.
    signature: str | None = None
    #: `lora`: a LoRA adapter for the base versions in `base` (each registered, of kind `model`,
    #: in the adapter's format, not retired), else refused (422 `lora_base_invalid`).
    kind: ModelKind = ModelKind.MODEL
    #: A LoRA adapter's base model versions (1..`MAX_LORA_BASES`); empty for a model.
    base: list[ModelRef] = attrs.Factory(list)


@attrs.frozen(kw_only=True)
class ModelRecord:
    name: str
    version: str
    artifact: ModelArtifact
    format: ModelFormat
    memory_bytes: int
    provenance: Provenance
    license: LicenseRecord | None
    signature: str | None
    state: ModelState
    registered_at: float
    registered_by: KeyId | None
    #: When the state last changed, and who changed it (None: the controller itself).
    state_changed_at: float
    state_changed_by: KeyId | None
    verification: Verification | None = None
    #: The evaluation that decided the current Evaluated/Verified state, if any.
    last_evaluation: str | None = None
    #: See ModelCreate.kind and ModelCreate.base (records from before adapters: a model, no base).
    kind: ModelKind = ModelKind.MODEL
    base: list[ModelRef] = attrs.Factory(list)

    @property
    def key(self) -> str:
        return f"{self.name}@{self.version}"


@attrs.frozen(kw_only=True)
class ModelList:
    models: list[ModelRecord]


@attrs.frozen(kw_only=True)
class VerifyRequest:
    """Ask the controller to verify the artifact itself. Carries no verdict, only an optional signature."""

    signature: str | None = None


@attrs.frozen(kw_only=True)
class EvaluationCreate:
    suite: str
    metrics: dict[str, float]
    passed: bool
    #: Where the full results are kept (a URL, an object key, a ticket).
    evidence: str = ""


@attrs.frozen(kw_only=True)
class EvaluationRecord:
    id: str
    model: str
    version: str
    suite: str
    metrics: dict[str, float]
    passed: bool
    evidence: str
    recorded_at: float
    recorded_by: KeyId | None
    #: Measured by nexa (`nexa eval run`: the suite run through the gateway), not an operator's word.
    measured: bool = False
    #: Measured: the suite file's sha256, the deployment it ran against, and the run (`nexa eval show`).
    suite_digest: str = ""
    deployment: str = ""
    run: str = ""
    #: Measured against the new replicas of the deployment's rollout alone (`nexa eval run --rollout`).
    rollout: bool = False


@attrs.frozen(kw_only=True)
class EvaluationResult:
    evaluation: EvaluationRecord
    model: ModelRecord


@attrs.frozen(kw_only=True)
class ModelDetail:
    model: ModelRecord
    evaluations: list[EvaluationRecord]
    #: Aliases pointing at this version now.
    aliases: list[str]


# --- aliases -------------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class ModelRef:
    model: str
    version: str

    @property
    def key(self) -> str:
        return f"{self.model}@{self.version}"


class AliasAction(enum.StrEnum):
    PROMOTE = "promote"
    ROLLBACK = "rollback"


@attrs.frozen(kw_only=True)
class AliasRecord:
    """A stable name clients use, pointing at one model version; each change is a new generation."""

    name: str
    target: ModelRef
    generation: int
    updated_at: float
    updated_by: KeyId | None
    #: A LoRA adapter version served on `target` (one of its bases) under this alias; None: the
    #: model itself. Requests for the alias go to replicas of `target` with the adapter loaded.
    adapter: ModelRef | None = None


@attrs.frozen(kw_only=True)
class AliasReceipt:
    """What one alias change did. In JSON the previous target is `from` (`from_` in Python)."""

    JSON_NAMES: ClassVar[dict[str, str]] = {"from_": "from"}

    alias: str
    generation: int
    action: AliasAction
    from_: ModelRef | None
    to: ModelRef
    at: float
    actor: KeyId | None
    #: The audit event written in the same transaction.
    event_id: EventId
    #: The LoRA adapter served on `to` (None: none), and the one served on `from_` before.
    adapter: ModelRef | None = None
    from_adapter: ModelRef | None = None


@attrs.frozen(kw_only=True)
class AliasPromote:
    model: str
    version: str
    #: A LoRA adapter version (kind lora, Approved, naming `model@version` among its bases) to serve
    #: on that version under this alias.
    adapter: ModelRef | None = None


@attrs.frozen(kw_only=True)
class AliasList:
    aliases: list[AliasRecord]


@attrs.frozen(kw_only=True)
class AliasDetail:
    alias: AliasRecord
    #: Every change, oldest first.
    history: list[AliasReceipt]


# --- request checks -----------------------------------------------------------------------------

_NAME_RULE: Final = "1-64 lower-case letters, digits, '.', '_' or '-', starting and ending alphanumeric"
_VERSION_RULE: Final = "1-64 letters, digits, '.', '_' or '-', starting and ending alphanumeric"


def name_problem(field: str, value: str) -> str | None:
    return None if NAME_RE.match(value) else f"{field}: {_NAME_RULE}"


def version_problem(field: str, value: str) -> str | None:
    return None if VERSION_RE.match(value) else f"{field}: {_VERSION_RULE}"


def _text_problem(field: str, value: str, max_chars: int, *, required: bool = True) -> str | None:
    if required and not value.strip():
        return f"{field}: required"
    if len(value) > max_chars:
        return f"{field}: at most {max_chars} characters"
    if not value.isprintable():
        return f"{field}: no control characters or line breaks"
    return None


def _size_problem(field: str, value: int) -> str | None:
    return None if 0 < value <= MAX_BYTES else f"{field}: a positive number of bytes up to 2^53"


def _sha256_problem(field: str, value: str) -> str | None:
    return None if SHA256_RE.match(value) else f"{field}: 64 lower-case hex digits"


def signature_problem(field: str, value: str) -> str | None:
    return None if _SIGNATURE_B64_RE.match(value) else f"{field}: an Ed25519 signature, 64 bytes in base64"


def artifact_uri_problem(field: str, uri: str) -> str | None:
    """`s3://bucket/key`: a real bucket name, a key without `..` segments or control characters."""
    problem = f"{field}: s3://bucket/key (a bucket name, then a key without '..' or control characters)"
    if len(uri) > 1024 or not uri.isprintable() or not uri.startswith("s3://"):
        return problem
    parsed = urlparse(uri)
    key = parsed.path.lstrip("/")
    if parsed.query or parsed.fragment or parsed.params or "\\" in uri:
        return problem
    if not _BUCKET_RE.match(parsed.netloc) or not key or ".." in key.split("/"):
        return problem
    return None


def artifact_problems(artifact: ModelArtifact) -> list[str | None]:
    """One object: its URI, sha256 and size. A manifest: the prefix, every file and the entry, and
    a sha256 or size given beside them must be the manifest's own."""
    problems: list[str | None] = []
    if not artifact.files:
        problems.append(artifact_uri_problem("artifact.uri", artifact.uri))
        if artifact.entry:
            problems.append("artifact.entry: an entry point needs files (one object is its own entry)")
        problems.append(_sha256_problem("artifact.sha256", artifact.sha256))
        problems.append(_size_problem("artifact.size_bytes", artifact.size_bytes))
        return problems
    prefix_problem = artifact_uri_problem("artifact.uri", artifact.uri.rstrip("/") + "/x")
    if prefix_problem or not artifact.uri.endswith("/"):
        problems.append(
            "artifact.uri: with files, the prefix their paths are under, ending in '/': s3://bucket/prefix/"
        )
    found = manifest_problems(artifact.files, artifact.entry)
    problems += found
    if not found:
        manifest = artifact.manifest()
        if artifact.sha256 and artifact.sha256 != manifest.digest:
            problems.append(
                f"artifact.sha256: the manifest's digest (sha256 of its canonical bytes) is {manifest.digest}, "
                f"not {artifact.sha256}; leave it out to have it computed"
            )
        if artifact.size_bytes and artifact.size_bytes != manifest.size_bytes:
            problems.append(
                f"artifact.size_bytes: the files hold {manifest.size_bytes} bytes in all, not {artifact.size_bytes}"
            )
    return problems


def runtime_problems(req: RuntimeCreate) -> list[str]:
    problems = [name_problem("name", req.name), version_problem("version", req.version)]
    if not IMAGE_BY_DIGEST_RE.match(req.image) or len(req.image) > 512:
        problems.append("image: must be named by digest: registry/repository@sha256:<64 hex>")
    if req.fabric is not FabricAccess.NONE and req.kind is RuntimeKind.SIM:
        problems.append("fabric: the sim runtime runs as a process on the node, not in a container; leave it none")
    return [p for p in problems if p]


def license_problems(lic: LicenseSet, field: str = "license") -> list[str]:
    problems: list[str | None] = []
    if (lic.spdx_id is None) == (lic.terms_sha256 is None):
        problems.append(f"{field}: give exactly one of spdx_id and terms_sha256")
    if lic.spdx_id is not None and not SPDX_RE.match(lic.spdx_id):
        problems.append(f"{field}.spdx_id: an SPDX licence id or expression")
    if lic.terms_sha256 is not None:
        problems.append(_sha256_problem(f"{field}.terms_sha256", lic.terms_sha256))
    if lic.accepted_by is not None:
        problems.append(_text_problem(f"{field}.accepted_by", lic.accepted_by, 256))
    if lic.expires_at is not None and not (math.isfinite(lic.expires_at) and lic.expires_at > 0):
        problems.append(f"{field}.expires_at: unix seconds")
    return [p for p in problems if p]


def model_problems(req: ModelCreate) -> list[str]:
    problems = [
        name_problem("name", req.name),
        version_problem("version", req.version),
        *artifact_problems(req.artifact),
        _size_problem("memory_bytes", req.memory_bytes),
        _text_problem("provenance.source", req.provenance.source, 512),
        _text_problem("provenance.signer", req.provenance.signer, 256, required=False),
    ]
    if req.signature is not None:
        problems.append(signature_problem("signature", req.signature))
    problems += base_problems(req.kind, req.base)
    found = [p for p in problems if p]
    if req.license is not None:
        found += license_problems(req.license)
    return found


def base_problems(kind: ModelKind, base: list[ModelRef]) -> list[str | None]:
    """A LoRA adapter names 1..`MAX_LORA_BASES` distinct base versions; a model names none."""
    if kind is ModelKind.MODEL:
        return ["base: only a LoRA adapter (kind lora) names base model versions"] if base else []
    if not base or len(base) > MAX_LORA_BASES:
        return [f"base: a LoRA adapter names the 1-{MAX_LORA_BASES} base model versions it applies to"]
    problems: list[str | None] = []
    for i, ref in enumerate(base):
        problems += [name_problem(f"base[{i}].model", ref.model), version_problem(f"base[{i}].version", ref.version)]
    if len({(ref.model, ref.version) for ref in base}) != len(base):
        problems.append("base: each base model version once")
    return problems


def evaluation_problems(req: EvaluationCreate) -> list[str]:
    problems = [
        _text_problem("suite", req.suite, 128),
        _text_problem("evidence", req.evidence, 1024, required=False),
    ]
    if len(req.metrics) > MAX_METRICS:
        problems.append(f"metrics: at most {MAX_METRICS}")
    for name, value in req.metrics.items():
        if not METRIC_RE.match(name):
            problems.append(f"metrics[{name[:70]!r}]: names are 1-64 letters, digits, '_', '.', ':', '/' or '-'")
        elif not math.isfinite(value):
            problems.append(f"metrics[{name!r}]: a finite number")
    return [p for p in problems if p]
