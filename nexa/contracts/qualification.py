"""Runtime qualification: what `nexa runtimes qualify` asks and the signed record it leaves. Pure data.

A **qualification** starts a runtime's image with a model on one real node, as a short-lived
replica of its own, and checks step by step (`STEPS`) what an operator must know on day one: the
process that ran, the time to Ready, an answer through the gateway's relay, the metric series the
router reads, the cache written, measured memory against the reservation, and a clean stop. The
controller keeps the result as a `Qualification` signed with its Ed25519 key
(`SignedQualification`, kind `nexa-qualification-v1`; `security.verify_qualification` checks it
offline). It holds for one (runtime image digest, node architecture, GPU model) triple:
`[placement] require_qualified = true` places a runtime only on nodes whose pair passed.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from typing import Final

import attrs

from nexa.contracts.bounds import MAX_BYTES, MAX_UNIX_S, finite, whole
from nexa.contracts.models import ModelRef
from nexa.contracts.node import Gpu, RuntimeKind

#: The steps, in the order they run. A step after a failed one is skipped, except `stop`, which
#: always runs once a replica was assigned.
STEPS: Final = ("placement", "process", "ready", "answer", "metrics", "cache", "memory", "stop")
#: The longest a qualification waits for its replica to be Ready (seconds), and its default.
MAX_TIMEOUT_S: Final = 3600.0
DEFAULT_TIMEOUT_S: Final = 600.0
#: The GPU model of a node without GPUs (a CPU node).
NO_GPU: Final = "none"
#: The longest detail or fix one step carries.
MAX_STEP_TEXT: Final = 1000


class StepOutcome(enum.StrEnum):
    PASS = "pass"  # noqa: S105 (an outcome, not a password)
    FAIL = "fail"
    #: The node or the runtime does not report it (an older agent, a runtime without metrics):
    #: said so, and no verdict either way.
    UNKNOWN = "unknown"
    #: Not run: an earlier step failed.
    SKIPPED = "skipped"


@attrs.frozen(kw_only=True)
class QualifyRequest:
    """`POST /api/v1/runtimes/{name}/qualify`: where and with what to qualify the runtime."""

    #: The node to run it on (Ready or Cordoned: cordon a new node, qualify, then uncordon it).
    node: str
    #: An alias, a model name (its newest Approved version) or `name:version`; None: the smallest
    #: Approved model whose format the runtime serves.
    model: str | None = None
    #: The replica's runtime settings, as a deployment's `options.settings`.
    settings: dict[str, object] = attrs.Factory(dict)
    #: GPUs for the replica; None: 1 on a node with GPUs, else 0.
    accelerators: int | None = attrs.field(default=None, validator=whole(0, 64, optional=True))
    #: The reservation; None: the model's own `memory_bytes`.
    memory_bytes: int | None = attrs.field(default=None, validator=whole(1, MAX_BYTES, optional=True))
    #: How long the replica may take to be Ready (pull, fetch and load included).
    timeout_s: float = attrs.field(default=DEFAULT_TIMEOUT_S, validator=finite(1.0, MAX_TIMEOUT_S))


@attrs.frozen(kw_only=True)
class QualificationStep:
    """One step's verdict: what was seen (`detail`) and, when it failed, what to do (`fix`)."""

    name: str
    outcome: StepOutcome
    detail: str = ""
    fix: str = ""
    duration_s: float = attrs.field(default=0.0, validator=finite(0.0, 86_400.0))
    #: The step's figures (seconds to Ready, bytes measured, series found …): numbers and short strings.
    figures: dict[str, float | int | str] = attrs.Factory(dict)


@attrs.frozen(kw_only=True)
class Qualification:
    """One qualification's result, for (`image_digest`, `arch`, `gpu_model`)."""

    id: str
    #: The runtime's registered name, kind and image (`registry/repo@sha256:…`).
    runtime: str
    kind: RuntimeKind
    image: str
    #: `sha256:…`: what `require_qualified` matches (a runtime registered again with another
    #: image needs qualifying again).
    image_digest: str
    node_id: str
    #: The node's architecture (`amd64`, `arm64`) and GPU model (`NVIDIA GB10`; `none`: no GPU).
    arch: str
    gpu_model: str
    model: ModelRef
    settings: dict[str, object] = attrs.Factory(dict)
    started_at: float = attrs.field(validator=finite(0.0, MAX_UNIX_S))
    finished_at: float = attrs.field(validator=finite(0.0, MAX_UNIX_S))
    passed: bool
    #: Every step of `STEPS`, in order.
    steps: list[QualificationStep]
    #: The first step that failed (None when it passed).
    failed_step: str | None = None
    #: The job that followed it (`nexa jobs show`).
    job: str | None = None
    #: Who asked (an API key id) and the controller's version.
    requested_by: str | None = None
    nexa_version: str = ""

    @property
    def pair(self) -> tuple[str, str]:
        """(architecture, GPU model): what placement matches a node against."""
        return self.arch, self.gpu_model


@attrs.frozen(kw_only=True)
class SignedQualification:
    """A qualification and the controller's Ed25519 signature over its canonical JSON (API form),
    with kind `nexa-qualification-v1`. `public_key` is a hint only: a verifier compares it with the
    controller key it trusts (`public_key` of GET /api/v1/receipts/public-key)."""

    qualification: Qualification
    signature: str
    public_key: str


@attrs.frozen(kw_only=True)
class QualificationList:
    qualifications: list[SignedQualification]
    next_cursor: str | None = None


def gpu_model(gpus: Iterable[Gpu]) -> str:
    """A node's GPU model as qualifications name it: the GPUs' names (each once, sorted, joined by
    `+`), or `none` for a node without GPUs."""
    names = sorted({g.name.strip() for g in gpus if g.name.strip()})
    return "+".join(names) if names else NO_GPU


def image_digest(image: str) -> str:
    """The digest part of a pinned image reference (`sha256:…`), or "" when it has none."""
    _, at, digest = image.rpartition("@")
    return digest if at else ""


def request_problems(req: QualifyRequest) -> list[str]:
    """What is wrong with a request's shape (whether the node, runtime and model exist is checked apart)."""
    problems = []
    if not req.node or len(req.node) > 200 or not req.node.isprintable():
        problems.append("node: a node id `nexa nodes list` shows")
    if req.model is not None and (not req.model or len(req.model) > 300 or not req.model.isprintable()):
        problems.append("model: an alias, a model name or NAME:VERSION")
    return problems


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def memory_text(n: int | None) -> str:
    """Bytes in GiB for step details; `unknown` for None."""
    return "unknown" if n is None else _gib(n)
