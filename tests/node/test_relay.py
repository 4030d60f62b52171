"""The node's inference relay against a real HTTP runtime on 127.0.0.1, over a real Link/Uplink pair.

The "runtime" is a small OpenAI-shaped ASGI app served by hypercorn in this test's trio run: it is
the far end, not the thing under test. The controller side is the real `nexa.control.datapath.relay.Relay`.
Every I/O test runs under an absolute `trio.fail_after`. The harness is tests/support/relay.py (the
controller relay tests, tests/control/test_relay.py, use it too).
"""

from __future__ import annotations

import json
import re

import pytest
import trio
import trio.testing

from nexa.config import Bytes, RelayConfig
from nexa.contracts import wire
from nexa.contracts.gateway import Capability
from nexa.node.relay import _plain_events, _split_events
from tests.support import supervisor as supervised
from tests.support.relay import (
    CHAT,
    SD_IMAGE_B64,
    TIMEOUT_S,
    closed_port,
    data_path,
    drain,
    infer_head,
    request,
    wait_until,
)

# --- unary and streamed answers -----------------------------------------------------------------


async def test_unary_answer_comes_back_whole_with_its_usage() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with data_path(relay_cfg=RelayConfig(max_chunk_bytes=Bytes(100))) as p:
            async with p.relay.open("n1", "r1", infer_head(), request("unary", pad=1000)) as s:
                body, end = await drain(s)
            answer = json.loads(body)
            assert answer["choices"][0]["message"]["content"] == "x" * 1000
            assert end.status is wire.EndStatus.OK
            assert (end.prompt_tokens, end.completion_tokens, end.http_status) == (7, 3, 200)
            assert end.first_byte_sent
            assert end.runtime_ms > 0
            assert p.node.statistics().chunks_sent == -(-len(body) // 100)  # 100-byte chunks
            path, headers, sent = p.runtime.seen[0]
            assert (path, sent) == (CHAT, request("unary", pad=1000))
            assert headers["x-nexa-request-id"] == "r1"
            assert headers["content-type"] == "application/json"


async def test_stream_forwards_events_and_reads_usage_from_the_runtime() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with data_path() as p:
            body_json = request("stream", events=6, stream_options={"include_usage": True})
            async with p.relay.open("n1", "r1", infer_head(stream=True), body_json) as s:
                body, end = await drain(s)
    events = body.split(b"\n\n")
    assert events[-2:] == [b"data: [DONE]", b""]
    assert b'"choices":[],"usage":{"prompt_tokens":7,"completion_tokens":6' in body  # kept: the client asked
    assert end.status is wire.EndStatus.OK
    assert (end.prompt_tokens, end.completion_tokens) == (7, 6)


async def test_the_usage_only_event_is_dropped_when_asked_after_its_counts_are_read() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with data_path() as p:
            body_json = request("stream", events=6, stream_options={"include_usage": True})
            head = infer_head(stream=True, strip_usage_chunk=True)
            async with p.relay.open("n1", "r1", head, body_json) as s:
                body, end = await drain(s)
    assert b'"choices":[]' not in body
    assert body.count(b'"content":"tok') == 6
    assert body.endswith(b"data: [DONE]\n\n")
    assert (end.prompt_tokens, end.completion_tokens) == (7, 6)


async def test_without_usage_from_the_runtime_the_node_counts_nothing_and_adds_nothing() -> None:
    """The controller counts the output events (`calls.Answer`, tests/control/test_stream_usage.py):
    the node reports the prompt estimate it was given and no completion count, and adds no usage
    event even when the client asked for one (llama-cpp-python ignores stream_options)."""
    for strip in (True, False):
        with trio.fail_after(TIMEOUT_S):
            head = infer_head(stream=True, strip_usage_chunk=strip, prompt_tokens_estimate=9)
            async with data_path() as p, p.relay.open("n1", "r1", head, request("stream", events=4)) as s:
                body, end = await drain(s)
        assert end.status is wire.EndStatus.OK
        assert (end.prompt_tokens, end.completion_tokens) == (9, None)
        assert b'"usage"' not in body
        assert body.count(b'"content":"tok') == 4
        assert body.endswith(b"data: [DONE]\n\n")


def test_events_split_on_blank_lines_and_keep_the_rest() -> None:
    events, rest = _split_events(b"data: a\n\ndata: b\r\n\r\ndata: c\n\ndata: part")
    assert events == [b"data: a\n\n", b"data: b\r\n\r\n", b"data: c\n\n"]
    assert rest == b"data: part"
    assert _split_events(b"data: x\n") == ([], b"data: x\n")


def test_a_read_of_whole_content_events_is_relayed_as_it_is() -> None:
    two = b'data: {"choices":[{"delta":{"content":"a"}},{"delta":{"content":"b"}}]}\n\n'
    role = b'data: {"choices":[{"delta":{"role":"assistant"}}],"usage":null}\r\n\r\n'
    text = b'data: {"choices":[{"text":"c"}],"usage": null}\n\n'
    read = role + two + text + two
    assert _plain_events(read)
    assert not _plain_events(read + b"data: {")  # ends inside an event
    assert not _plain_events(read + b"data: [DONE]\n\n")
    assert not _plain_events(read + b'data: {"choices":[],"usage":{"completion_tokens":3}}\n\n')


# --- failures -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("status", "code", "message"),
    [(500, "runtime_error", ""), (503, "runtime_error", ""), (400, "runtime_rejected", "prompt is too long")],
)
async def test_a_runtime_error_answer_ends_before_the_first_byte(status: int, code: str, message: str) -> None:
    with trio.fail_after(TIMEOUT_S):
        head, body_json = infer_head(stream=True), request("status", status=status)
        async with data_path() as p, p.relay.open("n1", "r1", head, body_json) as s:
            body, end = await drain(s)
    assert body == b""
    assert end.status is wire.EndStatus.ERROR
    assert (end.code, end.http_status, end.message, end.first_byte_sent) == (code, status, message, False)


async def test_a_refused_connection_or_a_runtime_not_ready_is_runtime_unavailable() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with data_path() as p:
            p.ports["a1"] = closed_port()
            async with p.relay.open("n1", "r1", infer_head(stream=True), request("stream")) as s:
                _, refused = await drain(s)
            async with p.relay.open("n1", "r2", infer_head(assignment_id="not-ready"), request("unary")) as s:
                _, not_ready = await drain(s)
    for end in (refused, not_ready):
        assert (end.status, end.code, end.first_byte_sent) == (wire.EndStatus.ERROR, "runtime_unavailable", False)


async def test_a_stream_broken_after_some_output_is_a_runtime_error_with_first_byte_sent() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with data_path() as p, p.relay.open("n1", "r1", infer_head(stream=True), request("abort")) as s:
            body, end = await drain(s)
    assert b"tok0" in body
    assert (end.status, end.code, end.http_status, end.first_byte_sent) == (
        wire.EndStatus.ERROR,
        "runtime_error",
        200,
        True,
    )


async def test_the_deadline_ends_the_request_and_closes_it_at_the_runtime() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with data_path() as p:
            async with p.relay.open("n1", "r1", infer_head(deadline_s=0.3), request("hang")) as s:
                _, end = await drain(s)
            assert (end.status, end.code, end.first_byte_sent) == (wire.EndStatus.ERROR, "deadline_exceeded", False)
            await p.runtime.gone("r1").wait()
            assert p.node.statistics().failed == 1


async def test_more_requests_than_max_inflight_are_refused_as_node_busy() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with data_path(relay_cfg=RelayConfig(max_inflight=1)) as p:
            async with p.relay.open("n1", "r1", infer_head(), request("hang")) as first:
                await wait_until(lambda: p.node.statistics().inflight == 1)
                async with p.relay.open("n1", "r2", infer_head(), request("unary")) as second:
                    _, end = await drain(second)
                assert (end.status, end.code, end.first_byte_sent) == (wire.EndStatus.ERROR, "node_busy", False)
                assert not first.ended
            stats = p.node.statistics()
            assert (stats.busy, stats.accepted) == (1, 1)
            await p.runtime.gone("r1").wait()  # leaving `first` cancelled it at the runtime


async def test_an_unreadable_infer_head_or_an_id_unfit_for_http_is_ended_as_invalid() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with data_path() as p:
            p.node.deliver(wire.DataFrame(kind=wire.INFER, request_id="bad", head=b"{}", body=b""))
            await wait_until(lambda: p.relay.statistics().dropped_frames == 1)  # its end: no stream open here
            assert p.node.statistics().failed == 1
            async with p.relay.open("n1", "r\u00e9q", infer_head(), request("unary")) as s:
                _, end = await drain(s)
            assert (end.status, end.code) == (wire.EndStatus.ERROR, "invalid_request")
            assert p.runtime.seen == []


async def test_an_event_longer_than_a_chunk_is_passed_on_in_pieces() -> None:
    cfg = RelayConfig(max_chunk_bytes=Bytes(1000))
    with trio.fail_after(TIMEOUT_S):
        async with (
            data_path(relay_cfg=cfg) as p,
            p.relay.open("n1", "r1", infer_head(stream=True), request("stream", events=2, big=20_000)) as s,
        ):
            chunks = [chunk async for chunk in s]
    assert max(len(c) for c in chunks) <= 1000
    body = b"".join(chunks)
    assert b"y" * 20_000 in body
    assert body.endswith(b"data: [DONE]\n\n")
    assert s.end is not None
    assert s.end.status is wire.EndStatus.OK


async def test_a_flush_window_sends_the_first_chunk_at_once_and_joins_the_reads_after_it() -> None:
    """The runtime sends an event every 10 ms: with a 0.3 s window, the first read goes on at once
    and the ones after it in chunks of many events, one a window; all in order, none lost."""
    window = 0.3
    cfg = RelayConfig(flush_window_s=window)
    with trio.fail_after(TIMEOUT_S):
        async with (
            data_path(relay_cfg=cfg) as p,
            p.relay.open("n1", "r1", infer_head(stream=True), request("endless")) as s,
        ):
            opened = trio.current_time()
            chunks = []
            while len(chunks) < 4:
                chunk = await s.receive()
                assert chunk is not None
                chunks.append((trio.current_time() - opened, chunk))
    first_at, first = chunks[0]
    assert first_at < window  # not held
    assert first.count(b"\n\n") <= 2  # the role event, maybe the first token with it
    later = [chunk.count(b"\n\n") for _, chunk in chunks[1:]]
    assert min(later) >= 5, later  # ~30 events a window; one each without it
    tokens = re.findall(rb"tok(\d+)", b"".join(chunk for _, chunk in chunks))
    assert [int(t) for t in tokens] == list(range(len(tokens)))


async def test_gathering_holds_while_streams_flow_and_no_request_waits_for_its_first_bytes() -> None:
    """`NodeRelay.gathering` (the agent's wake-up moderation applies only then): not for a unary
    request, yes once a stream's runtime sent its first bytes, no while another request still waits
    for its runtime's first bytes (they go on at once), and no once the stream ended."""
    with trio.fail_after(TIMEOUT_S):
        async with data_path() as p:
            assert not p.node.gathering
            async with p.relay.open("n1", "r0", infer_head(), request("hang")):
                await wait_until(lambda: p.node.statistics().inflight == 1)
                assert not p.node.gathering  # a unary request in flight, no stream
            await wait_until(lambda: p.node.statistics().inflight == 0)
            async with p.relay.open("n1", "r1", infer_head(stream=True), request("endless")) as s:
                assert await s.receive() is not None
                assert p.node.gathering
                async with p.relay.open("n1", "r2", infer_head(stream=True), request("hang")):
                    await wait_until(lambda: p.node.statistics().inflight == 2)
                    assert not p.node.gathering  # r2's runtime has sent nothing yet
                await wait_until(lambda: p.node.statistics().inflight == 1)
                assert p.node.gathering
            await wait_until(lambda: not p.node.gathering)  # cancelled when the client went away
            assert p.node.statistics().inflight == 0


# --- where the relay finds a runtime ------------------------------------------------------------


async def test_the_supervisor_gives_a_runtime_port_only_while_it_is_ready(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery
) -> None:
    podman, artifacts = supervised.FakePodman(registry={supervised.IMAGE}), supervised.FakeArtifacts()
    podman.healthy = False
    sup = await supervised.start(nursery, podman, artifacts, supervised.assignment())
    await supervised.wait_for(sup, wire.RuntimeState.STARTING)
    assert sup.endpoint("a1") is None  # running, not yet healthy
    podman.healthy = True
    await supervised.wait_for(sup, wire.RuntimeState.READY)
    assert sup.endpoint("a1") == supervised.runtime().port
    assert sup.endpoint("a2") is None  # not an assignment of this node
    sup.update(2, [])
    assert sup.endpoint("a1") is None  # removed: stopping now


# --- a media runtime: stable-diffusion.cpp's sd-server ------------------------------------------


async def test_an_image_request_reaches_sd_server_as_json_and_its_answer_and_errors_come_back() -> None:
    """The node relays the gateway's image body to `/v1/images/generations` as JSON and passes sd-server's
    answer on whole (tests/support/relay.py answers as its routes_openai.cpp does); its 400, whose `error`
    is a plain string there, becomes runtime_rejected with that string as the message."""
    head = infer_head(path=Capability.IMAGE.path)
    asked = json.dumps({"model": "sd", "prompt": "a red square", "n": 2, "size": "64x64"}).encode()
    with trio.fail_after(TIMEOUT_S):
        async with data_path() as p:
            async with p.relay.open("n1", "r1", head, asked) as s:
                body, end = await drain(s)
            async with p.relay.open("n1", "r2", head, json.dumps({"model": "sd", "n": 1}).encode()) as s:
                refused, failed = await drain(s)
    answer = json.loads(body)
    assert [d["b64_json"] for d in answer["data"]] == [SD_IMAGE_B64] * 2 and answer["output_format"] == "png"
    assert end.status is wire.EndStatus.OK and end.http_status == 200
    assert p.runtime.seen[0][0] == "/v1/images/generations" and p.runtime.seen[0][2] == asked
    assert p.runtime.seen[0][1]["content-type"] == "application/json"
    assert refused == b""
    assert (failed.status, failed.code, failed.http_status) == (wire.EndStatus.ERROR, "runtime_rejected", 400)
    assert failed.message == "prompt required"


async def test_a_body_less_get_delete_or_post_reaches_the_runtime_as_such_and_a_get_with_a_body_is_refused() -> None:
    """A stored response's own routes go to the runtime with their method and no body (nor a content
    type); a GET or DELETE head that comes with a body is refused before the runtime is asked."""
    with trio.fail_after(TIMEOUT_S):
        async with data_path() as p:
            answers = []
            for n, method in enumerate((wire.RuntimeMethod.GET, wire.RuntimeMethod.DELETE, wire.RuntimeMethod.POST)):
                head = infer_head(path="/v1/responses/resp_1/cancel", method=method)
                async with p.relay.open("n1", f"r{n}", head, b"") as s:
                    answers.append(await drain(s))
            head = infer_head(path="/v1/responses/resp_1", method=wire.RuntimeMethod.GET)
            async with p.relay.open("n1", "r9", head, request("unary")) as s:
                refused, end = await drain(s)
    assert [json.loads(body)["method"] for body, _ in answers] == ["GET", "DELETE", "POST"]
    assert all(end.status is wire.EndStatus.OK for _, end in answers)
    assert p.runtime.methods == ["GET", "DELETE", "POST"]  # the one with a body never reached it
    assert all(sent == b"" and "content-type" not in headers for _, headers, sent in p.runtime.seen)
    assert refused == b"" and (end.status, end.code) == (wire.EndStatus.ERROR, "invalid_request")
    assert "carries no body" in end.message
