"""Evaluation suites and their measured runs: the suite file's format (JSON Lines, one case a line),
its check at registration (`parse_suite`, naming the line of every problem), the HTTP bodies of
suites and runs, and the run's figures (`summarize`, `compare`). Pure: no I/O.

A case: `{"id", "request", "scorer", "metric"}`. `request` is a chat completion body (`messages`), a
completion body (`prompt`) or `{"embedding_pair": [a, b]}`; `model` may be left out (the run fills
in the deployment's). `scorer.kind` is one of `ScorerKind`; `metric` names the figure the case
counts towards (default: the scorer's kind).
"""

from __future__ import annotations

import enum
import hashlib
import math
import re
from collections.abc import Sequence
from typing import Any, Final

import attrs

from nexa.contracts import codec
from nexa.contracts.deployments import Resources, RuntimeOptions
from nexa.contracts.domain import NAME_RE, KeyId
from nexa.contracts.models import METRIC_RE, ModelRef
from nexa.errors import ContractError

#: A suite holds at most this many cases, and its file at most this many bytes (the API's body limit
#: is 1 MiB by default: `[http] max_body_bytes`).
MAX_CASES: Final = 2000
MAX_SUITE_BYTES: Final = 768 * 1024
#: A regular expression's pattern at most, and the answer it is run on at most (bounded work).
MAX_PATTERN_CHARS: Final = 512
MAX_ANSWER_CHARS: Final = 16_384
#: What a case id, a judge's rubric and an expected text may hold.
CASE_ID_RE: Final = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$")
MAX_RUBRIC_CHARS: Final = 4000
#: The answer kept with each case's result (for `nexa eval show`), and the longest error note.
MAX_KEPT_ANSWER_CHARS: Final = 500
#: The most a run may ask: concurrent requests, and seconds.
MAX_CONCURRENCY: Final = 256
MAX_DEADLINE_S: Final = 86_400.0
#: An evaluation replica lives at most this long (`EvalReplicaCreate.ttl_s`).
MAX_REPLICA_TTL_S: Final = MAX_DEADLINE_S + 3600.0
#: Nested quantifiers (`(a+)+`, `(\w*)*`) can take exponential time: refused.
_NESTED_QUANTIFIER: Final = re.compile(r"\((?:[^()\\]|\\.)*[+*}](?:[^()\\]|\\.)*\)\s*[+*{]")
_Z95: Final = 1.959963984540054
#: Student's t, 97.5th percentile, for 1..30 degrees of freedom (then the normal's).
_T975: Final = (
    12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228,
    2.201, 2.179, 2.160, 2.145, 2.131, 2.120, 2.110, 2.101, 2.093, 2.086,
    2.080, 2.074, 2.069, 2.064, 2.060, 2.056, 2.052, 2.048, 2.045, 2.042,
)  # fmt: skip


class ScorerKind(enum.StrEnum):
    EXACT = "exact"
    CONTAINS = "contains"
    REGEX = "regex"
    JSON_SCHEMA = "json_schema"
    NUMBER = "number"
    COSINE = "cosine"
    JUDGE = "judge"


class RequestKind(enum.StrEnum):
    CHAT = "chat"
    COMPLETION = "completion"
    EMBEDDING_PAIR = "embedding_pair"


#: The parameters each scorer takes (required ones first), besides `kind`.
SCORER_PARAMS: Final[dict[ScorerKind, tuple[tuple[str, ...], tuple[str, ...]]]] = {
    ScorerKind.EXACT: (("expected",), ("ignore_case",)),
    ScorerKind.CONTAINS: (("expected",), ("ignore_case",)),
    ScorerKind.REGEX: (("pattern",), ()),
    ScorerKind.JSON_SCHEMA: (("schema",), ()),
    ScorerKind.NUMBER: (("expected",), ("tolerance",)),
    ScorerKind.COSINE: (("min",), ("expected", "deployment")),
    ScorerKind.JUDGE: (("deployment", "rubric"), ("min",)),
}


@attrs.frozen(kw_only=True)
class Scorer:
    """One case's scorer, checked (`parse_suite`); `compiled` is the regex or JSON Schema validator."""

    kind: ScorerKind
    params: dict[str, Any]
    compiled: Any = None


@attrs.frozen(kw_only=True)
class SuiteCase:
    line: int
    id: str
    kind: RequestKind
    request: dict[str, Any]
    scorer: Scorer
    metric: str


@attrs.frozen(kw_only=True)
class ParsedSuite:
    cases: list[SuiteCase]
    digest: str

    @property
    def metrics(self) -> list[str]:
        return sorted({c.metric for c in self.cases})

    @property
    def deployments(self) -> list[str]:
        """The deployments the scorers call (judges, embedding deployments)."""
        named = {c.scorer.params.get("deployment") for c in self.cases}
        return sorted(d for d in named if isinstance(d, str))


# --- HTTP bodies ---------------------------------------------------------------------------------


@attrs.frozen(kw_only=True)
class SuiteCreate:
    """`POST /api/v1/eval/suites`: the suite file's text, under a name."""

    name: str
    content: str


@attrs.frozen(kw_only=True)
class Suite:
    name: str
    #: sha256 of the file's bytes (UTF-8): what a run and an evaluation name.
    digest: str
    cases: int
    metrics: list[str]
    #: The deployments its scorers call.
    deployments: list[str]
    registered_at: float
    registered_by: KeyId | None


@attrs.frozen(kw_only=True)
class SuiteDetail:
    suite: Suite
    content: str


@attrs.frozen(kw_only=True)
class SuiteList:
    suites: list[Suite]


@attrs.frozen(kw_only=True)
class CaseResult:
    id: str
    metric: str
    #: 0..1 (cosine: the similarity, -1..1).
    score: float
    passed: bool
    #: Why the case got no answer (the gateway's error code, `timeout`, `unparsed`); None: answered.
    error: str | None = None
    e2e_ms: float = 0.0
    #: The start of the answer, for reading (never more than `MAX_KEPT_ANSWER_CHARS`).
    answer: str = ""


@attrs.frozen(kw_only=True)
class MetricSummary:
    metric: str
    cases: int
    passed: int
    errors: int
    pass_rate: float
    #: Wilson score interval, 95%.
    pass_rate_ci: list[float]
    mean: float
    #: Student's t interval, 95% (the mean itself for fewer than two cases).
    mean_ci: list[float]
    #: The scores' sample standard deviation (0 for fewer than two cases).
    sd: float = 0.0


@attrs.frozen(kw_only=True)
class EvalRunCreate:
    """`POST /api/v1/eval/runs` (`nexa eval run`): what each case scored, through the gateway."""

    suite: str
    digest: str
    deployment: str
    #: The model name called (the deployment's alias, or its model's name).
    model: str
    started_at: float
    duration_s: float
    concurrency: int
    cases: list[CaseResult]
    #: The run passes when every metric's pass rate is at least this.
    min_pass_rate: float = 1.0
    job: str | None = None
    client_version: str = ""
    #: Run against the deployment's canary replicas alone (`--canary`): the canary version's evaluation.
    canary: bool = False
    #: Run against the new replicas of the deployment's rollout alone (`--rollout`): a suite gate's run.
    rollout: bool = False


@attrs.frozen(kw_only=True)
class EvalReplicaCreate:
    """`POST /api/v1/eval/replicas` (`nexa eval run SUITE --model NAME@VERSION`): a short-lived
    replica of a model version, Approved or not (Verified at least, its licence valid), that only
    the evaluation job's inference key may call (`deployments.EvalBinding`). It runs like
    deployment `like` (its runtime, resources, options, placement), or on `runtime` with
    `resources` and `options`."""

    model: ModelRef
    suite: str
    #: The evaluation's job (`nexa jobs`): the replica goes once the job is not running.
    job: str
    #: The public id of the inference key whose requests may use it (`nxk_<id>_...`).
    key_id: str
    like: str | None = None
    runtime: str | None = None
    resources: Resources = attrs.Factory(Resources)
    options: RuntimeOptions = attrs.Factory(RuntimeOptions)
    #: The replica goes after this many seconds even if its job still runs.
    ttl_s: float = 3600.0


@attrs.frozen(kw_only=True)
class EvalReplica:
    """An evaluation replica: the deployment (`nexa deployments show NAME`) and the model name its
    requests give (the deployment's name)."""

    deployment: str
    model: ModelRef
    suite: str
    job: str
    expires_at: float
    ready: int = 0


@attrs.frozen(kw_only=True)
class EvalReplicaList:
    replicas: list[EvalReplica]


@attrs.frozen(kw_only=True)
class EvalRun:
    id: str
    suite: str
    digest: str
    deployment: str
    #: The model version the deployment served (`name@version`), which the evaluation is recorded on.
    model: str
    version: str
    passed: bool
    summaries: list[MetricSummary]
    #: The evaluation record (`models show`); None when the version could not take one (retired).
    evaluation: str | None
    recorded_at: float
    recorded_by: KeyId | None
    run: EvalRunCreate


@attrs.frozen(kw_only=True)
class EvalRunList:
    runs: list[EvalRun]
    next_cursor: str | None = None


@attrs.frozen(kw_only=True)
class MetricDiff:
    metric: str
    a_pass_rate: float
    b_pass_rate: float
    #: b - a, and its 95% interval (Newcombe's hybrid score interval for two proportions).
    pass_rate_diff: float
    pass_rate_diff_ci: list[float]
    mean_diff: float
    #: Welch's normal interval, 95%.
    mean_diff_ci: list[float]
    #: The interval of the pass-rate difference excludes 0.
    significant: bool


@attrs.frozen(kw_only=True)
class EvalCompare:
    a: str
    b: str
    #: Metrics both runs measured; the others are named apart.
    metrics: list[MetricDiff]
    only_a: list[str]
    only_b: list[str]
    same_suite: bool


# --- the suite file ------------------------------------------------------------------------------


def digest_of(content: str) -> str:
    return hashlib.sha256(content.encode()).hexdigest()


def parse_suite(content: str) -> tuple[ParsedSuite | None, list[str]]:
    """The suite, or every problem as `line N: what`; an empty list of problems means it is usable."""
    problems: list[str] = []
    if len(content.encode()) > MAX_SUITE_BYTES:
        return None, [f"the file is larger than {MAX_SUITE_BYTES} bytes: split it into several suites"]
    cases: list[SuiteCase] = []
    seen: dict[str, int] = {}
    for number, text in enumerate(content.splitlines(), start=1):
        if not text.strip():
            continue
        if len(cases) >= MAX_CASES:
            problems.append(f"line {number}: more than {MAX_CASES} cases: split the suite")
            break
        case, why = _case(number, text)
        if why:
            problems += [f"line {number}: {w}" for w in why]
            continue
        assert case is not None
        if case.id in seen:
            problems.append(f"line {number}: id {case.id!r} is taken by line {seen[case.id]}")
            continue
        seen[case.id] = number
        cases.append(case)
    if not cases and not problems:
        problems.append("the suite has no cases: one JSON object a line")
    if problems:
        return None, problems
    return ParsedSuite(cases=cases, digest=digest_of(content)), []


def _case(number: int, text: str) -> tuple[SuiteCase | None, list[str]]:
    try:
        data = codec.parse_json(text)
    except ContractError as exc:
        return None, [f"not JSON ({exc.message.removeprefix('body is ')[:120]})"]
    if not isinstance(data, dict):
        return None, ["a case is a JSON object: {id, request, scorer, metric}"]
    problems = [f"{key}: unknown field (id, request, scorer, metric)" for key in data if key not in _CASE_KEYS]
    case_id = data.get("id")
    if not isinstance(case_id, str) or not CASE_ID_RE.match(case_id):
        problems.append("id: 1-64 letters, digits, '_', '.', ':' or '-', starting with a letter or digit")
    kind, why = _request(data.get("request"))
    problems += why
    scorer, why = _scorer(data.get("scorer"), kind)
    problems += why
    metric = data.get("metric", scorer.kind.value if scorer is not None else "exact")
    if not isinstance(metric, str) or not METRIC_RE.match(metric):
        problems.append("metric: 1-64 letters, digits, '_', '.', ':', '/' or '-'")
    if problems or kind is None or scorer is None:
        return None, problems
    assert isinstance(case_id, str)
    assert isinstance(metric, str)
    request = data["request"]
    return SuiteCase(line=number, id=case_id, kind=kind, request=request, scorer=scorer, metric=metric), []


_CASE_KEYS: Final = ("id", "request", "scorer", "metric")


def _request(request: object) -> tuple[RequestKind | None, list[str]]:  # noqa: PLR0911 -- one answer per kind
    if not isinstance(request, dict):
        return None, ["request: an object (a chat or completion body, or {embedding_pair: [a, b]})"]
    if "embedding_pair" in request:
        pair = request["embedding_pair"]
        if set(request) - {"embedding_pair", "model"} or not (
            isinstance(pair, list) and len(pair) == 2 and all(isinstance(t, str) and t for t in pair)
        ):
            return None, ["request.embedding_pair: two non-empty texts, and nothing else beside model"]
        return RequestKind.EMBEDDING_PAIR, []
    if "stream" in request and request["stream"] is not False:
        return None, ["request.stream: a suite's requests are unary (leave stream out)"]
    if "model" in request and not isinstance(request["model"], str):
        return None, ["request.model: a model name (or leave it out: the deployment's)"]
    messages = request.get("messages")
    if messages is not None:
        if not (
            isinstance(messages, list)
            and messages
            and all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)
        ):
            return None, ["request.messages: a non-empty list of {role, content}"]
        return RequestKind.CHAT, []
    if isinstance(request.get("prompt"), str):
        return RequestKind.COMPLETION, []
    return None, ["request: not a request (a chat body has messages, a completion body a prompt)"]


def _scorer(scorer: object, kind: RequestKind | None) -> tuple[Scorer | None, list[str]]:
    if not isinstance(scorer, dict):
        return None, ["scorer: an object with a kind"]
    try:
        sk = ScorerKind(str(scorer.get("kind")))
    except ValueError:
        return None, [f"scorer.kind: unknown scorer {str(scorer.get('kind'))[:40]!r}: one of {', '.join(ScorerKind)}"]
    required, optional = SCORER_PARAMS[sk]
    params = {k: v for k, v in scorer.items() if k != "kind"}
    problems = [f"scorer.{k}: required by {sk.value}" for k in required if k not in params]
    problems += [f"scorer.{k}: not a parameter of {sk.value}" for k in params if k not in required + optional]
    if problems:
        return None, problems
    compiled, why = _check_params(sk, params, kind)
    return (None, why) if why else (Scorer(kind=sk, params=params, compiled=compiled), [])


def _check_params(sk: ScorerKind, p: dict[str, Any], kind: RequestKind | None) -> tuple[Any, list[str]]:  # noqa: PLR0911, PLR0912
    pair = kind is RequestKind.EMBEDDING_PAIR
    if pair and sk is not ScorerKind.COSINE:
        return None, ["scorer.kind: an embedding_pair is scored by cosine"]
    if "ignore_case" in p and not isinstance(p["ignore_case"], bool):
        return None, ["scorer.ignore_case: true or false"]
    if sk in (ScorerKind.EXACT, ScorerKind.CONTAINS) and not isinstance(p["expected"], str):
        return None, ["scorer.expected: a text"]
    if sk is ScorerKind.REGEX:
        pattern = p["pattern"]
        if not isinstance(pattern, str) or not pattern or len(pattern) > MAX_PATTERN_CHARS:
            return None, [f"scorer.pattern: a regular expression of 1 to {MAX_PATTERN_CHARS} characters"]
        if _NESTED_QUANTIFIER.search(pattern):
            return None, ["scorer.pattern: a nested quantifier such as (a+)+ can take exponential time: rewrite it"]
        try:
            return re.compile(pattern), []
        except re.error as exc:
            return None, [f"scorer.pattern: not a regular expression ({exc})"]
    if sk is ScorerKind.JSON_SCHEMA:
        return _schema(p["schema"])
    if sk is ScorerKind.NUMBER:
        tolerance = p.get("tolerance", 0.0)
        if not _number(p["expected"]) or not _number(tolerance) or tolerance < 0:
            return None, ["scorer.expected and scorer.tolerance: finite numbers (tolerance 0 or more)"]
    if sk is ScorerKind.COSINE:
        if not _number(p["min"]) or not -1.0 <= p["min"] <= 1.0:
            return None, ["scorer.min: a similarity from -1 to 1"]
        if not pair and not (isinstance(p.get("expected"), str) and isinstance(p.get("deployment"), str)):
            return None, ["scorer: cosine of an answer needs expected (a text) and deployment (an embedding one)"]
    if "deployment" in p and not (isinstance(p["deployment"], str) and NAME_RE.match(p["deployment"])):
        return None, ["scorer.deployment: a deployment's name"]
    if sk is ScorerKind.JUDGE:
        rubric = p["rubric"]
        if not isinstance(rubric, str) or not rubric.strip() or len(rubric) > MAX_RUBRIC_CHARS:
            return None, [f"scorer.rubric: 1 to {MAX_RUBRIC_CHARS} characters"]
        if "min" in p and not (_number(p["min"]) and 0.0 <= p["min"] <= 1.0):
            return None, ["scorer.min: a score from 0 to 1"]
    return None, []


def _schema(schema: object) -> tuple[Any, list[str]]:
    import jsonschema  # only a suite with a json_schema case needs it

    if not isinstance(schema, dict | bool):
        return None, ["scorer.schema: a JSON Schema (an object)"]
    try:
        jsonschema.Draft202012Validator.check_schema(schema)
    except jsonschema.SchemaError as exc:
        return None, [f"scorer.schema: does not compile ({exc.message[:160]})"]
    return jsonschema.Draft202012Validator(schema), []


def _number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# --- figures -------------------------------------------------------------------------------------


def wilson(passed: int, n: int) -> tuple[float, float]:
    """The 95% Wilson score interval of a pass rate; (0, 1) for no cases."""
    if n <= 0:
        return 0.0, 1.0
    p, z2 = passed / n, _Z95 * _Z95
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = _Z95 * math.sqrt(p * (1 - p) / n + z2 / (4 * n * n)) / (1 + z2 / n)
    return max(0.0, centre - half), min(1.0, centre + half)


def _mean_sd(values: Sequence[float]) -> tuple[float, float]:
    n = len(values)
    mean = math.fsum(values) / n if n else 0.0
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return mean, sd


def _t(df: int) -> float:
    return _T975[df - 1] if 1 <= df <= len(_T975) else _Z95


def summarize(cases: Sequence[CaseResult]) -> list[MetricSummary]:
    """One summary per metric, by name."""
    out = []
    for metric in sorted({c.metric for c in cases}):
        mine = [c for c in cases if c.metric == metric]
        n, passed = len(mine), sum(1 for c in mine if c.passed)
        mean, sd = _mean_sd([c.score for c in mine])
        half = _t(n - 1) * sd / math.sqrt(n) if n > 1 else 0.0
        floor = -1.0 if any(c.score < 0 for c in mine) else 0.0  # scores are 0..1 (cosine: -1..1)
        lo, hi = wilson(passed, n)
        out.append(
            MetricSummary(
                metric=metric,
                cases=n,
                passed=passed,
                errors=sum(1 for c in mine if c.error is not None),
                pass_rate=_r(passed / n),
                pass_rate_ci=[_r(lo), _r(hi)],
                mean=_r(mean),
                mean_ci=[_r(max(floor, mean - half)), _r(min(1.0, mean + half))],
                sd=_r(sd),
            )
        )
    return out


def compare(a: EvalRun, b: EvalRun) -> EvalCompare:
    """b against a, per metric both measured (see `MetricDiff`)."""
    sa, sb = {s.metric: s for s in a.summaries}, {s.metric: s for s in b.summaries}
    diffs = []
    for metric in sorted(sa.keys() & sb.keys()):
        x, y = sa[metric], sb[metric]
        (l1, u1), (l2, u2) = wilson(x.passed, x.cases), wilson(y.passed, y.cases)
        p1, p2 = x.passed / x.cases, y.passed / y.cases
        d = p2 - p1
        lo = d - math.sqrt((p2 - l2) ** 2 + (u1 - p1) ** 2)
        hi = d + math.sqrt((u2 - p2) ** 2 + (p1 - l1) ** 2)
        se = math.sqrt(_var_of_mean(x) + _var_of_mean(y))
        md = y.mean - x.mean
        diffs.append(
            MetricDiff(
                metric=metric,
                a_pass_rate=x.pass_rate,
                b_pass_rate=y.pass_rate,
                pass_rate_diff=_r(d),
                pass_rate_diff_ci=[_r(lo), _r(hi)],
                mean_diff=_r(md),
                mean_diff_ci=[_r(md - _Z95 * se), _r(md + _Z95 * se)],
                significant=lo > 0 or hi < 0,
            )
        )
    return EvalCompare(
        a=a.id,
        b=b.id,
        metrics=diffs,
        only_a=sorted(sa.keys() - sb.keys()),
        only_b=sorted(sb.keys() - sa.keys()),
        same_suite=a.digest == b.digest,
    )


def _var_of_mean(s: MetricSummary) -> float:
    """The squared standard error of a summary's mean."""
    return s.sd * s.sd / s.cases if s.cases > 1 else 0.0


def _r(x: float) -> float:
    return round(x, 6)


def run_problems(req: EvalRunCreate) -> list[str]:
    """What is wrong with a posted run's shape (the suite and the deployment are checked apart)."""
    problems = []
    if not NAME_RE.match(req.suite):
        problems.append("suite: a suite's name")
    if not re.fullmatch(r"[0-9a-f]{64}", req.digest):
        problems.append("digest: the suite's sha256 (64 hex digits)")
    if not NAME_RE.match(req.deployment):
        problems.append("deployment: a deployment's name")
    if not (0.0 <= req.min_pass_rate <= 1.0):
        problems.append("min_pass_rate: from 0 to 1")
    if req.canary and req.rollout:
        problems.append("canary, rollout: one of them (a canary and a rollout never run together)")
    if not (_number(req.duration_s) and 0 <= req.duration_s <= MAX_DEADLINE_S):
        problems.append(f"duration_s: 0 to {MAX_DEADLINE_S:g}")
    if not 1 <= req.concurrency <= MAX_CONCURRENCY:
        problems.append(f"concurrency: 1 to {MAX_CONCURRENCY}")
    if len(req.cases) > MAX_CASES:
        problems.append(f"cases: at most {MAX_CASES}")
    for i, c in enumerate(req.cases):
        if not (_number(c.score) and -1.0 <= c.score <= 1.0) or not _number(c.e2e_ms) or c.e2e_ms < 0:
            problems.append(f"cases[{i}]: score from -1 to 1, e2e_ms 0 or more")
        if len(c.answer) > MAX_KEPT_ANSWER_CHARS or (c.error is not None and len(c.error) > 64):
            problems.append(f"cases[{i}]: answer at most {MAX_KEPT_ANSWER_CHARS} characters, error at most 64")
    return problems
