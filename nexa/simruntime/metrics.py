"""The sim runtime's `/metrics`: Prometheus text in vLLM's names, from what it really answered.

Running requests are its real in-flight count; waiting requests and KV-cache use are what the
faults say (`queue_depth`, `kv_cache_usage`); the prefix cache counts prompt tokens looked up
and those of prompts seen before (by a hash, at most `_SEEN_MAX` kept); time to first token and
time per output token are histograms of the answers given, in vLLM's buckets.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Final

#: vLLM's buckets (seconds) for `vllm:time_to_first_token_seconds`.
TTFT_BUCKETS: Final = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
#: vLLM's buckets (seconds) for `vllm:time_per_output_token_seconds`.
TPOT_BUCKETS: Final = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5)
#: Prompt hashes remembered for the prefix cache (then it starts over, as an evicting cache would).
_SEEN_MAX: Final = 4096


class _Histogram:
    def __init__(self, name: str, help_text: str, bounds: Sequence[float]) -> None:
        self.name, self.help_text, self.bounds = name, help_text, tuple(bounds)
        self.counts = [0] * len(self.bounds)
        self.count = 0
        self.sum = 0.0

    def observe(self, value: float) -> None:
        value = max(0.0, value)
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
        self.count += 1
        self.sum += value

    def lines(self, label: str) -> list[str]:
        sep = "," if label else ""
        out = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} histogram"]
        out += [
            f'{self.name}_bucket{{le="{b}"{sep}{label}}} {c}' for b, c in zip(self.bounds, self.counts, strict=True)
        ]
        out += [
            f'{self.name}_bucket{{le="+Inf"{sep}{label}}} {self.count}',
            f"{self.name}_count{{{label}}} {self.count}",
            f"{self.name}_sum{{{label}}} {self.sum!r}",
        ]
        return out


class SimMetrics:
    """Counters of one sim runtime; `render` writes the exposition."""

    def __init__(self, model_label: str) -> None:
        self._label = model_label
        self.running = 0
        self.total = 0
        self._prefix_queries = self._prefix_hits = 0
        self._seen: set[bytes] = set()
        self._ttft = _Histogram(
            "vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self._tpot = _Histogram(
            "vllm:time_per_output_token_seconds", "Histogram of time per output token in seconds.", TPOT_BUCKETS
        )

    def prompt(self, texts: Sequence[str], prompt_tokens: int) -> None:
        """A request's prompt arrived: a lookup of its tokens, a hit when the same prompt came before."""
        key = hashlib.blake2b("\x00".join(texts).encode(), digest_size=16).digest()
        self._prefix_queries += prompt_tokens
        if key in self._seen:
            self._prefix_hits += prompt_tokens
        else:
            if len(self._seen) >= _SEEN_MAX:
                self._seen.clear()
            self._seen.add(key)

    def answered(self, ttft_s: float, tokens: int, decode_s: float) -> None:
        """An answer's first token came `ttft_s` after the request, its other `tokens - 1` in `decode_s`."""
        self._ttft.observe(ttft_s)
        if tokens > 1:
            self._tpot.observe(decode_s / (tokens - 1))

    def render(self, *, waiting: int, kv_cache_usage: float) -> bytes:
        label = self._label
        lines = [
            "# HELP vllm:num_requests_running Requests being answered now.",
            "# TYPE vllm:num_requests_running gauge",
            f"vllm:num_requests_running{{{label}}} {self.running}",
            "# HELP vllm:num_requests_waiting Requests waiting to be scheduled (the faults file's queue_depth).",
            "# TYPE vllm:num_requests_waiting gauge",
            f"vllm:num_requests_waiting{{{label}}} {waiting}",
            "# HELP vllm:kv_cache_usage_perc KV-cache usage, 1 is full (the faults file's kv_cache_usage).",
            "# TYPE vllm:kv_cache_usage_perc gauge",
            f"vllm:kv_cache_usage_perc{{{label}}} {kv_cache_usage!r}",
            "# HELP vllm:prefix_cache_queries_total Prompt tokens looked up in the prefix cache.",
            "# TYPE vllm:prefix_cache_queries_total counter",
            f"vllm:prefix_cache_queries_total{{{label}}} {self._prefix_queries}",
            "# HELP vllm:prefix_cache_hits_total Prompt tokens found in the prefix cache.",
            "# TYPE vllm:prefix_cache_hits_total counter",
            f"vllm:prefix_cache_hits_total{{{label}}} {self._prefix_hits}",
            *self._ttft.lines(label),
            *self._tpot.lines(label),
            "# HELP nexa_sim_requests_total Inference requests received.",
            "# TYPE nexa_sim_requests_total counter",
            f"nexa_sim_requests_total{{{label}}} {self.total}",
        ]
        return ("\n".join(lines) + "\n").encode()
