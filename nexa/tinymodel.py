"""A tiny llama model in GGUF, made here: random weights, deterministic bytes, a vocabulary of its own.

What the demo and the tests serve with the real llama.cpp runtime on CPU (no PyPI package ships
generative weights usable offline): two blocks, 64 wide, written with the `gguf` package, the same
bytes every time; its text is gibberish at temperature 0, but it loads, tokenizes, completes,
chats and (with mean pooling) embeds like any llama. `split_tiny_gguf` writes it as a split GGUF.
Nothing here is used by `nexa control` or `nexa node`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
from pathlib import Path
from typing import Any, Final, NamedTuple

from nexa.errors import ConfigError

#: The tiny llama's shape: random weights, deterministic bytes, gibberish text at temperature 0.
TINY_LLAMA: Final = {"context": 512, "embedding": 64, "blocks": 2, "heads": 4, "ffn": 128, "rope_dims": 16, "seed": 7}
#: A SentencePiece-style vocabulary made here (no vocab file to borrow): controls, 256 byte fallbacks, then
#: printable characters and a few words, with and without the word-start marker.
_WORDS: Final = ("the", "of", "and", "to", "in", "is", "it", "that", "hello", "world", "once", "upon", "a", "time")


def _tiny_vocab() -> tuple[list[str], list[float], list[int]]:
    normal, unknown, control, byte = 1, 2, 3, 6
    tokens, types = ["<unk>", "<s>", "</s>"], [unknown, control, control]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [byte] * 256
    pieces = [chr(c) for c in range(33, 127)] + ["\u2581"] + [f"\u2581{chr(c)}" for c in range(33, 127)]
    pieces += [f"\u2581{w}" for w in _WORDS] + list(_WORDS)
    for piece in pieces:
        if piece not in tokens:
            tokens.append(piece)
            types.append(normal)
    scores = [0.0] * 259 + [-float(i) for i in range(len(tokens) - 259)]
    return tokens, scores, types


def _write_tiny_llama(dest: Path, *, split_max_tensors: int = 0, mean_pooling: bool = False) -> None:
    import gguf  # type: ignore[import-untyped,unused-ignore]
    import numpy as np

    shape = TINY_LLAMA
    tokens, scores, types = _tiny_vocab()
    rng = np.random.default_rng(shape["seed"])
    # With split_max_tensors, gguf writes `<stem>-00001-of-0000N.gguf` … beside `dest` instead.
    writer = gguf.GGUFWriter(str(dest), "llama", split_max_tensors=split_max_tensors)
    writer.add_name("nexa-tiny-llama")
    writer.add_context_length(shape["context"])
    writer.add_embedding_length(shape["embedding"])
    writer.add_block_count(shape["blocks"])
    writer.add_feed_forward_length(shape["ffn"])
    writer.add_head_count(shape["heads"])
    writer.add_head_count_kv(shape["heads"])
    writer.add_layer_norm_rms_eps(1e-5)
    if mean_pooling:  # embeddings are then one vector per input, not one per token
        writer.add_pooling_type(gguf.PoolingType.MEAN)
    writer.add_rope_dimension_count(shape["rope_dims"])
    writer.add_file_type(1)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_unk_token_id(0)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_add_bos_token(True)
    writer.add_chat_template(
        "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    emb, ffn, vocab = shape["embedding"], shape["ffn"], len(tokens)

    def weights(*dims: int) -> np.ndarray[Any, Any]:
        return rng.normal(0.0, 0.02, size=dims).astype(np.float16)

    writer.add_tensor("token_embd.weight", weights(vocab, emb))
    writer.add_tensor("output_norm.weight", np.ones(emb, dtype=np.float32))
    writer.add_tensor("output.weight", weights(vocab, emb))
    for i in range(shape["blocks"]):
        writer.add_tensor(f"blk.{i}.attn_norm.weight", np.ones(emb, dtype=np.float32))
        for name in ("attn_q", "attn_k", "attn_v", "attn_output"):
            writer.add_tensor(f"blk.{i}.{name}.weight", weights(emb, emb))
        writer.add_tensor(f"blk.{i}.ffn_norm.weight", np.ones(emb, dtype=np.float32))
        writer.add_tensor(f"blk.{i}.ffn_gate.weight", weights(ffn, emb))
        writer.add_tensor(f"blk.{i}.ffn_up.weight", weights(ffn, emb))
        writer.add_tensor(f"blk.{i}.ffn_down.weight", weights(emb, ffn))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def has_gguf_writer() -> bool:
    return importlib.util.find_spec("gguf") is not None and importlib.util.find_spec("numpy") is not None


def tiny_gguf(cache: Path, *, mean_pooling: bool = False) -> Path:
    """A tiny random-weight llama GGUF (two blocks, 64 wide, a vocabulary made here), generated once and
    kept in `cache` under a name keyed by its recipe; the same bytes every time. With `mean_pooling` it is
    an embedding model: a server started for embeddings answers one 64-wide vector per input. ConfigError
    without the `gguf` package."""
    if not has_gguf_writer():
        raise ConfigError("the gguf package is not installed in this Python (pip install gguf numpy)")
    shape = {**TINY_LLAMA, "pooling": "mean"} if mean_pooling else TINY_LLAMA
    recipe = json.dumps({"shape": shape, "vocab": _tiny_vocab()}, sort_keys=True)
    cache.mkdir(parents=True, exist_ok=True)
    kind = "tiny-llama-embed" if mean_pooling else "tiny-llama"
    dest = cache / f"{kind}-{hashlib.sha256(recipe.encode()).hexdigest()[:16]}.gguf"
    if not dest.is_file():
        staging = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
        try:
            _write_tiny_llama(staging, mean_pooling=mean_pooling)
            staging.replace(dest)
        finally:
            staging.unlink(missing_ok=True)
    return dest


def split_tiny_gguf(directory: Path, *, shards: int = 2) -> list[Path]:
    """The tiny llama GGUF written as a split GGUF of `shards` files into `directory`
    (`tiny-llama-00001-of-0000N.gguf` …, llama.cpp's `gguf-split` naming), shards in order.
    The first shard holds the metadata (with mean pooling, so that a server started for
    embeddings answers one vector per input); llama.cpp loads the rest from beside it."""
    if not has_gguf_writer():
        raise ConfigError("the gguf package is not installed in this Python (pip install gguf numpy)")
    tensors = 3 + 9 * int(TINY_LLAMA["blocks"])
    directory.mkdir(parents=True, exist_ok=True)
    _write_tiny_llama(directory / "tiny-llama.gguf", split_max_tensors=-(-tensors // shards), mean_pooling=True)
    found = sorted(directory.glob("tiny-llama-*-of-*.gguf"))
    if len(found) != shards:
        raise ConfigError(f"gguf wrote {len(found)} shard(s) into {directory}, not {shards}")
    return found


#: The tiny LoRA adapter's shape: rank, alpha (scale alpha/rank = 1), the spread of its random
#: weights, and the base tensor it adapts (the output projection: greedy text then changes).
class _LoraShape(NamedTuple):
    rank: int
    alpha: float
    seed: int
    strength: float
    target: str


TINY_LORA: Final = _LoraShape(rank=8, alpha=8.0, seed=11, strength=0.5, target="output.weight")


def _write_tiny_lora(dest: Path) -> None:
    """A LoRA adapter for the tiny llama in llama.cpp's GGUF layout (`src/llama-adapter.cpp`):
    general.type `adapter`, adapter.type `lora`, adapter.lora.alpha, the base's architecture, and per
    adapted tensor `<base name>.lora_a` (rank x in) and `<base name>.lora_b` (out x rank), in numpy's
    order (ggml's `ne` reversed). It adapts the output projection strongly enough that greedy text
    changes."""
    import gguf  # type: ignore[import-untyped,unused-ignore]
    import numpy as np

    rank, alpha, seed, strength, target = TINY_LORA
    rng = np.random.default_rng(seed)
    emb, vocab = TINY_LLAMA["embedding"], len(_tiny_vocab()[0])
    writer = gguf.GGUFWriter(str(dest), "llama")
    writer.add_type(gguf.GGUFType.ADAPTER)
    writer.add_name("nexa-tiny-llama-lora")
    writer.add_string(gguf.Keys.Adapter.TYPE, "lora")
    writer.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
    writer.add_tensor(f"{target}.lora_a", rng.normal(0.0, strength, size=(rank, emb)).astype(np.float32))
    writer.add_tensor(f"{target}.lora_b", rng.normal(0.0, strength, size=(vocab, rank)).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def tiny_lora_gguf(cache: Path) -> Path:
    """A LoRA adapter in GGUF for `tiny_gguf`'s model (random, deterministic bytes), kept in `cache`
    under a name keyed by its recipe. llama.cpp loads it with `--lora`; answers at temperature 0
    differ from the base's. ConfigError without the `gguf` package."""
    if not has_gguf_writer():
        raise ConfigError("the gguf package is not installed in this Python (pip install gguf numpy)")
    recipe = json.dumps({"base": TINY_LLAMA, "lora": TINY_LORA, "vocab": _tiny_vocab()}, sort_keys=True)
    cache.mkdir(parents=True, exist_ok=True)
    dest = cache / f"tiny-llama-lora-{hashlib.sha256(recipe.encode()).hexdigest()[:16]}.gguf"
    if not dest.is_file():
        staging = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
        try:
            _write_tiny_lora(staging)
            staging.replace(dest)
        finally:
            staging.unlink(missing_ok=True)
    return dest
