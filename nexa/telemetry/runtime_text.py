"""A runtime's metrics endpoint, read: its exposition turned into one `RuntimeLoad`. Pure: no I/O.

The adapter (`nexa.adapters.base.Metrics`) names the series; only those are kept, everything else in
the text is skipped unread. Prometheus text goes through `prometheus_client`'s own parser; the
JSON form is TensorRT-LLM's list of per-iteration statistics (the last one counts).

Several label sets of one series (one per `model_name`, per rank, ...) are combined: counts and
histograms are summed, ratios give the largest (the most pressed cache). The text is untrusted:
a figure whose samples would not pass `RuntimeLoad`'s validators (negative, NaN or infinite,
a ratio above 1, buckets that do not grow, histograms with other bounds) or that appears twice
with the same labels is dropped (None), never clamped; text that is not the format at all (too
big, not UTF-8, not parsable) raises `MetricsUnreadable`, and nothing else is raised.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from typing import Final

import attrs
from prometheus_client.parser import text_string_to_metric_families

from nexa.adapters.base import Metrics
from nexa.contracts.wire import LatencyHistogram, RuntimeLoad
from nexa.errors import MetricsUnreadable

#: The largest exposition read (vLLM's is about 100 KiB with every histogram).
MAX_METRICS_BYTES: Final = 4 * 2**20
_Labels = frozenset[tuple[str, str]]
#: Sample name -> label set -> value; a name seen twice with one label set maps to None (dropped).
_Samples = dict[str, dict[_Labels, float] | None]


def parse_runtime_metrics(text: bytes, spec: Metrics) -> RuntimeLoad:
    """The figures `spec` names, read from `text` (`ok` True, `age_s` 0: the caller ages them).

    Raises MetricsUnreadable when `text` is over MAX_METRICS_BYTES, not UTF-8 or not `spec.format`."""
    if len(text) > MAX_METRICS_BYTES:
        raise MetricsUnreadable(f"the metrics answer is over {MAX_METRICS_BYTES} bytes")
    try:
        decoded = text.decode("utf-8")
    except UnicodeDecodeError:
        raise MetricsUnreadable("the metrics answer is not UTF-8 text") from None
    if spec.format == "json":
        return _from_json(decoded, spec)
    samples = _samples(decoded, _wanted(spec))
    return _load(
        queue_depth=_gauge(samples, (spec.waiting,) if spec.waiting else ()),
        running=_gauge(samples, (spec.running,) if spec.running else ()),
        kv_cache_ratio=_gauge(samples, spec.kv_cache, largest=True),
        prefix_cache_hit_ratio=_prefix_ratio(samples, spec),
        ttft=_histogram(samples, spec.ttft),
        tpot=_histogram(samples, spec.tpot),
    )


def _wanted(spec: Metrics) -> frozenset[str]:
    names = {n for n in (spec.waiting, spec.running) if n}
    names.update(spec.kv_cache, spec.prefix_cache_ratio)
    names.update(n for pair in spec.prefix_cache_counters for n in pair)
    names.update(f"{base}{suffix}" for base in (*spec.ttft, *spec.tpot) for suffix in ("_bucket", "_count", "_sum"))
    return frozenset(names)


def _samples(text: str, wanted: frozenset[str]) -> _Samples:
    out: _Samples = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name not in wanted:
                    continue
                by_labels = out.setdefault(sample.name, {})
                if by_labels is None:
                    continue
                labels: _Labels = frozenset(sample.labels.items())
                if labels in by_labels:
                    out[sample.name] = None  # the same series twice: which one is meant is unknown
                else:
                    by_labels[labels] = float(sample.value)
    except Exception as exc:
        # A third-party parser on hostile input: whatever it raises means "not the text format".
        raise MetricsUnreadable(f"the metrics answer is not Prometheus text: {type(exc).__name__}") from None
    return out


def _gauge(samples: _Samples, names: Iterable[str], *, largest: bool = False) -> float | None:
    """The first of `names` present, its label sets summed (`largest`: the largest of them); None
    when absent or any value is bad."""
    for name in names:
        if name not in samples:
            continue
        values = _good(samples[name])
        if not values:
            return None
        return max(values) if largest else float(sum(values))
    return None


def _good(by_labels: Mapping[_Labels, float] | None) -> list[float] | None:
    """The values, or None when there are none or one is negative or not finite."""
    if not by_labels:
        return None
    values = list(by_labels.values())
    if not all(math.isfinite(v) and v >= 0 for v in values):
        return None
    return values


def _prefix_ratio(samples: _Samples, spec: Metrics) -> float | None:
    for hits_name, queries_name in spec.prefix_cache_counters:
        if hits_name not in samples and queries_name not in samples:
            continue
        hits, queries = _good(samples.get(hits_name)), _good(samples.get(queries_name))
        if hits is None or queries is None or sum(queries) <= 0:
            return None  # broken, or nothing looked up yet
        return sum(hits) / sum(queries)
    return _gauge(samples, spec.prefix_cache_ratio, largest=True)


def _histogram(samples: _Samples, bases: Iterable[str]) -> LatencyHistogram | None:
    """The first of `bases` present, its label sets summed (they must share their bounds)."""
    for base in bases:
        if f"{base}_bucket" not in samples:
            continue
        buckets = samples[f"{base}_bucket"]
        count_values, sum_values = _good(samples.get(f"{base}_count")), _good(samples.get(f"{base}_sum"))
        if not buckets or count_values is None or sum_values is None:
            return None
        return _summed_buckets(buckets, sum(count_values), sum(sum_values))
    return None


def _summed_buckets(buckets: Mapping[_Labels, float], count: float, total: float) -> LatencyHistogram | None:
    by_series: dict[_Labels, dict[float, float]] = {}
    for labels, value in buckets.items():
        le = dict(labels).get("le")
        try:
            bound = float(le) if le is not None else math.nan
        except ValueError:
            return None
        if math.isnan(bound) or not math.isfinite(value) or value < 0:
            return None
        series = by_series.setdefault(frozenset(kv for kv in labels if kv[0] != "le"), {})
        series[bound] = value
    bound_sets = {tuple(sorted(series)) for series in by_series.values()}
    if len(bound_sets) != 1:
        return None  # label sets with other bounds cannot be added up
    bounds = [b for b in next(iter(bound_sets)) if math.isfinite(b)]
    counts = [sum(series[b] for series in by_series.values()) for b in bounds]
    try:
        return LatencyHistogram(bounds=tuple(bounds), counts=tuple(counts), count=count, sum=total)
    except (ValueError, TypeError):
        return None


def _load(
    *,
    queue_depth: float | None,
    running: float | None,
    kv_cache_ratio: float | None,
    prefix_cache_hit_ratio: float | None = None,
    ttft: LatencyHistogram | None = None,
    tpot: LatencyHistogram | None = None,
) -> RuntimeLoad:
    """A RuntimeLoad of the figures that pass its validators, each checked on its own (the
    histograms were checked when they were made)."""
    return RuntimeLoad(
        ok=True,
        age_s=0.0,
        queue_depth=_accepted("queue_depth", queue_depth),
        running=_accepted("running", running),
        kv_cache_ratio=_accepted("kv_cache_ratio", kv_cache_ratio),
        prefix_cache_hit_ratio=_accepted("prefix_cache_hit_ratio", prefix_cache_hit_ratio),
        ttft=ttft,
        tpot=tpot,
    )


def _accepted(field: str, value: float | None) -> float | None:
    """`value` if RuntimeLoad's validator of `field` accepts it, else None."""
    attribute = attrs.fields_dict(RuntimeLoad)[field]
    if value is None or attribute.validator is None:
        return value
    try:
        attribute.validator(None, attribute, value)
    except (ValueError, TypeError):
        return None
    return value


# --- TensorRT-LLM's JSON ------------------------------------------------------------------------


def _from_json(text: str, spec: Metrics) -> RuntimeLoad:
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        raise MetricsUnreadable("the metrics answer is not JSON") from None
    if isinstance(data, list):
        # One object per engine iteration since the last read; none while idle.
        data = data[-1] if data else {}
    if not isinstance(data, dict):
        raise MetricsUnreadable("the metrics answer is not a JSON object or a list of them")
    return _load(
        queue_depth=_json_number(data, spec.waiting),
        running=_json_number(data, spec.running),
        kv_cache_ratio=next((r for r in (_json_ratio(data, p) for p in spec.kv_cache) if r is not None), None),
    )


def _json_number(data: Mapping[str, object], path: str | None) -> float | None:
    """The number at a dotted `path`; None when absent, not a number, negative or not finite."""
    if not path:
        return None
    value: object = data
    for part in path.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) and number >= 0 else None


def _json_ratio(data: Mapping[str, object], path: str) -> float | None:
    """`a.used/total`: a.used over a.total (a bare denominator is the numerator's sibling)."""
    numerator, _, denominator = path.partition("/")
    if "." not in denominator and "." in numerator:
        denominator = f"{numerator.rpartition('.')[0]}.{denominator}"
    top, bottom = _json_number(data, numerator), _json_number(data, denominator)
    if top is None or bottom is None or bottom <= 0:
        return None
    return top / bottom
