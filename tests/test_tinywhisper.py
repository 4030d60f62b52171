"""The tiny Whisper model's bytes (`nexa.localparts.tinywhisper`), read back the way whisper.cpp's
`whisper_model_load` reads them, from a made-up header (the real one comes from the pywhispercpp sdist;
tests/e2e/test_whisper_server.py has a real whisper-server load and run it)."""

from __future__ import annotations

import struct

from nexa.localparts.tinywhisper import F16, F32, GGML_MAGIC, HEADS, STATE, tiny_whisper_bytes

N_VOCAB, N_AUDIO_CTX, N_TEXT_CTX, N_MELS = 100, 30, 12, 8


def header() -> bytes:
    """A header as the real tiny model's: hyperparameters, mel filters (n_mel x n_fft), a vocabulary."""
    hparams = struct.pack("<I11i", GGML_MAGIC, N_VOCAB, N_AUDIO_CTX, 384, 6, 4, N_TEXT_CTX, 384, 6, 4, N_MELS, 1)
    filters = struct.pack("<2i", N_MELS, 5) + struct.pack(f"<{N_MELS * 5}f", *range(N_MELS * 5))
    words = [f"w{i}".encode() for i in range(N_VOCAB)]
    vocab = struct.pack("<i", N_VOCAB) + b"".join(struct.pack("<I", len(w)) + w for w in words)
    return hparams + filters + vocab


def test_the_tiny_model_has_every_tensor_the_loader_wants_in_its_types_and_is_the_same_every_time() -> None:
    source = header()
    data = tiny_whisper_bytes(source)
    assert data == tiny_whisper_bytes(source)
    magic, *hparams = struct.unpack_from("<I11i", data)
    assert magic == GGML_MAGIC
    assert hparams == [N_VOCAB, N_AUDIO_CTX, STATE, HEADS, 1, N_TEXT_CTX, STATE, HEADS, 1, N_MELS, F16]
    rest = len(source) - struct.calcsize("<I11i")
    assert data[48 : 48 + rest] == source[48:]  # mel filters and vocabulary, as they were
    at, seen = 48 + rest, {}
    while at < len(data):
        n_dims, length, ttype = struct.unpack_from("<3i", data, at)
        dims = struct.unpack_from(f"<{n_dims}i", data, at + 12)
        at += 12 + 4 * n_dims
        name = data[at : at + length].decode()
        at += length
        count = 1
        for d in dims:
            count *= d
        at += count * (2 if ttype == F16 else 4)
        seen[name] = (dims, ttype)
    assert at == len(data)
    # whisper_model_load: 7 encoder tensors and 15 a block; 4 decoder tensors and 24 a block.
    assert len(seen) == 7 + 15 + 4 + 24
    assert seen["encoder.conv1.weight"] == ((3, N_MELS, STATE), F16)  # ggml's im2col wants a float16 kernel
    assert seen["encoder.conv1.bias"] == ((1, STATE), F32)
    assert seen["decoder.token_embedding.weight"] == ((STATE, N_VOCAB), F16)
    assert seen["decoder.positional_embedding"] == ((STATE, N_TEXT_CTX), F32)
    assert seen["decoder.blocks.0.cross_attn.key.weight"] == ((STATE, STATE), F16)
    assert seen["encoder.blocks.0.mlp.0.weight"] == ((STATE, 4 * STATE), F16)
