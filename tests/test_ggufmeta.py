"""The bounded GGUF header reader (`nexa.ggufmeta`): what the `gguf` package (llama.cpp's own
Python writer) writes, it reads; hostile headers are refused with a typed error and nothing else.

Headers are written with `gguf.GGUFWriter` (the test dependency; nexa's runtime never imports it)
or, for what no writer would produce, byte by byte in the layout of llama.cpp's `gguf.cpp`.
"""

from __future__ import annotations

import random
import struct
from pathlib import Path

import gguf  # type: ignore[import-untyped,unused-ignore]
import pytest

from nexa.contracts.kvcache import GgufFigures
from nexa.errors import GgufInvalid
from nexa.ggufmeta import (
    KEEP_STRING_BYTES,
    MAX_DEPTH,
    MAX_ENTRIES,
    MAX_KEY_BYTES,
    attention_figures,
    read_header,
)
from nexa.tinymodel import TINY_LLAMA


def _written(tmp_path: Path, arch: str, fill: object, *, endianess: object = None) -> bytes:
    """A header-only GGUF (no tensors) that `fill(writer)` filled, as the gguf package writes it."""
    path = tmp_path / "m.gguf"
    kwargs = {} if endianess is None else {"endianess": endianess}
    writer = gguf.GGUFWriter(str(path), arch, **kwargs)
    fill(writer)  # type: ignore[operator]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def _qwen2_7b(w: object) -> None:
    """Qwen2-7B-Instruct's attention figures (its config.json), with values of every other kind."""
    w.add_context_length(32768)  # type: ignore[attr-defined]
    w.add_embedding_length(3584)  # type: ignore[attr-defined]
    w.add_block_count(28)  # type: ignore[attr-defined]
    w.add_head_count(28)  # type: ignore[attr-defined]
    w.add_head_count_kv(4)  # type: ignore[attr-defined]
    w.add_float32("qwen2.rope.freq_base", 1000000.0)  # type: ignore[attr-defined]
    w.add_bool("nexa.test.flag", True)  # type: ignore[attr-defined]
    w.add_int64("nexa.test.big", -(2**40))  # type: ignore[attr-defined]
    w.add_string("nexa.test.long", "x" * (KEEP_STRING_BYTES + 1))  # type: ignore[attr-defined]
    w.add_array("nexa.test.words", ["a", "bc", "déf"])  # type: ignore[attr-defined]
    w.add_array("nexa.test.floats", [0.5, 1.5])  # type: ignore[attr-defined]
    w.add_array("nexa.test.nested", [[1, 2], [3]])  # type: ignore[attr-defined]
    w.add_array("nexa.test.ints", [7, 8, 9])  # type: ignore[attr-defined]


def test_the_reader_reads_what_the_gguf_package_writes(tmp_path: Path) -> None:
    data = _written(tmp_path, "qwen2", _qwen2_7b)
    header = read_header(data, file_bytes=len(data))
    assert header.version == 3 and header.tensor_count == 0
    # Every scalar and short string as the package's own reader sees it.
    theirs = gguf.GGUFReader(tmp_path / "m.gguf")
    for key, field in theirs.fields.items():
        if key.startswith("GGUF."):
            continue
        ours = header.metadata[key]
        if field.types == [gguf.GGUFValueType.STRING] and len(field.parts[-1]) <= KEEP_STRING_BYTES:
            assert ours == field.contents()
        elif len(field.types) == 1 and field.types[0] != gguf.GGUFValueType.STRING:
            assert ours == pytest.approx(field.contents())
    assert header.metadata["nexa.test.ints"] == (7, 8, 9)
    # Long strings, string and float arrays and nested arrays are skipped, not kept.
    for skipped in ("nexa.test.long", "nexa.test.words", "nexa.test.floats", "nexa.test.nested"):
        assert header.metadata[skipped] == ()
    assert len(data) - 32 < header.metadata_end <= len(data)  # no tensors: the metadata, padded to 32 bytes
    figures = attention_figures(header)
    assert figures == GgufFigures(
        architecture="qwen2",
        context_length=32768,
        block_count=28,
        embedding_length=3584,
        head_count=28,
        head_count_kv=4,
        key_length=128,
        value_length=128,
    )
    # 2 (K and V) x 28 layers x 4 KV heads x 128 x 2 bytes: 56 KiB a token, 1.75 GiB for 32k.
    assert figures.kv_bytes_per_token() == 57344
    assert figures.kv_bytes_per_token("q8_0", "q8_0") == 57344 * 34 / 64
    assert figures.kv_bytes_per_token("q4_0", "f16") == 28 * 4 * 128 * (18 + 64) / 32


def test_per_layer_head_counts_and_explicit_head_sizes(tmp_path: Path) -> None:
    def fill(w: object) -> None:
        w.add_context_length(4096)  # type: ignore[attr-defined]
        w.add_embedding_length(1024)  # type: ignore[attr-defined]
        w.add_block_count(4)  # type: ignore[attr-defined]
        w.add_head_count([8, 8, 8, 8])  # type: ignore[attr-defined]
        w.add_head_count_kv([2, 4, 0, 4])  # type: ignore[attr-defined]
        w.add_key_length(192)  # type: ignore[attr-defined]
        w.add_value_length(128)  # type: ignore[attr-defined]

    figures = attention_figures(read_header(_written(tmp_path, "openelm", fill)))
    # The largest layer's KV heads (an upper bound), the header's own head sizes.
    assert (figures.head_count, figures.head_count_kv, figures.key_length, figures.value_length) == (8, 4, 192, 128)
    assert figures.kv_bytes_per_token() == 4 * 4 * (192 + 128) * 2


def test_the_tiny_llama_the_tests_serve(tiny_gguf: Path) -> None:
    figures = attention_figures(read_header(tiny_gguf.read_bytes()))
    shape = TINY_LLAMA
    assert (figures.architecture, figures.context_length, figures.block_count) == ("llama", 512, shape["blocks"])
    assert figures.head_count == figures.head_count_kv == shape["heads"]
    assert figures.key_length == shape["embedding"] // shape["heads"]
    assert figures.kv_bytes_per_token() == 2 * 2 * 4 * 16 * 2


# --- hostile headers ---------------------------------------------------------------------------


def _string(text: bytes) -> bytes:
    return struct.pack("<Q", len(text)) + text


def _kv(key: bytes, kind: int, payload: bytes) -> bytes:
    return _string(key) + struct.pack("<I", kind) + payload


def _header(*entries: bytes, count: int | None = None, version: int = 3, tensors: int = 0) -> bytes:
    n = len(entries) if count is None else count
    return b"GGUF" + struct.pack("<IQQ", version, tensors, n) + b"".join(entries)


U32, STRING, ARRAY = 4, 8, 9
ARCH = _kv(b"general.architecture", STRING, _string(b"llama"))


@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"", "cut short"),
        (b"GGML" + bytes(20), "not a GGUF file"),
        (b"\x00" * 24, "not a GGUF file"),
        (_header(version=1), "version 1 is not read"),
        (b"GGUF" + struct.pack(">IQQ", 3, 0, 0), "big-endian"),
        (_header(tensors=2**40), "tensors, more than"),
        # Counts far beyond the bytes there are, or beyond any bound.
        (_header(count=2**63), f"more than {MAX_ENTRIES}"),
        (_header(count=MAX_ENTRIES), "cut short"),
        (_header(struct.pack("<Q", 2**64 - 1) + bytes(8)), "more than 65535"),
        (_header(struct.pack("<Q", MAX_KEY_BYTES + 1) + b"k" * (MAX_KEY_BYTES + 1)), "more than 65535"),
        (_header(struct.pack("<Q", 100) + b"short"), "cut short"),
        (_header(_kv(b"a", STRING, struct.pack("<Q", 2**62))), "cut short"),
        (_header(_kv(b"a", ARRAY, struct.pack("<IQ", U32, 2**62))), "cut short"),
        (_header(_kv(b"a", ARRAY, struct.pack("<IQ", STRING, 2**61))), "cut short"),
        (_header(_kv(b"a", ARRAY, struct.pack("<IQ", ARRAY, 2**60))), "cut short"),
        # Types and nesting.
        (_header(_kv(b"a", 13, b"\x00" * 8)), "unknown value type 13"),
        (_header(_kv(b"a", ARRAY, struct.pack("<IQ", 99, 1) + bytes(8))), "unknown value type 99"),
        (
            _header(_kv(b"a", ARRAY, struct.pack("<IQ", ARRAY, 1) + struct.pack("<IQ", ARRAY, 1) + bytes(12))),
            f"deeper than {MAX_DEPTH}",
        ),
        # Keys.
        (_header(ARCH, ARCH), "a duplicate"),
        (_header(_kv(b"\xff\xfe", U32, bytes(4))), "not UTF-8"),
        (_header(_kv(b"", U32, bytes(4))), "empty"),
        (_header(_kv(b"a\nb", U32, bytes(4))), "control characters"),
    ],
)
def test_a_hostile_header_is_a_typed_refusal(data: bytes, says: str) -> None:
    with pytest.raises(GgufInvalid, match=says) as caught:
        read_header(data)
    assert caught.value.code == "gguf_invalid"


def test_a_header_larger_than_the_bytes_read_says_so_and_a_short_file_says_that(tmp_path: Path) -> None:
    data = _written(tmp_path, "qwen2", _qwen2_7b)
    head = data[:100]
    with pytest.raises(GgufInvalid, match="larger than the 100 bytes read"):
        read_header(head, file_bytes=len(data))
    with pytest.raises(GgufInvalid, match="cut short"):
        read_header(head, file_bytes=100)


def test_every_cut_and_random_damage_is_refused_or_read_never_anything_else(tiny_gguf: Path) -> None:
    data = tiny_gguf.read_bytes()
    end = read_header(data).metadata_end
    for cut in [*range(0, 64), *range(64, end, 97)]:
        with pytest.raises(GgufInvalid):
            read_header(data[:cut])
    rng = random.Random(29)
    for _ in range(300):
        damaged = bytearray(data[:end])
        for _ in range(rng.randint(1, 8)):
            damaged[rng.randrange(len(damaged))] = rng.randrange(256)
        try:
            header = read_header(bytes(damaged))
            attention_figures(header)
        except GgufInvalid:
            pass


def test_a_big_endian_file_the_package_writes_is_refused(tmp_path: Path) -> None:
    data = _written(tmp_path, "llama", lambda w: w.add_block_count(2), endianess=gguf.GGUFEndian.BIG)
    with pytest.raises(GgufInvalid, match="big-endian"):
        read_header(data)


def _figures_of(*entries: bytes) -> GgufFigures:
    return attention_figures(read_header(_header(*entries)))


def _u32(key: str, value: int) -> bytes:
    return _kv(key.encode(), U32, struct.pack("<I", value))


BASE = (_u32("llama.context_length", 4096), _u32("llama.embedding_length", 256), _u32("llama.block_count", 2))


@pytest.mark.parametrize(
    ("entries", "says"),
    [
        ((), "no general.architecture"),
        ((_kv(b"general.architecture", U32, bytes(4)),), "no general.architecture"),
        ((ARCH, *BASE), "no llama.attention.head_count"),
        ((ARCH, *BASE[1:], _u32("llama.attention.head_count", 4)), "no llama.context_length"),
        ((ARCH, *BASE, _u32("llama.attention.head_count", 3)), "not a multiple of its head count 3"),
        ((ARCH, *BASE, _kv(b"llama.attention.head_count", 7, b"\x01")), "not an integer"),
        (
            (ARCH, *BASE, _kv(b"llama.attention.head_count", ARRAY, struct.pack("<IQII", U32, 2, 0, 0))),
            "a model without attention",
        ),
        (
            (ARCH, *BASE, _kv(b"llama.attention.head_count", ARRAY, struct.pack("<IQIII", U32, 3, 4, 4, 4))),
            "gives 3 values for 2 layers",
        ),
        ((ARCH, *BASE[:2], _u32("llama.block_count", 2**20), _u32("llama.attention.head_count", 4)), "out of bounds"),
        (
            (_kv(b"general.architecture", STRING, _string(b"../x")), *BASE, _u32("llama.attention.head_count", 4)),
            "not an architecture's name",
        ),
        (
            (ARCH, *BASE, _u32("llama.attention.head_count", 4), _kv(b"llama.attention.key_length", 5, b"\xff" * 4)),
            "out of bounds",
        ),
    ],
)
def test_missing_or_implausible_figures_are_a_typed_refusal(entries: tuple[bytes, ...], says: str) -> None:
    with pytest.raises(GgufInvalid, match=says):
        _figures_of(*entries)
