"""`x-nexa-overhead-ms`: how it is computed (pure), what a node reports of its own part over the real
data path (node relay → Link/Uplink → controller relay, harness tests/support/relay.py), and a
node's bad figure being ignored and counted, never failing the request."""

from __future__ import annotations

import math

import pytest
import trio

from nexa.config import GatewayConfig
from nexa.contracts import codec, wire
from nexa.control.datapath import relay as control_relay
from nexa.control.datapath.calls import (
    MAX_NODE_OVERHEAD_MS,
    Progress,
    node_overhead_ms,
    overhead_ms,
    take_node_overhead,
)
from nexa.control.datapath.metering import REFUSED_TIMING, Meter
from nexa.errors import NotConnected
from nexa.node.relay import overhead_ms as node_side_overhead_ms
from nexa.telemetry import Metrics
from tests.support.relay import TIMEOUT_S, chat_work, data_path, drain, infer_head, request

# --- the computation ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "value",
    [-0.001, -1, math.nan, math.inf, -math.inf, 1e300, MAX_NODE_OVERHEAD_MS + 1, 10**30, True, "5", [1.0]],
    ids=["negative", "negative-int", "nan", "inf", "-inf", "huge", "above-max", "huge-int", "bool", "str", "list"],
)
def test_a_node_figure_that_is_not_a_finite_non_negative_bounded_number_is_ignored(value: object) -> None:
    assert node_overhead_ms(value) is None
    progress = Progress(work=chat_work(stream=False), started=0.0)
    assert progress.add_node_overhead(value) is False  # type: ignore[arg-type]
    assert progress.node_ms is None


@pytest.mark.parametrize("value", [0, 0.0, 0.01, 3, 250.5, MAX_NODE_OVERHEAD_MS])
def test_a_sane_node_figure_is_taken_as_it_is(value: float) -> None:
    assert node_overhead_ms(value) == value


def test_the_controller_part_is_the_time_to_the_response_head_less_the_waits_plus_the_nodes_part() -> None:
    assert overhead_ms(0.010, 0.004, None) == pytest.approx(6.0)
    assert overhead_ms(0.010, 0.004, 1.5) == pytest.approx(7.5)
    # Waits measured on another clock may add up to a little more than the total: never below 0.
    assert overhead_ms(0.010, 0.011, 0.25) == pytest.approx(0.25)
    progress = Progress(work=chat_work(stream=False), started=0.0, queue_ms=2.0, waited_s=0.003)
    assert progress.add_node_overhead(0.5) and progress.add_node_overhead(None) and progress.add_node_overhead(0.25)
    assert progress.node_ms == pytest.approx(0.75)  # summed over attempts
    # Arrived at t=100 s, head at t=100.010 s: 10 ms, less 2 ms queued and 3 ms waiting, plus 0.75 ms.
    assert progress.overhead_ms(100.0, 100.010) == pytest.approx(5.75)


def test_the_nodes_part_is_before_the_runtime_request_and_after_its_answer() -> None:
    # Arrived 1.000, request written 1.002, answered 1.500, frame at 1.503: 2 ms + 3 ms.
    assert node_side_overhead_ms(1.000, 1.002, 1.500, 1.503) == pytest.approx(5.0)
    # Never asked the runtime (or it never answered): all the node's time was its own.
    assert node_side_overhead_ms(1.000, None, None, 1.004) == pytest.approx(4.0)
    assert node_side_overhead_ms(1.000, 1.002, None, 1.004) == pytest.approx(4.0)


async def test_a_refused_node_figure_is_counted_and_the_call_keeps_its_own() -> None:
    metrics = Metrics()
    meter = Meter(GatewayConfig(), None, metrics)  # type: ignore[arg-type]  # no store: nothing flushed here
    progress = Progress(work=chat_work(stream=True), started=0.0)
    take_node_overhead(progress, meter, 1.25, "n1")
    take_node_overhead(progress, meter, -3.0, "n1")
    take_node_overhead(progress, meter, math.nan, "n1")
    assert progress.node_ms == pytest.approx(1.25)
    refused = metrics.registry.get_sample_value("nexa_usage_records_refused_total", {"reason": REFUSED_TIMING})
    assert refused == 2


# --- the controller relay takes a first chunk's head ----------------------------------------------


class _NoLink:
    async def send_data(self, node_id: str, kind: str, request_id: str, head: bytes, body: bytes) -> None:
        raise NotConnected(node_id=node_id)

    def send_data_nowait(self, node_id: str, kind: str, request_id: str, head: bytes, body: bytes) -> None:
        raise NotConnected(node_id=node_id)


def _open_stream(relay: control_relay.Relay) -> control_relay.RelayStream:
    stream = control_relay.RelayStream(relay, "n1", "r1", window=4, deadline=math.inf, max_bytes=1000)
    relay._streams["r1"] = stream
    relay._by_node["n1"].add("r1")
    return stream


def _chunk(head: bytes) -> wire.DataFrame:
    return wire.DataFrame(kind=wire.CHUNK, request_id="r1", head=head, body=b"data: {}\n\n")


@pytest.mark.parametrize(
    ("head", "expected"),
    [
        (b'{"overhead_ms":0.42}', 0.42),
        (b"", None),  # a node before the field: no figure
        (b'{"overhead_ms":"x"}', math.nan),  # unreadable: NaN, which the gateway refuses and counts
        (b'{"overhead_ms":1,"other":2}', math.nan),
        (b"{", math.nan),
    ],
    ids=["figure", "empty", "wrong-type", "unknown-key", "not-json"],
)
async def test_the_first_chunks_head_gives_the_nodes_figure_and_never_ends_the_stream(
    head: bytes, expected: float | None
) -> None:
    relay = control_relay.Relay(_NoLink(), window=4)
    stream = _open_stream(relay)
    assert relay.deliver("n1", _chunk(head)) is None
    assert relay.deliver("n1", _chunk(b'{"overhead_ms":99}')) is None  # only the first chunk's counts
    assert stream.buffered == 2 and not stream.ended
    if expected is None or not math.isnan(expected):
        assert stream.first_overhead_ms == expected
    else:
        assert stream.first_overhead_ms is not None and math.isnan(stream.first_overhead_ms)
    assert stream.waited_s(whole=False) >= 0.0
    assert stream.waited_s(whole=True) == 0.0  # no end yet


def test_an_end_with_a_bad_overhead_figure_is_still_a_good_end() -> None:
    relay = control_relay.Relay(_NoLink(), window=4)
    stream = _open_stream(relay)
    head = codec.dumps(codec.wire, wire.EndHead(status=wire.EndStatus.OK, overhead_ms=-5.0)).encode()
    assert relay.deliver("n1", wire.DataFrame(kind=wire.END, request_id="r1", head=head, body=b"")) is None
    assert stream._final is not None and stream._final.status is wire.EndStatus.OK
    assert stream._final.overhead_ms == -5.0  # passed on as sent; the gateway ignores it
    assert stream.waited_s(whole=True) >= 0.0


# --- what the node reports, over the real data path ---------------------------------------------


def _usable(value: float | None) -> float:
    assert value is not None and node_overhead_ms(value) is not None, value
    return value


async def test_the_node_reports_its_part_on_a_streams_first_chunk_and_on_every_end() -> None:
    with trio.fail_after(TIMEOUT_S):
        async with data_path() as p:
            async with p.relay.open("n1", "r1", infer_head(stream=True), request("stream", events=6)) as s:
                body, end = await drain(s)
            assert body.endswith(b"data: [DONE]\n\n")
            _usable(s.first_overhead_ms)
            _usable(end.overhead_ms)
            assert s.waited_s(whole=False) <= s.waited_s(whole=True)

            async with p.relay.open("n1", "r2", infer_head(), request("unary", pad=10)) as s:
                body, end = await drain(s)
            assert end.status is wire.EndStatus.OK and body
            assert s.first_overhead_ms is None  # a unary answer's figure comes with its end
            _usable(end.overhead_ms)

            # An error answer from the runtime carries the figure too.
            async with p.relay.open("n1", "r3", infer_head(), request("status", status=400)) as s:
                body, end = await drain(s)
            assert (body, end.code) == (b"", "runtime_rejected")
            _usable(end.overhead_ms)
