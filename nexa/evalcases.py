"""The cases of one measured evaluation run: each sent through a gateway the caller gives, and
scored. Shared by `nexa eval run` (`bench.evals`: the gateway over HTTP with an inference key) and
the controller's own suite-gate runs (`control.operations.suitegate`: the gateway in-process, as
the gate's tenant); the caller does the rest (the suite, the job, the record).

What is injected (`Port`): one gateway call (`post`: an OpenAI-shaped body to a `/v1` path, its
answer's JSON or the error it ended with), the model name a client calls another deployment by
(`served_name`, for judge and cosine scorers that name one), and where progress goes (`report`,
at most every `UPDATE_EVERY_S`). Nothing here opens a connection or writes a record.

Cases run `concurrency` at a time until all have answered or the deadline passes (a case not done
by then scores 0 with the error `deadline`). A gateway that refuses the caller (`Reply.refused`:
401/403) stops the run: `Forbidden`, naming the deployment, and no result. So does a case refused for
the caller's quota or rate limit (`quota_exceeded`): `Overloaded`, no result — a refusal for capacity
says nothing of the answers, and scoring it 0 would fail a good version. Answers are never
logged; each case keeps the start of its answer (`MAX_KEPT_ANSWER_CHARS`) for `nexa eval show`.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Callable, Sequence
from typing import Any, Final, Protocol

import attrs
import trio

from nexa.contracts import codec
from nexa.contracts import evals as ev
from nexa.errors import Forbidden, NexaError, Overloaded, QuotaExceeded

#: Scorer answers: a judge's `score: 0.8` (or `score = 1`), else its first PASS or FAIL.
_JUDGE_SCORE: Final = re.compile(r"score\s*[:=]\s*(-?\d+(?:\.\d+)?)", re.IGNORECASE)
_JUDGE_WORD: Final = re.compile(r"\b(pass|fail)\b", re.IGNORECASE)
_NUMBER: Final = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")
#: Progress is reported at most this often (seconds).
UPDATE_EVERY_S: Final = 1.0
#: When a run a quota refused may be tried again, as its error says (s).
QUOTA_RETRY_S: Final = 60.0
JUDGE_MAX_TOKENS: Final = 64


@attrs.frozen
class Reply:
    """One gateway call as the run sees it: the answer's JSON (None unless it succeeded), its time
    (ms), the error code it ended with (None: it succeeded) and whether the gateway refused the
    caller itself (401/403: the run stops)."""

    answer: Any
    ms: float
    error: str | None = None
    refused: bool = False


class Port(Protocol):
    """The run's I/O (see the module docstring)."""

    async def post(self, path: str, body: dict[str, Any]) -> Reply: ...

    async def served_name(self, deployment: str) -> str: ...

    async def report(self, done: int, total: int) -> None: ...


class Cases:
    """Send and score every case of a suite against `model` (which reaches `deployment`); a refusal
    names the caller (`who`: "the inference key", "tenant acme") and what to do (`remedy`);
    `on_case` is told (done, total) as each case finishes."""

    def __init__(
        self,
        port: Port,
        *,
        deployment: str,
        model: str,
        who: str,
        remedy: str,
        concurrency: int,
        deadline_s: float,
        on_case: Callable[[int, int], None] = lambda _done, _total: None,
    ) -> None:
        self._port = port
        self._deployment = deployment
        self._model = model
        self._who = who
        self._remedy = remedy
        self._concurrency = concurrency
        self._deadline_s = deadline_s
        self._on_case = on_case
        self._results: dict[str, ev.CaseResult] = {}
        self._refused: str | None = None
        self._quota: str | None = None

    async def run(self, cases: Sequence[ev.SuiteCase]) -> list[ev.CaseResult]:
        """Each case's result, in the suite's order; Forbidden when the gateway refused the caller,
        Overloaded when its quota refused a case."""
        total = len(cases)
        send, receive = trio.open_memory_channel[ev.SuiteCase](max(1, total))
        for case in cases:
            send.send_nowait(case)
        send.close()
        last_update = 0.0

        async def worker(scope: trio.CancelScope) -> None:
            nonlocal last_update
            async for case in receive:
                self._results[case.id] = await self._case(case)
                if self._refused is not None or self._quota is not None:
                    scope.cancel()
                    return
                self._on_case(len(self._results), total)
                if time.monotonic() - last_update >= UPDATE_EVERY_S:
                    last_update = time.monotonic()
                    await self._port.report(len(self._results), total)

        with trio.move_on_after(self._deadline_s) as scope:
            try:
                async with trio.open_nursery() as nursery:
                    for _ in range(min(self._concurrency, total)):
                        nursery.start_soon(worker, scope)
            except BaseExceptionGroup as group:
                # A port's own error (a deployment a scorer names is gone) ends the run as itself.
                ours, others = group.split(NexaError)
                if ours is None or others is not None:
                    raise
                raise _first(ours) from None
        if self._refused is not None:
            raise Forbidden(self._refused)
        if self._quota is not None:
            raise Overloaded(self._quota, retry_after_s=QUOTA_RETRY_S)
        return [self._results.get(c.id) or failed(c, "deadline", 0.0) for c in cases]

    async def _case(self, case: ev.SuiteCase) -> ev.CaseResult:
        scorer = case.scorer
        if case.kind is ev.RequestKind.EMBEDDING_PAIR:
            target = scorer.params.get("deployment") or self._deployment
            name = self._model if target == self._deployment else await self._port.served_name(target)
            vectors, ms, error = await self._embed(target, name, list(case.request["embedding_pair"]))
            if vectors is None:
                return failed(case, error or "bad_answer", ms)
            similarity = cosine(vectors[0], vectors[1])
            return result(case, similarity, similarity >= scorer.params["min"], ms, f"cosine {similarity:.4f}")
        path = "/v1/chat/completions" if case.kind is ev.RequestKind.CHAT else "/v1/completions"
        body = {"model": self._model, **case.request}
        answer, ms, error = await self._text(self._deployment, path, body)
        if answer is None:
            return failed(case, error or "bad_answer", ms)
        return await self._score(case, answer, ms)

    async def _score(self, case: ev.SuiteCase, answer: str, ms: float) -> ev.CaseResult:  # noqa: PLR0911 -- one per scorer
        p, kind = case.scorer.params, case.scorer.kind
        text = answer[: ev.MAX_ANSWER_CHARS]
        if kind in (ev.ScorerKind.EXACT, ev.ScorerKind.CONTAINS):
            got, want = (text.strip(), p["expected"].strip())
            if p.get("ignore_case"):
                got, want = got.casefold(), want.casefold()
            ok = got == want if kind is ev.ScorerKind.EXACT else want in got
            return result(case, float(ok), ok, ms, answer)
        if kind is ev.ScorerKind.REGEX:
            ok = case.scorer.compiled.search(text) is not None
            return result(case, float(ok), ok, ms, answer)
        if kind is ev.ScorerKind.JSON_SCHEMA:
            try:
                ok = bool(case.scorer.compiled.is_valid(codec.parse_json(unfenced(text))))
            except NexaError:
                ok = False
            return result(case, float(ok), ok, ms, answer)
        if kind is ev.ScorerKind.NUMBER:
            found = _NUMBER.search(text)
            ok = found is not None and abs(float(found.group()) - p["expected"]) <= p.get("tolerance", 0.0)
            return result(case, float(ok), ok, ms, answer)
        if kind is ev.ScorerKind.COSINE:
            target = p["deployment"]
            name = await self._port.served_name(target)
            vectors, more, error = await self._embed(target, name, [text, p["expected"]])
            if vectors is None:
                return failed(case, error or "bad_answer", ms + more)
            similarity = cosine(vectors[0], vectors[1])
            return result(case, similarity, similarity >= p["min"], ms + more, answer)
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
        body = {"model": await self._port.served_name(target), "messages": messages, "max_tokens": JUDGE_MAX_TOKENS}
        verdict, more, error = await self._text(target, "/v1/chat/completions", body)
        if verdict is None:
            return failed(case, error or "bad_answer", ms + more)
        score = judged(verdict)
        if score is None:
            return failed(case, "judge_unparsed", ms + more, answer)
        return result(case, score, score >= p.get("min", 0.5), ms + more, answer)

    async def _text(self, deployment: str, path: str, body: dict[str, Any]) -> tuple[str | None, float, str | None]:
        reply = await self._post(deployment, path, body)
        answer, error = reply.answer, reply.error
        choices = answer.get("choices") if isinstance(answer, dict) else None
        first = choices[0] if isinstance(choices, list) and choices and isinstance(choices[0], dict) else {}
        message = first.get("message")
        text = message.get("content") if isinstance(message, dict) else first.get("text")
        if error is None and not isinstance(text, str):
            error = "bad_answer"
        return (text if isinstance(text, str) else None), reply.ms, error

    async def _embed(
        self, deployment: str, model: str, texts: list[str]
    ) -> tuple[list[list[float]] | None, float, str | None]:
        reply = await self._post(deployment, "/v1/embeddings", {"model": model, "input": texts})
        data = reply.answer.get("data") if isinstance(reply.answer, dict) else None
        try:
            assert isinstance(data, list)
            vectors = [[float(v) for v in item["embedding"]] for item in sorted(data, key=lambda d: d["index"])]
            assert len(vectors) == len(texts)
            assert all(len(v) == len(vectors[0]) and all(math.isfinite(x) for x in v) for v in vectors)
        except (AssertionError, KeyError, TypeError, ValueError):
            return None, reply.ms, reply.error or "bad_answer"
        return vectors, reply.ms, None

    async def _post(self, deployment: str, path: str, body: dict[str, Any]) -> Reply:
        reply = await self._port.post(path, body)
        if reply.refused and self._refused is None:
            self._refused = (
                f"{self._who} may not use deployment {deployment} through the gateway ({reply.error}): {self._remedy}"
            )
        if reply.error == QuotaExceeded.code and self._quota is None:
            self._quota = (
                f"the quota or rate limit of {self._who} refused a case on deployment {deployment}, so the run has "
                "no result (a refusal for capacity says nothing of the answers): give it room for the suite's "
                "cases (`nexa quotas set`), or run the suite later"
            )
        return reply


def _first(group: BaseExceptionGroup[NexaError]) -> NexaError:
    leaf = group.exceptions[0]
    return _first(leaf) if isinstance(leaf, BaseExceptionGroup) else leaf


def result(case: ev.SuiteCase, score: float, passed: bool, ms: float, answer: str) -> ev.CaseResult:
    return ev.CaseResult(
        id=case.id,
        metric=case.metric,
        score=round(max(-1.0, min(1.0, score)), 6),
        passed=passed,
        e2e_ms=round(ms, 3),
        answer=answer[: ev.MAX_KEPT_ANSWER_CHARS],
    )


def failed(case: ev.SuiteCase, error: str, ms: float, answer: str = "") -> ev.CaseResult:
    return attrs.evolve(result(case, 0.0, False, ms, answer), error=error[:64])


def cosine(a: list[float], b: list[float]) -> float:
    na, nb = math.sqrt(math.fsum(x * x for x in a)), math.sqrt(math.fsum(x * x for x in b))
    return 0.0 if na == 0 or nb == 0 else math.fsum(x * y for x, y in zip(a, b, strict=True)) / (na * nb)


def unfenced(text: str) -> str:
    """An answer's JSON without a Markdown code fence around it."""
    inner = text.strip()
    if inner.startswith("```"):
        inner = inner.split("\n", 1)[1] if "\n" in inner else ""
        inner = inner.rsplit("```", 1)[0]
    return inner


def judged(verdict: str) -> float | None:
    """The judge's score: `score: X` (0..1), else its first PASS (1) or FAIL (0); None: neither."""
    if (found := _JUDGE_SCORE.search(verdict)) is not None:
        value = float(found.group(1))
        return value if 0.0 <= value <= 1.0 else None
    if (word := _JUDGE_WORD.search(verdict)) is not None:
        return 1.0 if word.group(1).lower() == "pass" else 0.0
    return None
