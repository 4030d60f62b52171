"""How a runtime is held to the memory placement reserved for it (`MemoryLimit`, and on one node
`RuntimeMemory`): the runtime adapters' part of placement. Its own module so that what needs only
these (the adapters, and so the node agent) does not load placement's records
(`contracts.placement`, which re-exports them). Pure data."""

from __future__ import annotations

import enum
import math
from fractions import Fraction
from typing import Final

import attrs

from nexa.contracts.kvcache import kv_cache_bytes, largest_context


def _non_negative(_: object, attribute: attrs.Attribute[int], value: int) -> None:
    if value < 0:
        raise ValueError(f"{attribute.name} must be 0 or more")


class MemoryShare(enum.StrEnum):
    """What a runtime's memory setting is a fraction of."""

    #: Of the device's whole memory (on a unified node, the pool): vLLM `--gpu-memory-utilization`
    #: (weights, activations and KV cache), SGLang `--mem-fraction-static` (weights and KV pool).
    POOL = "pool"
    #: Of the memory still free once the weights are loaded: TensorRT-LLM's
    #: `--kv_cache_free_gpu_memory_fraction` (the KV cache's share of it).
    FREE_AFTER_WEIGHTS = "free_after_weights"
    #: Not a fraction: llama.cpp's context (tokens), whose KV cache is what the reservation
    #: leaves once the weights and the engine's overhead are counted (`MemoryLimit.kv_bytes_per_token`).
    CONTEXT = "context"


#: Derived fractions have this many decimals, rounded down (so they never claim more than reserved).
FRACTION_DECIMALS: Final = 3
_FRACTION_STEPS: Final = 10**FRACTION_DECIMALS


@attrs.frozen(kw_only=True)
class MemoryLimit:
    """How a runtime on a unified-memory node is held to the memory placement reserved for it.

    On a node whose accelerator memory is the host's pool (a GB10), a model server left alone
    takes its default share of the whole pool (vLLM 90 %). So the reservation becomes the
    server's own limit: `setting` (a runtime setting, `flag` on its command line) is set to the
    largest fraction, to `FRACTION_DECIMALS` decimals rounded down, whose claim stays within
    what was reserved. An `operator_value` (the deployment set the setting itself) is kept as
    it is and checked instead: a claim above the reservation fails the node.

    llama.cpp has no such fraction: what it allocates follows from its context. With `context`
    the setting is the context (`--ctx-size`) and the reservation R is the runtime's share S
    plus the engine's overhead O: the derived context is the largest whose KV cache fits in
    R - W - O = S - W (`kvcache.largest_context`: capped at the model's trained context, else a
    multiple of 256 tokens), and `batch_setting` is set with it, to at most `batch_max` and never
    above the context. An operator's context claims W + O + its KV cache. Without the model's
    figures (`unbounded` says why) nothing is derived or checked, and the node is not failed.

    What a fraction claims, on a pool of P bytes with weights of W bytes (the model artifact's
    size, which approximates them):
    - `pool`: fraction * P;
    - `free_after_weights`: W + fraction * (P - W). The free memory after loading is at most
      P - W (less when other replicas run), so the derived (R - W) / (P - W) never lets the KV
      cache grow past R - W; a reservation R <= W holds no KV cache at all, and fails the node.
    """

    setting: str
    flag: str
    share_of: MemoryShare
    operator_value: float | None = None
    weights_bytes: int = attrs.field(default=0, validator=_non_negative)
    #: `context` only: the KV cache one token holds (for the cache types set), the model's
    #: trained context, the engine's overhead (reserved beside the share), the batch setting
    #: derived with the context and its largest value, and why nothing can be bounded ("" when
    #: the model's figures are known).
    kv_bytes_per_token: float = 0.0
    context_max: int = attrs.field(default=0, validator=_non_negative)
    overhead_bytes: int = attrs.field(default=0, validator=_non_negative)
    batch_setting: str = ""
    batch_flag: str = ""
    batch_max: int = attrs.field(default=0, validator=_non_negative)
    unbounded: str = ""

    def on(self, reserved_bytes: int, pool_bytes: int) -> RuntimeMemory:
        """The limit on one node: the operator's value or the derived one, and what it claims
        (`reserved_bytes`: the runtime's share; for `context` the overhead is added to it)."""
        if self.share_of is MemoryShare.CONTEXT:
            return self._context_on(reserved_bytes, pool_bytes)
        if self.operator_value is not None:
            value: float | None = self.operator_value
        else:
            value = self.derived(reserved_bytes, pool_bytes)
        claim = None if value is None else self.claim_bytes(value, pool_bytes)
        return RuntimeMemory(
            setting=self.setting,
            flag=self.flag,
            value=value,
            derived=self.operator_value is None,
            reserved_bytes=reserved_bytes,
            pool_bytes=pool_bytes,
            claim_bytes=claim,
            share_of=self.share_of,
        )

    def _context_on(self, share_bytes: int, pool_bytes: int) -> RuntimeMemory:
        batch: int | None = None
        kv: int | None = None
        if self.unbounded:
            context: int | None = None
        elif self.operator_value is not None:
            # 0 is the model's own context.
            context = int(self.operator_value) or self.context_max
        else:
            room = share_bytes - self.weights_bytes
            context = largest_context(room, self.kv_bytes_per_token, self.context_max)
            if context is not None and self.batch_setting:
                batch = min(self.batch_max, context)
        if context is not None:
            kv = kv_cache_bytes(context, self.kv_bytes_per_token)
        return RuntimeMemory(
            setting=self.setting,
            flag=self.flag,
            value=context,
            derived=self.operator_value is None,
            reserved_bytes=share_bytes + self.overhead_bytes,
            pool_bytes=pool_bytes,
            claim_bytes=None if kv is None else self.weights_bytes + self.overhead_bytes + kv,
            batch_setting=self.batch_setting if batch is not None else "",
            batch_flag=self.batch_flag if batch is not None else "",
            batch=batch,
            kv_cache_bytes=kv,
            unbounded=self.unbounded,
            share_of=self.share_of,
        )

    def derived(self, reserved_bytes: int, pool_bytes: int) -> float | None:
        """The largest fraction (rounded down) claiming at most `reserved_bytes`; None when even
        the smallest step claims more (or, for `free_after_weights`, the weights fill the reservation)."""
        if self.share_of is MemoryShare.POOL:
            room, of = reserved_bytes, pool_bytes
        else:
            room, of = reserved_bytes - self.weights_bytes, pool_bytes - self.weights_bytes
        if room <= 0 or of <= 0:
            return None
        steps = min(_FRACTION_STEPS, room * _FRACTION_STEPS // of)
        return steps / _FRACTION_STEPS if steps else None

    def claim_bytes(self, value: float, pool_bytes: int) -> int:
        """The bytes a runtime given `value` takes on a `pool_bytes` node (at most, for the KV share)."""
        # The decimal as the runtime parses it from its command line, exactly: 0.7 is 7/10.
        share = Fraction(repr(value))
        if self.share_of is MemoryShare.POOL:
            return math.floor(share * pool_bytes)
        weights = min(self.weights_bytes, pool_bytes)
        return weights + math.floor(share * (pool_bytes - weights))


@attrs.frozen(kw_only=True)
class RuntimeMemory:
    """The memory limit a replica on one unified-memory node runs under (shown in its explanation)."""

    #: The runtime setting (`gpu_memory_utilization`) and its command-line flag.
    setting: str
    flag: str
    #: The fraction given to the runtime (for a `context` limit, the context in tokens); None: no
    #: value keeps it within the reservation (or, with `unbounded`, none could be worked out).
    value: float | int | None
    #: Derived from the reservation (added to the command) rather than set by the operator.
    derived: bool
    reserved_bytes: int
    pool_bytes: int
    #: What `value` lets the runtime take; None with `value`.
    claim_bytes: int | None
    #: A derived context's batch setting (`batch_size`), its flag and value (never above the
    #: context); "" and None otherwise.
    batch_setting: str = ""
    batch_flag: str = ""
    batch: int | None = None
    #: A context's KV cache (part of `claim_bytes`, with the weights and the engine's overhead).
    kv_cache_bytes: int | None = None
    #: Why the runtime's memory is not bounded on this node (llama.cpp without its model's GGUF
    #: figures); the node is not failed for it, and the explanation says so.
    unbounded: str = ""
    #: What `value` is: a fraction (of the pool, or of what the weights leave) or a context.
    share_of: MemoryShare = MemoryShare.POOL

    @property
    def fits(self) -> bool:
        """The runtime's claim stays within what placement reserved for it (or cannot be known)."""
        if self.unbounded:
            return True
        return self.claim_bytes is not None and self.claim_bytes <= self.reserved_bytes
