"""A stream's output events are counted once, by the controller (`calls.Answer`), which checks every
event anyway: the completion count when the runtime sends no usage, and the usage event a client
that asked for one gets from a runtime that sends none (llama-cpp-python ignores stream_options).

The node relay and the controller relay are the real ones (tests/support/relay.py: a small
OpenAI-shaped runtime on 127.0.0.1 over a real Link/Uplink pair); the `Answer` is the gateway's.
"""

from __future__ import annotations

import json

import pytest
import trio

from nexa.config import GatewayConfig
from nexa.control.datapath import answers
from nexa.control.datapath.calls import Answer, Progress, Work, prompt_estimate
from nexa.control.datapath.metering import Meter
from nexa.telemetry import Metrics
from tests.support.relay import TIMEOUT_S, chat_work, data_path, infer_head, request

MESSAGES = [{"role": "user", "content": "how many tokens is this prompt, about?"}]


async def _through_the_gateway(work: Work, runtime_request: bytes, *, strip: bool) -> tuple[bytes, Progress]:
    meter = Meter(GatewayConfig(), None, Metrics())  # type: ignore[arg-type]  # no store: nothing flushed here
    progress = Progress(work=work, started=trio.current_time())
    head = infer_head(stream=True, strip_usage_chunk=strip, prompt_tokens_estimate=prompt_estimate(work))
    with trio.fail_after(TIMEOUT_S):
        async with data_path() as p, p.relay.open("n1", "r1", head, runtime_request) as stream:
            first = await stream.receive_all()
            answer = Answer(progress, meter, kind="stream", stream=stream, first=first)
            body = await answer.read_all()
            await answer.conclude()
            assert answer.error is None
    return body, progress


def _events(body: bytes) -> list[bytes]:
    return [e for e in body.split(b"\n\n") if e]


async def test_a_runtime_without_usage_gets_one_made_from_the_controllers_count_when_the_client_asked() -> None:
    work = chat_work(stream=True, include_usage=True, messages=MESSAGES)
    body, progress = await _through_the_gateway(work, request("stream", events=4), strip=False)
    events = _events(body)
    assert events[-1] == b"data: [DONE]"
    made = json.loads(events[-2].removeprefix(b"data: "))
    estimate = prompt_estimate(work)
    assert estimate > 0
    assert made["choices"] == []
    assert made["usage"] == {"prompt_tokens": estimate, "completion_tokens": 4, "total_tokens": estimate + 4}
    assert body.count(b'"usage"') == 1
    assert (progress.prompt_tokens, progress.completion_tokens) == (estimate, 4)  # what is metered


async def test_a_client_that_did_not_ask_gets_no_usage_and_the_count_is_metered() -> None:
    body, progress = await _through_the_gateway(
        chat_work(stream=True, messages=MESSAGES), request("stream", events=5), strip=True
    )
    assert b'"usage"' not in body
    assert _events(body)[-1] == b"data: [DONE]"
    assert progress.completion_tokens == 5


async def test_the_runtimes_own_usage_is_kept_and_nothing_is_made() -> None:
    runtime_request = request("stream", events=6, stream_options={"include_usage": True})
    body, progress = await _through_the_gateway(
        chat_work(stream=True, include_usage=True, messages=MESSAGES), runtime_request, strip=False
    )
    assert body.count(b'"usage":{') == 1
    assert b"nexa-usage" not in body
    assert (progress.prompt_tokens, progress.completion_tokens) == (7, 6)  # the runtime's figures


@pytest.mark.parametrize(
    ("event", "text", "usage", "done"),
    [
        (b'data: {"choices":[{"delta":{"content":"a"}}]}\n\n', True, False, False),
        (b'data: {"choices":[{"delta":{"role":"assistant","content":""}}]}\n\n', False, False, False),
        (b'data: {"choices":[{"text":"c"}],"usage":null}\n\n', True, False, False),
        (b'data: {"choices":[],"usage":{"prompt_tokens":1,"completion_tokens":2}}\n\n', False, True, False),
        (b'data: {"choices":[{"delta":{"content":"x"}}],"usage":{"completion_tokens":1}}\n\n', True, True, False),
        (b"data: [DONE]\n\n", False, False, True),
        (b": keep-alive\n\n", False, False, False),
    ],
    ids=["content", "empty-content", "text", "usage-only", "content-and-usage", "done", "comment"],
)
def test_each_event_is_read_once_for_what_it_carries(event: bytes, text: bool, usage: bool, done: bool) -> None:
    check = answers.check_event(event)
    assert check == answers.EventCheck(None, done=done, text=text, usage=usage)


def test_a_bad_event_is_a_problem_and_counts_nothing() -> None:
    check = answers.check_event(b'data: {"choices":[{"delta":{"content":"a"}}],"usage":{"completion_tokens":-1}}\n\n')
    assert check.problem is not None and not check.text and not check.usage
