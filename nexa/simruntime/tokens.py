"""Deterministic output: the same prompt, the same words; the same text, the same embedding."""

from __future__ import annotations

import hashlib
import math
import struct
from typing import Final

#: Words the simulated output is made of; one word is one token.
# fmt: off
WORDS: Final = (
    "alpha", "amber", "anchor", "apple", "arrow", "aspen", "atlas", "autumn",
    "badge", "basil", "beacon", "birch", "blossom", "border", "breeze", "bridge",
    "cabin", "candle", "canyon", "cedar", "cherry", "cinder", "cloud", "comet",
    "copper", "coral", "crystal", "dawn", "delta", "dune", "ember", "falcon",
    "fern", "field", "flint", "forest", "garnet", "glacier", "harbor", "hazel",
    "horizon", "island", "ivory", "jasper", "juniper", "lagoon", "lantern", "maple",
    "meadow", "mesa", "meteor", "harvest", "nectar", "oasis", "orbit", "pebble",
    "prairie", "quartz", "raven", "river", "saffron", "summit", "thistle", "willow",
)
# fmt: on


def output_words(prompt: str, count: int) -> list[str]:
    """The `count` words the simulator answers `prompt` with: the same prompt, the same words."""
    if count <= 0:
        return []
    stream = hashlib.shake_256(prompt.encode()).digest(count)
    return [WORDS[b % len(WORDS)] for b in stream]


def embedding(text: str, dim: int) -> list[float]:
    """A unit-norm vector seeded by the sha256 of `text`: the same text, the same vector."""
    raw = hashlib.shake_256(hashlib.sha256(text.encode()).digest()).digest(2 * dim)
    values = [v - 32767.5 for v in struct.unpack(f"<{dim}H", raw)]
    norm = math.sqrt(math.fsum(v * v for v in values))
    return [v / norm for v in values]


def count_words(text: str) -> int:
    return len(text.split())
