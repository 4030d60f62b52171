"""llama.cpp's context as its memory bound: the KV cache a token holds, the largest context a
reservation leaves room for, and the limit placement works out per unified node (pure)."""

from __future__ import annotations

import json

import attrs
import pytest

from nexa.contracts import codec
from nexa.contracts.kvcache import (
    CONTEXT_STEP,
    KV_TYPE_BYTES_PER_32,
    kv_cache_bytes,
    largest_context,
)
from nexa.contracts.models import Verification
from nexa.contracts.placement import MemoryLimit, MemoryShare
from nexa.errors import ContractError
from tests.support.models import LLAMA_8B

GIB = 2**30
MIB = 2**20
POOL = 119 * GIB


def test_the_kv_cache_of_a_token_for_each_cache_type() -> None:
    # 2 (K and V) x 32 layers x 8 KV heads x 128 x 2 bytes = 128 KiB a token with f16.
    assert LLAMA_8B.kv_bytes_per_token() == 131072
    # ggml's block sizes: q8_0 34 bytes per 32 elements (1.0625 a element), q4_0 18 (0.5625).
    assert LLAMA_8B.kv_bytes_per_token("q8_0", "q8_0") == 32 * 8 * 128 * 2 * 1.0625
    assert LLAMA_8B.kv_bytes_per_token("q4_0", "q4_0") == 32 * 8 * 128 * 2 * 0.5625
    assert LLAMA_8B.kv_bytes_per_token("f32", "q4_0") == 32 * 8 * 128 * (4 + 0.5625)
    assert set(KV_TYPE_BYTES_PER_32) == {"f32", "f16", "bf16", "q8_0", "q4_0", "q4_1", "iq4_nl", "q5_0", "q5_1"}
    # The full 128k context takes 16 GiB of f16 cache.
    assert kv_cache_bytes(131072, LLAMA_8B.kv_bytes_per_token()) == 16 * GIB
    assert kv_cache_bytes(3, 0.5625) == 2  # rounded up


def test_the_largest_context_is_the_trained_one_or_a_multiple_of_256_that_fits() -> None:
    per_token = 131072.0
    assert largest_context(16 * GIB, per_token, 131072) == 131072
    assert largest_context(64 * GIB, per_token, 131072) == 131072  # capped at the trained context
    # 2.5 GiB of room: 20480 tokens exactly.
    assert largest_context(5 * GIB // 2, per_token, 131072) == 20480
    # One byte short of 20480 tokens: rounded down to the step below.
    assert largest_context(5 * GIB // 2 - 1, per_token, 131072) == 20480 - CONTEXT_STEP
    assert largest_context(CONTEXT_STEP * 131072 - 1, per_token, 131072) is None
    assert largest_context(0, per_token, 131072) is None and largest_context(-GIB, per_token, 131072) is None
    # A model trained on fewer tokens than a step gets its whole context where it fits.
    assert largest_context(512 * 100, 512.0, 100) == 100
    for room in (GIB, 3 * GIB + 12345, 7 * GIB - 1):
        for per_token_ in (57344.0, 131072 * 1.0625 / 2, 208.0):
            got = largest_context(room, per_token_, 1 << 26)
            assert got is not None and got % CONTEXT_STEP == 0
            assert kv_cache_bytes(got, per_token_) <= room < kv_cache_bytes(got + CONTEXT_STEP, per_token_)
    with pytest.raises(ValueError, match="positive"):
        largest_context(GIB, 0.0, 4096)


def _limit(**over: object) -> MemoryLimit:
    base = MemoryLimit(
        setting="ctx_size",
        flag="--ctx-size",
        share_of=MemoryShare.CONTEXT,
        weights_bytes=5 * GIB,
        kv_bytes_per_token=LLAMA_8B.kv_bytes_per_token(),
        context_max=131072,
        overhead_bytes=GIB,
        batch_setting="batch_size",
        batch_flag="--batch-size",
        batch_max=2048,
    )
    return attrs.evolve(base, **over)


def test_a_derived_context_fits_what_the_reservation_leaves_beside_weights_and_overhead() -> None:
    # 8 GiB declared (+1 GiB overhead reserved): 8 - 5 GiB of weights = 3 GiB of KV cache = 24576 tokens.
    on = _limit().on(8 * GIB, POOL)
    assert (on.value, on.batch, on.batch_flag, on.derived, on.share_of) == (
        24576,
        2048,
        "--batch-size",
        True,
        "context",
    )
    assert on.reserved_bytes == 9 * GIB and on.kv_cache_bytes == 3 * GIB
    assert on.claim_bytes == 9 * GIB and on.fits
    # A context smaller than the batch takes the batch down with it.
    small = _limit().on(5 * GIB + 512 * 131072, POOL)
    assert (small.value, small.batch) == (512, 512)
    # The trained context where the room holds it all.
    assert _limit().on(40 * GIB, POOL).value == 131072
    # The weights fill the share: no context, and the node fails.
    none = _limit().on(5 * GIB, POOL)
    assert (none.value, none.claim_bytes, none.batch, none.fits) == (None, None, None, False)


def test_an_operators_context_is_checked_not_changed() -> None:
    over = _limit(operator_value=131072.0).on(8 * GIB, POOL)
    assert (over.value, over.derived, over.batch, over.fits) == (131072, False, None, False)
    assert over.kv_cache_bytes == 16 * GIB and over.claim_bytes == 22 * GIB
    fits = _limit(operator_value=16384.0).on(8 * GIB, POOL)
    assert fits.fits and fits.claim_bytes == 6 * GIB + 2 * GIB
    # 0 is the model's own (trained) context.
    assert _limit(operator_value=0.0).on(8 * GIB, POOL).value == 131072


def test_without_the_models_figures_nothing_is_bounded_and_the_node_is_not_failed() -> None:
    why = "llama.cpp's context is not bounded by the reservation: the model is safetensors, not a GGUF"
    on = _limit(kv_bytes_per_token=0.0, context_max=0, unbounded=why).on(8 * GIB, POOL)
    assert (on.value, on.claim_bytes, on.batch, on.unbounded) == (None, None, None, why)
    assert on.fits


def test_figures_are_kept_with_the_verification_and_older_records_load_without() -> None:
    check = Verification(
        verified_at=1.0, verified_by=None, sha256="a" * 64, size_bytes=1, signature_key=None, seconds=0.1, gguf=LLAMA_8B
    )
    body = codec.dumps(codec.store, check)
    assert codec.loads(codec.store, body, Verification) == check
    # A verification stored before nexa read GGUF headers: no figures, no problem recorded.
    old = {k: v for k, v in json.loads(body).items() if k not in {"gguf", "gguf_problem"}}
    loaded = codec.loads(codec.store, json.dumps(old), Verification)
    assert (loaded.gguf, loaded.gguf_problem) == (None, "")
    # Figures out of bounds are refused as any invalid body is.
    with pytest.raises(ContractError, match="block_count must be an integer from 1 to 65536"):
        codec.loads(codec.store, body.replace('"block_count":32', '"block_count":0'), Verification)
