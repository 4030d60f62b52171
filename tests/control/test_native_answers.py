"""What the gateway checks and meters in a natively served API's answer (pure): Anthropic's Messages
API and OpenAI's Responses API passed through (`control/datapath/native.py`), their unary answers
and stream events read with `answers`."""

from __future__ import annotations

import json

import pytest

from nexa.contracts.gateway import Capability
from nexa.control.datapath import answers, native
from nexa.errors import FieldNotSupported


def event(kind: str, **data: object) -> bytes:
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data})}\n\n".encode()


def test_native_stream_events_are_checked_and_their_usage_read() -> None:
    start = answers.check_native_event(event("message_start", message={"usage": {"input_tokens": 7}}))
    assert start.problem is None and start.prompt_tokens == 7 and not start.done
    delta = answers.check_native_event(event("content_block_delta", delta={"type": "text_delta", "text": "x"}))
    assert delta.text and delta.prompt_tokens is None
    last = answers.check_native_event(event("message_delta", usage={"output_tokens": 5}))
    assert last.completion_tokens == 5
    assert answers.check_native_event(event("message_stop")).done
    done = answers.check_native_event(
        event("response.completed", response={"usage": {"input_tokens": 3, "output_tokens": 4}})
    )
    assert done.done and (done.prompt_tokens, done.completion_tokens) == (3, 4)
    # What a broken or hostile runtime might send: refused, naming why.
    assert answers.check_native_event(b"data: [1]\n\n").problem
    assert answers.check_native_event(b"bogus line\n\n").problem
    assert answers.check_native_event(event("message_delta", usage={"output_tokens": -1})).problem


def test_native_unary_answers_are_checked_and_their_usage_read() -> None:
    message = {"type": "message", "content": [], "usage": {"input_tokens": 2, "output_tokens": 9}}
    parsed, problem = answers.unary_answer(json.dumps(message).encode(), Capability.MESSAGES)
    assert problem == "" and parsed is not None
    assert answers.native_usage(Capability.MESSAGES, parsed) == (2, 9)
    response = {"object": "response", "output": [], "usage": {"input_tokens": 1, "output_tokens": 1}}
    assert answers.unary_answer(json.dumps(response).encode(), Capability.RESPONSES)[1] == ""
    counted, _ = answers.unary_answer(b'{"input_tokens": 12}', Capability.MESSAGE_TOKENS)
    assert counted is not None and answers.native_usage(Capability.MESSAGE_TOKENS, counted) == (12, None)
    assert answers.unary_answer(b'{"choices": []}', Capability.MESSAGES)[1] == "not a message object"
    assert (
        answers.unary_answer(b'{"object": "response", "output": 1}', Capability.RESPONSES)[1]
        == "`output` is not a list"
    )
    assert answers.unary_answer(b'{"input_tokens": -3}', Capability.MESSAGE_TOKENS)[0] is None


@pytest.mark.parametrize("field", ["previous_response_id", "conversation", "background"])
def test_stored_response_state_is_refused_on_pass_through(field: str) -> None:
    with pytest.raises(FieldNotSupported) as refused:
        native.stateful_problem(Capability.RESPONSES, {field: "resp_1"})
    assert refused.value.field == field
    native.stateful_problem(Capability.RESPONSES, {"store": True, "background": False})  # passed on as sent
    native.stateful_problem(Capability.MESSAGES, {"previous_response_id": "x"})  # not the Responses API


def test_only_previous_response_id_passes_where_a_replica_keeps_responses() -> None:
    native.stateful_problem(Capability.RESPONSES, {"previous_response_id": "resp_1"}, keeps=True)
    for field in ("conversation", "background"):
        with pytest.raises(FieldNotSupported) as refused:
            native.stateful_problem(Capability.RESPONSES, {field: "x"}, keeps=True)
        assert refused.value.field == field and "send the whole conversation" in refused.value.message
    # Why a background response is refused even there: it would run on unmetered, past its deadline.
    with pytest.raises(FieldNotSupported, match="could neither meter its tokens nor hold it to your quotas"):
        native.stateful_problem(Capability.RESPONSES, {"background": True}, keeps=True)


def test_a_responses_answer_gives_its_id_unary_or_from_its_stream_split_anywhere() -> None:
    assert native._IdReader.unary(b'{"object": "response", "id": "resp_a"}') == "resp_a"
    assert native._IdReader.unary(b'{"object": "chat.completion", "id": "x"}') == ""
    assert native._IdReader.unary(b"not json") == ""
    stream = event("response.created", sequence_number=0, response={"id": "resp_b", "status": "in_progress"})
    stream += event("response.output_text.delta", sequence_number=1, delta="hi")
    for cut in range(1, len(stream)):
        reader = native._IdReader()
        reader.feed(stream[:cut])
        reader.feed(stream[cut:])
        assert reader.found == "resp_b", cut
    reader = native._IdReader()
    reader.feed(event("error", code="x") + b"data: [1]\n\n")
    assert reader.found == ""
