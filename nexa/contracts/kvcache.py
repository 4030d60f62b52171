"""llama.cpp's KV cache: a GGUF model's attention figures, what one token of context holds, and
the largest context a reservation leaves room for. Pure arithmetic, no I/O.

llama.cpp keeps, for each token of its context, a key and a value row in every layer: per token
`block_count * head_count_kv * key_length` key elements and as many with `value_length` value
elements, each stored in the cache's type (`--cache-type-k`, `--cache-type-v`; f16 by default).
With f16 that is 2 (K and V) x block_count x head_count_kv x head_dim x 2 bytes. A model with
another attention layout (sliding windows, latent attention) holds less: the figure here is an
upper bound, so a context derived from it never takes more than it says.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from fractions import Fraction
from typing import Final

import attrs

#: Bytes per 32 elements of each KV-cache type llama.cpp takes (common/arg.cpp `kv_cache_types`),
#: from ggml's type traits (`ggml/src/ggml.c` `type_traits`: block size and bytes per block):
#: f32 4 bytes an element, f16 and bf16 2; q8_0 a block of 32 in 34 bytes (1.0625 an element),
#: q4_0 and iq4_nl 18 (0.5625), q4_1 20, q5_0 22, q5_1 24.
KV_TYPE_BYTES_PER_32: Final[Mapping[str, int]] = {
    "f32": 128,
    "f16": 64,
    "bf16": 64,
    "q8_0": 34,
    "q4_0": 18,
    "q4_1": 20,
    "iq4_nl": 18,
    "q5_0": 22,
    "q5_1": 24,
}
#: llama.cpp's cache type when none is set.
DEFAULT_KV_TYPE: Final = "f16"
#: A derived context below the model's trained one is rounded down to a multiple of this (llama.cpp
#: pads its context to 256 cells), and a reservation with room for less gives no context at all.
CONTEXT_STEP: Final = 256
#: Bounds on what a header may claim (untrusted input): the largest trained context of any model
#: published (10M tokens) fits under the first with room to spare.
MAX_CONTEXT: Final = 1 << 26
MAX_BLOCKS: Final = 1 << 16
MAX_WIDTH: Final = 1 << 24
MAX_HEADS: Final = 1 << 16
ARCHITECTURE_RE: Final = re.compile(r"[a-z0-9][a-z0-9_.-]{0,63}")


def _positive(bound: int) -> Callable[[object, attrs.Attribute[int], int], None]:
    def check(_: object, attribute: attrs.Attribute[int], value: int) -> None:
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= bound:
            raise ValueError(f"{attribute.name} must be an integer from 1 to {bound}")

    return check


def _architecture(_: object, attribute: attrs.Attribute[str], value: str) -> None:
    if not ARCHITECTURE_RE.fullmatch(value):
        raise ValueError(f"{attribute.name} must be 1 to 64 lower-case letters, digits, '_', '.' or '-'")


@attrs.frozen(kw_only=True)
class GgufFigures:
    """What a GGUF model's header says about its attention (the controller reads it at verification).

    `head_count_kv` is per layer: where the header gives one figure per layer, the largest (an
    upper bound). `key_length` and `value_length` are the header's, else the embedding width over
    the head count, as llama.cpp takes them."""

    #: `general.architecture`: the prefix of the other keys (`llama`, `qwen2`, ...).
    architecture: str = attrs.field(validator=_architecture)
    #: The context the model was trained with (`<arch>.context_length`).
    context_length: int = attrs.field(validator=_positive(MAX_CONTEXT))
    block_count: int = attrs.field(validator=_positive(MAX_BLOCKS))
    embedding_length: int = attrs.field(validator=_positive(MAX_WIDTH))
    head_count: int = attrs.field(validator=_positive(MAX_HEADS))
    head_count_kv: int = attrs.field(validator=_positive(MAX_HEADS))
    key_length: int = attrs.field(validator=_positive(MAX_WIDTH))
    value_length: int = attrs.field(validator=_positive(MAX_WIDTH))

    def kv_bytes_per_token(self, type_k: str = DEFAULT_KV_TYPE, type_v: str = DEFAULT_KV_TYPE) -> float:
        """The KV cache one token of context holds with these cache types (KeyError for a type
        llama.cpp does not take). Exact: a multiple of 1/32 byte."""
        rows = self.block_count * self.head_count_kv
        per_32 = rows * (
            self.key_length * KV_TYPE_BYTES_PER_32[type_k] + self.value_length * KV_TYPE_BYTES_PER_32[type_v]
        )
        return per_32 / 32


def kv_cache_bytes(context: int, per_token: float) -> int:
    """The KV cache of `context` tokens at `per_token` bytes each, rounded up."""
    return math.ceil(context * Fraction(per_token))


def largest_context(room_bytes: int, per_token: float, trained: int) -> int | None:
    """The largest context whose KV cache fits in `room_bytes`, capped at the `trained` context:
    the trained context where it fits, else rounded down to a multiple of `CONTEXT_STEP`; None
    where not even that (or the trained context, if smaller) fits."""
    if per_token <= 0 or trained < 1:
        raise ValueError("per_token and trained must be positive")
    if room_bytes <= 0:
        return None
    fits = math.floor(room_bytes / Fraction(per_token))
    if fits >= trained:
        return trained
    return fits // CONTEXT_STEP * CONTEXT_STEP or None
