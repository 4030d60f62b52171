"""`nexa sim-runtime`: a simulated OpenAI-compatible runtime for tests, demos and gateway benchmarks.

A raw ASGI app on hypercorn and trio (no framework: it is the upstream of gateway benchmarks, so a
request costs little more than parsing its JSON). Every answer is a deterministic function of the
request; time to first token, token rate, failures and hangs come from flags or from a faults file
re-read when it changes. The journal records request metadata and outcomes, never prompt or output
text, and nothing is logged per request. Refuses to start unless NEXA_SIMULATION_ONLY=1, and binds
loopback only.

The package: `config` (the flags and their check), `faults` (injected faults and the faults
file), `tokens` (deterministic words and vectors), `asgi` (the ASGI edge), `parse` (a request
into `Work`), `answers` (the OpenAI-shaped bodies and streams), `app` (the ASGI app and its
journal) and `serve` (hypercorn). Started as `nexa sim-runtime` (`nexa.cli`).
"""

from __future__ import annotations

from nexa.simruntime.config import MAX_EMBEDDING_DIM, SimConfig, SimStarted, check_config
from nexa.simruntime.faults import GARBLED_USAGE, Faults, Garble, Phase
from nexa.simruntime.serve import GRACEFUL_TIMEOUT_S, serve_sim
from nexa.simruntime.tokens import WORDS, count_words, embedding, output_words

__all__ = [
    "GARBLED_USAGE",
    "GRACEFUL_TIMEOUT_S",
    "MAX_EMBEDDING_DIM",
    "WORDS",
    "Faults",
    "Garble",
    "Phase",
    "SimConfig",
    "SimStarted",
    "check_config",
    "count_words",
    "embedding",
    "output_words",
    "serve_sim",
]
