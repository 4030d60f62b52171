"""A tiny random-weight Whisper model in whisper.cpp's own ggml format, made here (no hub), for a real
`whisper-server` to load and run: its transcripts are gibberish, but every step of real inference (mel,
encoder, decoder, sampling, the server's answer) runs on it.

Where every part comes from (whisper.cpp v1.8 as the pywhispercpp sdist vendors it, `whisper_sdist`):

* the file format is what `whisper_model_load` in `src/whisper.cpp` reads, all little-endian: the
  magic `ggml` (0x67676d6c, ggml's `GGML_FILE_MAGIC`), eleven int32 hyperparameters (n_vocab,
  n_audio_ctx, n_audio_state, n_audio_head, n_audio_layer, n_text_ctx, n_text_state, n_text_head,
  n_text_layer, n_mels, ftype), the mel filters (int32 n_mel, int32 n_fft, then n_mel * n_fft
  float32), the vocabulary (int32 count, then each token as uint32 length and bytes), then the
  tensors, each as int32 n_dims, int32 name length, int32 type, n_dims int32 sizes (innermost first),
  the name and the data;
* the hyperparameters' values that whisper.cpp's compute needs as they are (n_vocab 51865, the
  multilingual vocabulary; n_audio_ctx 1500, the 3000 mel frames of 30 s halved by the second
  convolution; n_text_ctx 448; n_mels 80), the mel filters and the vocabulary are copied from the
  sdist's `models/for-tests-ggml-tiny.bin` (a header of the real tiny model without its tensors);
  the widths are made small (`STATE` 64, `HEADS` 2, one encoder and one decoder block), and ftype 1
  (float16), as the published models have it: the loader then wants the matrices (`wtype`: the
  convolutions' kernels, the attention and MLP weights, the token embedding) in float16 and the rest
  (biases, norms, positional embeddings) in float32. A float32 file loads but does not run: the
  encoder's convolution (ggml's im2col, made float16 by `ggml_conv_1d`) asserts a float16 kernel;
* the tensors' names, shapes and order are those `whisper_model_load` creates (names from
  `ASR_TENSOR_NAMES` in `src/whisper-arch.h`): it looks each up by name and checks its shape, and
  wants every one of them. Layer norms are 1 and 0; every other tensor is small uniform noise from a
  seeded generator, so the same bytes come every time.
"""

from __future__ import annotations

import os
import random
import struct
from collections.abc import Iterator
from pathlib import Path
from typing import Final

from nexa.localparts.images import cached_build, recipe_name
from nexa.localparts.whisperserver import TEST_MODEL, WHISPER_SERVER_SDIST, whisper_sdist

GGML_MAGIC: Final = 0x67676D6C
#: The widths of the tiny model (whisper.cpp asserts n_text_state == n_audio_state).
STATE: Final = 64
HEADS: Final = 2
AUDIO_LAYERS: Final = 1
TEXT_LAYERS: Final = 1
#: ggml's types (a tensor's type in the file; the file's ftype is F16, "mostly float16").
F32: Final = 0
F16: Final = 1
SEED: Final = 1
SCALE: Final = 0.05


def tensors(n_vocab: int, n_audio_ctx: int, n_text_ctx: int, n_mels: int) -> Iterator[tuple[str, tuple[int, ...]]]:
    """Each tensor whisper.cpp's loader expects, in its order: name and sizes (ggml's, innermost first)."""
    s = STATE
    yield "encoder.positional_embedding", (s, n_audio_ctx)
    yield "encoder.conv1.weight", (3, n_mels, s)
    yield "encoder.conv1.bias", (1, s)
    yield "encoder.conv2.weight", (3, s, s)
    yield "encoder.conv2.bias", (1, s)
    yield "encoder.ln_post.weight", (s,)
    yield "encoder.ln_post.bias", (s,)
    for i in range(AUDIO_LAYERS):
        yield from _block(f"encoder.blocks.{i}", "attn", cross=False)
    yield "decoder.positional_embedding", (s, n_text_ctx)
    yield "decoder.token_embedding.weight", (s, n_vocab)
    yield "decoder.ln.weight", (s,)
    yield "decoder.ln.bias", (s,)
    for i in range(TEXT_LAYERS):
        yield from _block(f"decoder.blocks.{i}", "attn", cross=True)


def _block(prefix: str, attn: str, *, cross: bool) -> Iterator[tuple[str, tuple[int, ...]]]:
    s = STATE
    yield f"{prefix}.mlp_ln.weight", (s,)
    yield f"{prefix}.mlp_ln.bias", (s,)
    yield f"{prefix}.mlp.0.weight", (s, 4 * s)
    yield f"{prefix}.mlp.0.bias", (4 * s,)
    yield f"{prefix}.mlp.2.weight", (4 * s, s)
    yield f"{prefix}.mlp.2.bias", (s,)
    for a in ["attn", "cross_attn"] if cross else [attn]:
        yield f"{prefix}.{a}_ln.weight", (s,)
        yield f"{prefix}.{a}_ln.bias", (s,)
        yield f"{prefix}.{a}.query.weight", (s, s)
        yield f"{prefix}.{a}.query.bias", (s,)
        yield f"{prefix}.{a}.key.weight", (s, s)
        yield f"{prefix}.{a}.value.weight", (s, s)
        yield f"{prefix}.{a}.value.bias", (s,)
        yield f"{prefix}.{a}.out.weight", (s, s)
        yield f"{prefix}.{a}.out.bias", (s,)


def tiny_whisper_bytes(header_model: bytes) -> bytes:
    """The tiny model, from the real tiny model's header (`for-tests-ggml-tiny.bin`: hyperparameters,
    mel filters, vocabulary, no tensors)."""
    magic, *hparams = struct.unpack_from("<I11i", header_model)
    if magic != GGML_MAGIC:
        raise ValueError("not a whisper.cpp ggml model (bad magic)")
    n_vocab, n_audio_ctx, _, _, _, n_text_ctx, _, _, _, n_mels, _ = hparams
    rest = header_model[struct.calcsize("<I11i") :]  # mel filters and vocabulary, kept as they are
    small = (n_vocab, n_audio_ctx, STATE, HEADS, AUDIO_LAYERS, n_text_ctx, STATE, HEADS, TEXT_LAYERS, n_mels, F16)
    out = [struct.pack("<I11i", GGML_MAGIC, *small), rest]
    rng = random.Random(SEED)  # noqa: S311 - reproducible weights, not secrets
    for name, dims in tensors(n_vocab, n_audio_ctx, n_text_ctx, n_mels):
        count = 1
        for d in dims:
            count *= d
        encoded = name.encode()
        matrix = name.endswith(".weight") and len(dims) > 1  # created with wtype (or vtype): float16
        out.append(struct.pack(f"<3i{len(dims)}i", len(dims), len(encoded), F16 if matrix else F32, *dims) + encoded)
        owner, _, kind = name.rpartition(".")
        if owner.endswith("ln") or owner.endswith("ln_post"):  # a layer norm: the identity
            values = [1.0 if kind == "weight" else 0.0] * count
        else:
            values = [SCALE * (2 * rng.random() - 1) for _ in range(count)]
        out.append(struct.pack(f"<{count}{'e' if matrix else 'f'}", *values))
    return b"".join(out)


def make_tiny_whisper(cache: Path) -> Path:
    """The tiny model, generated once and kept in `cache` under a name keyed by its recipe (the same
    bytes every time); the sdist it reads its header from is fetched first if need be."""
    recipe: dict[str, object] = {
        "sdist": WHISPER_SERVER_SDIST,
        "header": TEST_MODEL,
        "state": STATE,
        "heads": HEADS,
        "layers": [AUDIO_LAYERS, TEXT_LAYERS],
        "seed": SEED,
        "types": "f16 matrices",
        "scale": SCALE,
    }
    name = recipe_name("tiny-whisper", recipe).removesuffix(".tar.gz") + ".bin"

    def build(dest: Path) -> None:
        data = tiny_whisper_bytes((whisper_sdist(cache) / TEST_MODEL).read_bytes())
        tmp = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        tmp.replace(dest)

    path, _ = cached_build(cache, name, build, rebuild=False, clear=lambda d: None)
    return path
