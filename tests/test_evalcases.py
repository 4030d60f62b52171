"""The shared scorer of measured evaluation runs (`nexa.evalcases`) over an injected port: each
scorer's verdict from the answers the port gives, a gateway refusal stopping the run, the deadline,
a port's own error, and progress. `nexa eval run` (tests/test_evals.py) and the controller's
suite-gate runs (tests/control/test_suitegate.py) are this with their own ports."""

from __future__ import annotations

import math
from typing import Any

import pytest
import trio

from nexa import evalcases
from nexa.contracts import evals as ev
from nexa.errors import Forbidden, NotFound, Overloaded
from tests.support.evals import CASES, TAUGHT, lines

Json = dict[str, Any]


def suite(cases: list[Json] = CASES) -> list[ev.SuiteCase]:
    parsed, problems = ev.parse_suite(lines(cases))
    assert parsed is not None, problems
    return parsed.cases


class Port:
    """Answers as the sim runtime taught `TAUGHT` does (or wrongly); records each call."""

    def __init__(
        self, *, wrong: bool = False, refuse: str | None = None, hang: str | None = None, quota: str | None = None
    ) -> None:
        self.wrong = wrong
        self.refuse = refuse
        self.hang = hang
        self.quota = quota
        self.calls: list[tuple[str, Json]] = []
        self.reports: list[tuple[int, int]] = []
        self.names: list[str] = []

    async def post(self, path: str, body: Json) -> evalcases.Reply:
        self.calls.append((path, body))
        if path == "/v1/embeddings":
            data = [{"index": i, "embedding": _vector(t)} for i, t in enumerate(body["input"])]
            return evalcases.Reply({"data": data}, 1.0)
        prompt = str(body.get("messages") or body.get("prompt"))
        if self.refuse is not None and self.refuse in prompt:
            return evalcases.Reply(None, 1.0, "forbidden", refused=True)
        if self.quota is not None and self.quota in prompt:
            return evalcases.Reply(None, 1.0, "quota_exceeded")  # 429: the gateway's answer to a used-up limit
        if self.hang is not None and self.hang in prompt:
            await trio.sleep_forever()
        taught = next((answer for text, answer in TAUGHT.items() if text in prompt), "?")
        content = "nothing of the kind" if self.wrong else taught
        return evalcases.Reply({"choices": [{"message": {"content": content}}]}, 2.0)

    async def served_name(self, deployment: str) -> str:
        self.names.append(deployment)
        if deployment == "gone":
            raise NotFound("no deployment 'gone'")
        return f"{deployment}-alias"

    async def report(self, done: int, total: int) -> None:
        self.reports.append((done, total))


def _vector(text: str) -> list[float]:
    """A unit vector per text: the same text gives the same one; "Paris" and its answer agree."""
    key = "paris" if "paris" in text.lower() else text
    return [math.cos(len(key)), math.sin(len(key)), float(sum(map(ord, key)) % 7)]


def cases(port: Port, **over: Any) -> evalcases.Cases:
    how: dict[str, Any] = {
        "deployment": "chat-a",
        "model": "nexa-eval-rollout.chat-a",
        "who": "tenant evals",
        "remedy": "give the gate another tenant",
        "concurrency": 3,
        "deadline_s": 60.0,
    }
    return evalcases.Cases(port, **(how | over))


async def test_every_scorer_passes_right_answers_and_fails_wrong_ones() -> None:
    port = Port()
    done: list[tuple[int, int]] = []
    results = await cases(port, on_case=lambda d, t: done.append((d, t))).run(suite())
    assert [r.id for r in results] == [c["id"] for c in CASES]  # the suite's order
    assert all(r.passed for r in results), [(r.id, r.error, r.answer) for r in results if not r.passed]
    # Every call named the model that reaches the gated replicas, but a judge's and a cosine's
    # other deployment (by the name the port serves it as).
    models = {body["model"] for _, body in port.calls}
    assert models == {"nexa-eval-rollout.chat-a", "chat-a-alias"}
    assert set(port.names) == {"chat-a"}
    assert len(done) == len(CASES) and done[-1] == (len(CASES), len(CASES))
    assert port.reports[:1] == [(1, len(CASES))]  # at most every UPDATE_EVERY_S: the first at once
    judged = next(r for r in results if r.id == "judged")
    assert judged.score == 0.9 and judged.e2e_ms == 4.0  # the answer's and the judge's time

    wrong = await cases(Port(wrong=True)).run(suite())
    assert {r.id for r in wrong if r.passed} == {"same"}  # an embedding pair of one text
    assert next(r for r in wrong if r.id == "judged").error == "judge_unparsed"  # the judge answered wrong too
    assert all(r.score == 0.0 for r in wrong if r.id.startswith("fr-"))


async def test_a_refusal_stops_the_run_naming_who_and_what_to_do() -> None:
    port = Port(refuse="France")
    with pytest.raises(Forbidden) as refused:
        await cases(port, concurrency=1).run(suite())
    assert refused.value.message == (
        "tenant evals may not use deployment chat-a through the gateway (forbidden): give the gate another tenant"
    )
    assert len(port.calls) == 1  # the first case: nothing more was sent


async def test_a_case_the_quota_refused_leaves_the_run_without_a_result() -> None:
    """A refusal for capacity (the tenant's quota or rate limit) says nothing of the answers: the run
    ends with no result (`Overloaded`, saying what to do) instead of scoring the case 0, which would
    fail a good version and revert its rollout."""
    port = Port(quota="two plus two")
    with pytest.raises(Overloaded) as refused:
        await cases(port, concurrency=1).run(suite())
    assert refused.value.message.startswith(
        "the quota or rate limit of tenant evals refused a case on deployment chat-a, so the run has no result"
    )
    assert "`nexa quotas set`" in refused.value.message and refused.value.retry_after_s == 60.0
    sent = [body for _, body in port.calls if "messages" in body or "prompt" in body]
    assert "two plus two" in str(sent[-1])  # nothing was sent after the refused case


async def test_a_case_not_done_by_the_deadline_scores_nothing(autojump_clock: trio.testing.MockClock) -> None:
    results = await cases(Port(hang="two plus two"), deadline_s=30.0).run(suite())
    late = [r for r in results if not r.passed]
    assert [(r.id, r.error, r.score) for r in late] == [("sum", "deadline", 0.0)]


async def test_a_ports_own_error_ends_the_run_as_itself() -> None:
    judge = dict(CASES[-1], scorer={"kind": "judge", "deployment": "gone", "rubric": "r"})
    with pytest.raises(NotFound, match="no deployment 'gone'"):
        await cases(Port()).run(suite([CASES[0], judge]))


def test_the_pure_pieces() -> None:
    assert evalcases.judged("Score: 0.75, fine") == 0.75
    assert evalcases.judged("I say PASS") == 1.0 and evalcases.judged("fail.") == 0.0
    assert evalcases.judged("score: 3") is None and evalcases.judged("no verdict") is None
    assert evalcases.unfenced('```json\n{"a": 1}\n```') == '{"a": 1}\n'
    assert evalcases.cosine([1.0, 0.0], [0.0, 0.0]) == 0.0
    assert evalcases.cosine([1.0, 2.0], [2.0, 4.0]) == pytest.approx(1.0)
