"""`nexa.telemetry.runtime_text`: recorded expositions of each runtime, and hostile ones."""

from __future__ import annotations

from pathlib import Path

import pytest

from nexa import adapters
from nexa.adapters.base import Metrics
from nexa.adapters.llamacpp import LLAMA_SERVER_ADAPTER
from nexa.adapters.sglang import SGLANG
from nexa.adapters.trtllm import TRTLLM
from nexa.adapters.vllm import VLLM
from nexa.contracts.node import RuntimeKind
from nexa.errors import ContractError, MetricsUnreadable
from nexa.telemetry.runtime_text import MAX_METRICS_BYTES, parse_runtime_metrics

FIXTURES = Path(__file__).parent / "fixtures" / "runtime-metrics"


def _read(name: str) -> bytes:
    return (FIXTURES / name).read_bytes()


def test_vllm_exposition_gives_every_figure() -> None:
    load = parse_runtime_metrics(_read("vllm.prom"), VLLM.metrics)
    assert load.ok
    assert (load.queue_depth, load.running, load.kv_cache_ratio) == (7.0, 3.0, 0.42)
    assert load.prefix_cache_hit_ratio == 0.25  # 500 hit tokens of 2000 looked up
    assert load.ttft is not None
    assert len(load.ttft.bounds) == 22
    assert (load.ttft.count, load.ttft.sum) == (50, 4.25)
    assert load.ttft.counts[load.ttft.bounds.index(0.1)] == 38
    # The newer name (inter-token latency) is found when the older one is absent.
    assert load.tpot is not None
    assert (load.tpot.count, load.tpot.sum) == (2000, 61.5)


def test_sglang_exposition() -> None:
    load = parse_runtime_metrics(_read("sglang.prom"), SGLANG.metrics)
    assert (load.queue_depth, load.running, load.kv_cache_ratio) == (2826.0, 162.0, 0.28)
    assert load.prefix_cache_hit_ratio == pytest.approx(0.0075075526)
    assert load.ttft is not None
    assert load.ttft.count == 22896
    assert load.tpot is not None
    assert load.tpot.counts[-1] == 31825


def test_llamacpp_has_no_histograms_or_cache_figures() -> None:
    load = parse_runtime_metrics(_read("llamacpp.prom"), LLAMA_SERVER_ADAPTER.metrics)
    assert (load.queue_depth, load.running) == (2.0, 1.0)
    assert load.kv_cache_ratio is None
    assert load.prefix_cache_hit_ratio is None
    assert load.ttft is None
    assert load.tpot is None


def test_trtllm_json_takes_the_last_iteration() -> None:
    """`numQueuedRequests` sits at the top of an iteration's statistics (not under
    `inflightBatchingStats`, which has no such field), as trtllm-serve's serializer writes it."""
    load = parse_runtime_metrics(_read("trtllm.json"), TRTLLM.metrics)
    assert (load.queue_depth, load.running, load.kv_cache_ratio) == (3.0, 5.0, 0.4)
    idle = parse_runtime_metrics(b"[]", TRTLLM.metrics)  # no iteration since the last read
    assert (idle.ok, idle.queue_depth, idle.running, idle.kv_cache_ratio) == (True, None, None, None)


@pytest.mark.parametrize("body", [b"{", b'"just a string"', b"[" * 100_000, b'{"numActiveRequests": true}'])
def test_trtllm_hostile_json(body: bytes) -> None:
    try:
        load = parse_runtime_metrics(body, TRTLLM.metrics)
    except MetricsUnreadable:
        return
    assert load.running is None


def test_only_the_adapters_series_are_kept() -> None:
    """A runtime's other series (vLLM's e2e latency, cache config info) never reach the load."""
    spec = Metrics(path="/metrics", waiting="vllm:num_preemptions_total")
    load = parse_runtime_metrics(_read("vllm.prom"), spec)
    assert load.queue_depth == 0.0
    assert (load.running, load.kv_cache_ratio, load.ttft, load.tpot) == (None, None, None, None)


def test_bad_values_drop_their_figure_only() -> None:
    """NaN, negative, a ratio over 1, buckets that shrink, +Inf counts: each such figure is None;
    nothing is clamped and the parse itself succeeds."""
    load = parse_runtime_metrics(_read("hostile-values.prom"), VLLM.metrics)
    assert load.ok
    assert load.queue_depth is None  # NaN
    assert load.running is None  # negative
    assert load.kv_cache_ratio is None  # 1.5
    assert load.prefix_cache_hit_ratio is None  # 900 hits of 100 queries
    assert load.ttft is None  # buckets 5, 3
    assert load.tpot is None  # +Inf


def test_label_sets_are_combined_and_duplicates_dropped() -> None:
    load = parse_runtime_metrics(_read("hostile-duplicates.prom"), VLLM.metrics)
    assert load.queue_depth is None  # the same series twice with other values: which is meant is unknown
    assert load.running == 3.0  # one per model name: summed
    assert load.kv_cache_ratio == 0.75  # ratios: the most pressed
    assert load.ttft is None  # label sets with other bounds cannot be summed


def test_histograms_of_several_label_sets_are_summed() -> None:
    text = b"".join(
        f'h_bucket{{le="0.1",m="{m}"}} {n}\nh_bucket{{le="+Inf",m="{m}"}} {n + 1}\n'
        f'h_count{{m="{m}"}} {n + 1}\nh_sum{{m="{m}"}} 0.5\n'.encode()
        for m, n in (("a", 1), ("b", 2))
    )
    load = parse_runtime_metrics(text, Metrics(path="/metrics", ttft=("h",)))
    assert load.ttft is not None
    assert (load.ttft.bounds, load.ttft.counts, load.ttft.count, load.ttft.sum) == ((0.1,), (3.0,), 5.0, 1.0)


def test_too_many_buckets_drop_the_histogram() -> None:
    lines = [f'h_bucket{{le="{i / 10}"}} {i}' for i in range(1, 100)]
    text = "\n".join([*lines, 'h_bucket{le="+Inf"} 99', "h_count 99", "h_sum 3"]).encode()
    assert parse_runtime_metrics(text, Metrics(path="/m", ttft=("h",))).ttft is None


@pytest.mark.parametrize(
    "body",
    [
        _read("garbage.prom"),
        b"\xff\xfe not utf-8",
        b'vllm:num_requests_waiting{model_name="a} 1\n',
        b"x" * (MAX_METRICS_BYTES + 1),
    ],
    ids=["html", "binary", "broken-label", "huge"],
)
def test_text_that_is_not_the_format_raises_a_typed_error(body: bytes) -> None:
    with pytest.raises(MetricsUnreadable) as caught:
        parse_runtime_metrics(body, VLLM.metrics)
    assert isinstance(caught.value, ContractError)
    assert caught.value.code == "metrics_unreadable"


def test_an_empty_exposition_has_no_figures() -> None:
    load = parse_runtime_metrics(b"", VLLM.metrics)
    assert load.ok
    assert (load.queue_depth, load.running, load.ttft) == (None, None, None)


def test_metrics_for_picks_the_variant_and_the_sim() -> None:
    assert adapters.metrics_for(RuntimeKind.SIM, ["nexa", "sim-runtime"]) is VLLM.metrics
    assert adapters.metrics_for(RuntimeKind.LLAMACPP, ["python3", "-m", "llama_cpp.server"]).path is None
    assert adapters.metrics_for(RuntimeKind.LLAMACPP, ["llama-server", "--model", "m"]).path == "/metrics"
    assert adapters.metrics_for(RuntimeKind.SGLANG, []).waiting == "sglang:num_queue_reqs"
