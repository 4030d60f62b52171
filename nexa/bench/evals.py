"""`nexa eval run`: every case of a registered suite sent through the gateway as a client sends it
(the inference key's tenant, quotas and limits apply), scored here, and posted to the controller,
which summarizes it and records it as the model version's measured evaluation.

Cases run `concurrency` at a time until all have answered or the deadline passes (a case not done
by then scores 0 with the error `deadline`). A gateway that refuses the key (401/403) for a
deployment stops the run: the key may not use it (`Forbidden`, naming the deployment), and nothing
is recorded. Answers are never logged; each case keeps the start of its answer for `nexa eval show`.

With `evaluate` (`--model NAME@VERSION`) the run starts an evaluation replica of that version first
(`POST /api/v1/eval/replicas`, bound to the run's job and to the inference key's id), waits until it
is Ready, calls it by its name, and removes it afterwards, also when the run fails or is interrupted
(the controller removes it as well once the job is no longer running).

With `canary` (`--canary`) the cases go to the deployment's canary replicas alone; with `rollout`
(`--rollout`) to the new replicas of its rollout alone (what a rollout's suite gate counts).
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import re
import time
from collections.abc import Callable
from typing import Any, Final, TypeVar

import attrs
import trio

from nexa import __version__
from nexa.bench.gateway import Gateway
from nexa.client import ApiClient
from nexa.contracts import codec
from nexa.contracts import evals as ev
from nexa.contracts.deployments import CANARY_EVAL_PREFIX, ROLLOUT_EVAL_PREFIX, DeploymentView
from nexa.contracts.domain import parse_api_key
from nexa.contracts.evidence import Job, JobCreate, JobKind, JobState, JobUpdate
from nexa.contracts.models import ModelRef
from nexa.errors import ConfigError, Forbidden, NexaError, NotFound, RemoteError, Unavailable

T = TypeVar("T")

#: Scorer answers: a judge's `score: 0.8` (or `score = 1`), else its first PASS or FAIL.
_JUDGE_SCORE: Final = re.compile(r"score\s*[:=]\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_JUDGE_WORD: Final = re.compile(r"\b(pass|fail)\b", re.IGNORECASE)
_NUMBER: Final = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
_REFUSED: Final = (401, 403)
#: A job update at most this often (seconds).
_UPDATE_EVERY_S: Final = 1.0
#: How often an evaluation replica is looked at until it is Ready, and the time it is given
#: beyond its start and the run's deadline before the controller removes it regardless (seconds).
_READY_POLL_S: Final = 0.25
_REPLICA_SLACK_S: Final = 300.0
JUDGE_MAX_TOKENS: Final = 64


@attrs.frozen(kw_only=True)
class EvalPlan:
    suite: str
    deployment: str | None
    inference_key: str
    gateway_url: str
    concurrency: int = 4
    deadline_s: float = 600.0
    min_pass_rate: float = 1.0
    model: str | None = None
    #: `--model NAME@VERSION`: a new evaluation replica of that version (`deployment` is None), run
    #: like deployment `like` or on `runtime`, Ready within `ready_timeout_s`.
    evaluate: ModelRef | None = None
    like: str | None = None
    runtime: str | None = None
    ready_timeout_s: float = 600.0
    #: Run against `deployment`'s canary replicas alone (the canary version's evaluation).
    canary: bool = False
    #: Run against the new replicas of `deployment`'s rollout alone (a rollout's suite gate).
    rollout: bool = False


class EvalRunner:
    """One run (see the module docstring); `progress` is told (done, total) as cases finish."""

    def __init__(self, plan: EvalPlan, api: ApiClient, progress: Callable[[int, int], None]) -> None:
        self._plan = plan
        self._api = api
        self._progress = progress
        self._job: str | None = None
        self._served: dict[str, str] = {}
        self._results: dict[str, ev.CaseResult] = {}
        self._refused: str | None = None
        self._gateway: Gateway | None = None
        self._deployment = plan.deployment or ""
        self._replica: str | None = None

    async def _call(self, fn: Callable[..., T], *args: object, **kwargs: object) -> T:
        return await trio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))

    async def run(self) -> ev.EvalRun:
        plan = self._plan
        detail = await self._call(self._api.get, f"/api/v1/eval/suites/{plan.suite}", ev.SuiteDetail)
        parsed, problems = ev.parse_suite(detail.content)
        if parsed is None:  # registered by a newer nexa with rules this one lacks
            raise Unavailable(f"suite {plan.suite} does not parse here: {'; '.join(problems[:3])}")
        if plan.evaluate is None:
            assert plan.deployment is not None
            self._deployment = plan.deployment
            if plan.canary:
                model = await self._canary_name(plan.deployment)
                on = f"{plan.deployment}'s canary"
            elif plan.rollout:
                model = await self._rollout_name(plan.deployment)
                on = f"{plan.deployment}'s new replicas"
            else:
                model = plan.model or await self._served_name(plan.deployment, ready=True)
                on = plan.deployment
        else:
            on = f"{plan.evaluate.model}@{plan.evaluate.version} (an evaluation replica)"
        title = f"eval {plan.suite} on {on} ({len(parsed.cases)} cases)"
        created = JobCreate(kind=JobKind.EVAL, title=title)
        self._job = (await self._call(self._api.post, "/api/v1/jobs", Job, body=_body(created))).id
        self._gateway = Gateway(plan.gateway_url, plan.inference_key, connections=plan.concurrency)
        try:
            if plan.evaluate is not None:
                self._deployment = model = await self._start_replica(plan.evaluate)
            started, t0 = time.time(), time.monotonic()
            await self._all(parsed.cases, model)
            create = ev.EvalRunCreate(
                suite=plan.suite,
                digest=parsed.digest,
                deployment=self._deployment,
                model=model,
                started_at=started,
                duration_s=round(time.monotonic() - t0, 3),
                concurrency=plan.concurrency,
                cases=[self._results[c.id] for c in parsed.cases],
                min_pass_rate=plan.min_pass_rate,
                job=self._job,
                client_version=__version__,
                canary=plan.canary,
                rollout=plan.rollout,
            )
            return await self._call(self._api.post, "/api/v1/eval/runs", ev.EvalRun, body=_body(create))
        except BaseException as exc:
            with trio.CancelScope(shield=True):
                await self._finish_job(exc)
            raise
        finally:
            with trio.CancelScope(shield=True):
                await self._gateway.aclose()
                await self._stop_replica()

    async def _start_replica(self, ref: ModelRef) -> str:
        """Start the evaluation replica (`POST /api/v1/eval/replicas`) and wait until it is Ready; its name."""
        plan = self._plan
        key_id = parse_api_key(plan.inference_key)
        if key_id is None:
            raise ConfigError("the inference key is not an API key (nxk_...): give the key itself")
        assert self._job is not None
        req = ev.EvalReplicaCreate(
            model=ref,
            suite=plan.suite,
            job=self._job,
            key_id=key_id,
            like=plan.like,
            runtime=plan.runtime,
            ttl_s=min(ev.MAX_REPLICA_TTL_S, plan.ready_timeout_s + plan.deadline_s + _REPLICA_SLACK_S),
        )
        replica: ev.EvalReplica = await self._call(
            self._api.post, "/api/v1/eval/replicas", ev.EvalReplica, body=_body(req)
        )
        self._replica = replica.deployment
        await self._update_job(0.0, f"waiting for evaluation replica {replica.deployment} to be Ready")
        with trio.move_on_after(plan.ready_timeout_s):
            while True:
                try:
                    path = f"/api/v1/deployments/{replica.deployment}"
                    view: DeploymentView = await self._call(self._api.get, path, DeploymentView)
                except RemoteError as exc:
                    if exc.status == 404:
                        raise Unavailable(
                            f"evaluation replica {replica.deployment} was removed (its job ended?): run it again"
                        ) from None
                    raise
                if view.ready >= 1:
                    return replica.deployment
                await trio.sleep(_READY_POLL_S)
        raise Unavailable(
            f"evaluation replica {replica.deployment} of {ref.key} was not Ready within {plan.ready_timeout_s:g} s: "
            f"see `nexa deployments show {replica.deployment}` while it runs, or raise --ready-timeout-s"
        )

    async def _stop_replica(self) -> None:
        """Remove the evaluation replica, if one was started (the controller removes it too once the
        job is not running: this is the prompt way)."""
        if self._replica is None:
            return
        with contextlib.suppress(NexaError):  # removed already, or the controller's sweep will once the job ended
            await self._call(self._api.delete, f"/api/v1/eval/replicas/{self._replica}", ev.EvalReplica)

    async def _all(self, cases: list[ev.SuiteCase], model: str) -> None:
        plan, total = self._plan, len(cases)
        send, receive = trio.open_memory_channel[ev.SuiteCase](total)
        for case in cases:
            send.send_nowait(case)
        send.close()
        last_update = 0.0

        async def worker(scope: trio.CancelScope) -> None:
            nonlocal last_update
            async for case in receive:
                self._results[case.id] = await self._case(case, model)
                if self._refused is not None:
                    scope.cancel()
                    return
                self._progress(len(self._results), total)
                if time.monotonic() - last_update >= _UPDATE_EVERY_S:
                    last_update = time.monotonic()
                    await self._update_job(len(self._results) / total, f"{len(self._results)}/{total} cases")

        with trio.move_on_after(plan.deadline_s) as scope:
            async with trio.open_nursery() as nursery:
                for _ in range(min(plan.concurrency, total)):
                    nursery.start_soon(worker, scope)
        if self._refused is not None:
            raise Forbidden(self._refused)
        for case in cases:
            self._results.setdefault(case.id, _failed(case, "deadline", 0.0))

    async def _case(self, case: ev.SuiteCase, model: str) -> ev.CaseResult:
        scorer = case.scorer
        if case.kind is ev.RequestKind.EMBEDDING_PAIR:
            target = scorer.params.get("deployment") or self._deployment
            name = model if target == self._deployment else await self._served_name(target)
            vectors, ms, error = await self._embed(target, name, list(case.request["embedding_pair"]))
            if vectors is None:
                return _failed(case, error or "bad_answer", ms)
            similarity = _cosine(vectors[0], vectors[1])
            return _result(case, similarity, similarity >= scorer.params["min"], ms, f"cosine {similarity:.4f}")
        path = "/v1/chat/completions" if case.kind is ev.RequestKind.CHAT else "/v1/completions"
        body = {"model": model, **case.request}
        answer, ms, error = await self._text(self._deployment, path, body)
        if answer is None:
            return _failed(case, error or "bad_answer", ms)
        return await self._score(case, answer, ms)

    async def _score(self, case: ev.SuiteCase, answer: str, ms: float) -> ev.CaseResult:  # noqa: PLR0911 -- one per scorer
        p, kind = case.scorer.params, case.scorer.kind
        text = answer[: ev.MAX_ANSWER_CHARS]
        if kind in (ev.ScorerKind.EXACT, ev.ScorerKind.CONTAINS):
            got, want = (text.strip(), p["expected"].strip())
            if p.get("ignore_case"):
                got, want = got.casefold(), want.casefold()
            ok = got == want if kind is ev.ScorerKind.EXACT else want in got
            return _result(case, float(ok), ok, ms, answer)
        if kind is ev.ScorerKind.REGEX:
            ok = case.scorer.compiled.search(text) is not None
            return _result(case, float(ok), ok, ms, answer)
        if kind is ev.ScorerKind.JSON_SCHEMA:
            try:
                ok = bool(case.scorer.compiled.is_valid(codec.parse_json(_unfenced(text))))
            except NexaError:
                ok = False
            return _result(case, float(ok), ok, ms, answer)
        if kind is ev.ScorerKind.NUMBER:
            found = _NUMBER.search(text)
            ok = found is not None and abs(float(found.group()) - p["expected"]) <= p.get("tolerance", 0.0)
            return _result(case, float(ok), ok, ms, answer)
        if kind is ev.ScorerKind.COSINE:
            target = p["deployment"]
            vectors, more, error = await self._embed(target, await self._served_name(target), [text, p["expected"]])
            if vectors is None:
                return _failed(case, error or "bad_answer", ms + more)
            similarity = _cosine(vectors[0], vectors[1])
            return _result(case, similarity, similarity >= p["min"], ms + more, answer)
        return await self._judge(case, answer, ms)

    async def _judge(self, case: ev.SuiteCase, answer: str, ms: float) -> ev.CaseResult:
        p = case.scorer.params
        question = json.dumps(case.request.get("messages") or case.request.get("prompt"))[: ev.MAX_ANSWER_CHARS]
        messages = [
            {
                "role": "system",
                "content": "You grade an answer against a rubric. Reply with `score: X` (X from 0 to 1), "
                "or with PASS or FAIL.\nRubric: " + p["rubric"],
            },
            {"role": "user", "content": f"Question: {question}\n\nAnswer: {answer[: ev.MAX_ANSWER_CHARS]}"},
        ]
        target = p["deployment"]
        body = {"model": await self._served_name(target), "messages": messages, "max_tokens": JUDGE_MAX_TOKENS}
        verdict, more, error = await self._text(target, "/v1/chat/completions", body)
        if verdict is None:
            return _failed(case, error or "bad_answer", ms + more)
        score = _judged(verdict)
        if score is None:
            return _failed(case, "judge_unparsed", ms + more, answer)
        return _result(case, score, score >= p.get("min", 0.5), ms + more, answer)

    async def _text(self, deployment: str, path: str, body: dict[str, Any]) -> tuple[str | None, float, str | None]:
        answer, ms, error = await self._post(deployment, path, body)
        choices = answer.get("choices") if isinstance(answer, dict) else None
        first = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        message = first.get("message")
        text = message.get("content") if isinstance(message, dict) else first.get("text")
        if error is None and not isinstance(text, str):
            error = "bad_answer"
        return (text if isinstance(text, str) else None), ms, error

    async def _embed(
        self, deployment: str, model: str, texts: list[str]
    ) -> tuple[list[list[float]] | None, float, str | None]:
        answer, ms, error = await self._post(deployment, "/v1/embeddings", {"model": model, "input": texts})
        data = answer.get("data") if isinstance(answer, dict) else None
        try:
            assert isinstance(data, list)
            vectors = [[float(v) for v in item["embedding"]] for item in sorted(data, key=lambda d: d["index"])]
            assert len(vectors) == len(texts)
            assert all(len(v) == len(vectors[0]) and all(math.isfinite(x) for x in v) for v in vectors)
        except (AssertionError, KeyError, TypeError, ValueError):
            return None, ms, error or "bad_answer"
        return vectors, ms, None

    async def _post(self, deployment: str, path: str, body: dict[str, Any]) -> tuple[Any, float, str | None]:
        assert self._gateway is not None
        sample, status, answer = await self._gateway.post(path, body)
        if status in _REFUSED and self._refused is None:
            self._refused = (
                f"the inference key may not use deployment {deployment} through the gateway "
                f"({sample.error}): use a key of a tenant that may, or leave the deployment out of the suite"
            )
        return answer, sample.e2e_ms, sample.error

    async def _served_name(self, deployment: str, *, ready: bool = False) -> str:
        """The model name a client calls `deployment` by (its alias, or its model's name)."""
        if deployment not in self._served:
            view = await self._view(deployment)
            if ready and view.ready < 1:
                raise Unavailable(
                    f"deployment {deployment!r} has no Ready replica: wait until `nexa deployments show "
                    f"{deployment}` shows one, then run it again"
                )
            self._served[deployment] = view.deployment.alias or view.deployment.model.model
        return self._served[deployment]

    async def _canary_name(self, deployment: str) -> str:
        """The model name that reaches `deployment`'s canary replicas alone; Unavailable while none is Ready."""
        view = await self._view(deployment)
        if view.deployment.canary is None or view.canary_ready < 1:
            raise Unavailable(
                f"deployment {deployment!r} has no Ready canary replica: start one (`nexa deployments canary`) "
                "and wait until `nexa deployments show` shows it Ready"
            )
        return CANARY_EVAL_PREFIX + deployment

    async def _rollout_name(self, deployment: str) -> str:
        """The model name that reaches the new replicas of `deployment`'s rollout alone; Unavailable
        while it runs no rollout."""
        view = await self._view(deployment)
        if view.deployment.rollout is None:
            raise Unavailable(
                f"deployment {deployment!r} has no rollout in progress: `nexa deployments rollout status "
                f"{deployment}` shows it"
            )
        return ROLLOUT_EVAL_PREFIX + deployment

    async def _view(self, deployment: str) -> DeploymentView:
        try:
            view: DeploymentView = await self._call(self._api.get, f"/api/v1/deployments/{deployment}", DeploymentView)
        except RemoteError as exc:
            if exc.status == 404:
                raise NotFound(f"no deployment {deployment!r}: `nexa deployments list` shows them") from None
            raise
        return view

    async def _update_job(self, progress: float, summary: str) -> None:
        if self._job is not None:
            update = JobUpdate(progress=min(1.0, progress), summary=summary)
            await self._call(self._api.post, f"/api/v1/jobs/{self._job}", Job, body=_body(update))

    async def _finish_job(self, exc: BaseException) -> None:
        if self._job is None:
            return
        interrupted = isinstance(exc, KeyboardInterrupt | trio.Cancelled)
        summary = "interrupted" if interrupted else str(getattr(exc, "message", None) or type(exc).__name__)
        try:
            state = JobState.CANCELLED if interrupted else JobState.FAILED
            update = JobUpdate(state=state, summary=summary[:500])
            await self._call(self._api.post, f"/api/v1/jobs/{self._job}", Job, body=_body(update))
        except NexaError:
            pass  # the job shows failed after its staleness limit


def _body(value: object) -> object:
    return codec.api.unstructure(value)


def _result(case: ev.SuiteCase, score: float, passed: bool, ms: float, answer: str) -> ev.CaseResult:
    return ev.CaseResult(
        id=case.id,
        metric=case.metric,
        score=round(max(-1.0, min(1.0, score)), 6),
        passed=passed,
        e2e_ms=round(ms, 3),
        answer=answer[: ev.MAX_KEPT_ANSWER_CHARS],
    )


def _failed(case: ev.SuiteCase, error: str, ms: float, answer: str = "") -> ev.CaseResult:
    return attrs.evolve(_result(case, 0.0, False, ms, answer), error=error[:64])


def _cosine(a: list[float], b: list[float]) -> float:
    na, nb = math.sqrt(math.fsum(x * x for x in a)), math.sqrt(math.fsum(x * x for x in b))
    return 0.0 if na == 0 or nb == 0 else math.fsum(x * y for x, y in zip(a, b, strict=True)) / (na * nb)


def _unfenced(text: str) -> str:
    """An answer's JSON without a Markdown code fence around it."""
    inner = text.strip()
    if inner.startswith("```"):
        inner = inner.split("\n", 1)[1] if "\n" in inner else ""
        inner = inner.rsplit("```", 1)[0]
    return inner


def _judged(verdict: str) -> float | None:
    """The judge's score: `score: X` (0..1), else its first PASS (1) or FAIL (0); None: neither."""
    if (found := _JUDGE_SCORE.search(verdict)) is not None:
        value = float(found.group(1))
        return value if 0.0 <= value <= 1.0 else None
    if (word := _JUDGE_WORD.search(verdict)) is not None:
        return 1.0 if word.group(1).lower() == "pass" else 0.0
    return None
