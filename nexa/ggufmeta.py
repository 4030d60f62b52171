"""A GGUF file's header, read within bounds: its key-value metadata (GGUF v2 and v3) and the
attention figures llama.cpp sizes its KV cache by (`contracts.kvcache.GgufFigures`). Pure: it
reads the bytes it is given.

The header is untrusted input (it comes from a model artifact anyone allowed to register one
chose). No count or length in it is trusted: each is checked against its bound and against the
bytes left before anything is read or skipped, so a hostile header costs at most one pass over
the bytes given, and every refusal is a `GgufInvalid` naming the entry and its offset.

Layout (llama.cpp `ggml/include/gguf.h`, `ggml/src/gguf.cpp`; the `gguf` Python package writes
the same): little-endian; `GGUF`, the version (uint32), the tensor count (uint64), the metadata
count (uint64), then per entry a key (string), a value type (uint32) and the value. A string is
a uint64 byte length and UTF-8 bytes; an array its element type (uint32), count (uint64) and
elements. Version 1 (32-bit counts) and big-endian files are refused, as duplicate keys are.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from typing import Final

import attrs

from nexa.contracts.kvcache import ARCHITECTURE_RE, MAX_BLOCKS, GgufFigures
from nexa.errors import GgufInvalid

MAGIC: Final = b"GGUF"
#: The magic, the version and the two counts.
HEADER_MIN_BYTES: Final = 24
VERSIONS: Final = (2, 3)
#: How much of a file the controller reads for its header: the metadata of the largest
#: vocabularies (a 256k-token SentencePiece vocabulary with its scores and types, or BPE merges)
#: takes a few tens of MB; the tensors' descriptions after it are not needed.
MAX_HEADER_BYTES: Final = 64 * 2**20
#: Bounds on the counts and lengths a header may claim.
MAX_ENTRIES: Final = 1 << 16
MAX_TENSORS: Final = 1 << 24
#: GGUF keys are at most 65535 bytes (ggml/docs/gguf.md).
MAX_KEY_BYTES: Final = 65535
#: An array of arrays is the deepest a value may nest.
MAX_DEPTH: Final = 2
#: String values up to this length are kept (the architecture's name); longer ones are skipped.
KEEP_STRING_BYTES: Final = 256
#: Integer arrays up to this length are kept (one figure per layer); longer ones are skipped.
KEEP_ARRAY_ITEMS: Final = MAX_BLOCKS

_STRING: Final = 8
_ARRAY: Final = 9
#: Value type -> (struct format, size); the integer and float types and bool.
_SCALARS: Final[Mapping[int, tuple[str, int]]] = {
    0: ("<B", 1),
    1: ("<b", 1),
    2: ("<H", 2),
    3: ("<h", 2),
    4: ("<I", 4),
    5: ("<i", 4),
    6: ("<f", 4),
    7: ("<?", 1),
    10: ("<Q", 8),
    11: ("<q", 8),
    12: ("<d", 8),
}
_INTEGERS: Final = frozenset({0, 1, 2, 3, 4, 5, 10, 11})
_U32: Final = struct.Struct("<I")
_U64: Final = struct.Struct("<Q")

Value = int | float | bool | str | tuple[int, ...]


@attrs.frozen(kw_only=True)
class GgufHeader:
    """A header as read: scalars, short strings and short integer arrays by key (longer values
    are left out), and the offset where the metadata ends."""

    version: int
    tensor_count: int
    metadata: Mapping[str, Value]
    metadata_end: int


class _Bytes:
    """A cursor over the bytes given; `file_bytes`: the whole file's size, where known."""

    def __init__(self, data: bytes, file_bytes: int | None) -> None:
        self.data = memoryview(data)
        self.pos = 0
        self.cut = file_bytes is not None and file_bytes > len(data)

    def left(self) -> int:
        return len(self.data) - self.pos

    def take(self, n: int, what: str) -> memoryview:
        if n > self.left():
            if self.cut:
                raise GgufInvalid(
                    f"the GGUF metadata is larger than the {len(self.data)} bytes read ({what} at byte {self.pos} "
                    f"needs {n}); it is not read"
                )
            raise GgufInvalid(
                f"the GGUF header is cut short: {what} at byte {self.pos} needs {n} bytes, {self.left()} left"
            )
        out = self.data[self.pos : self.pos + n]
        self.pos += n
        return out

    def u32(self, what: str) -> int:
        value: int = _U32.unpack(self.take(4, what))[0]
        return value

    def u64(self, what: str) -> int:
        value: int = _U64.unpack(self.take(8, what))[0]
        return value

    def length(self, what: str, bound: int | None = None, each: int = 1) -> int:
        """A uint64 count of items of at least `each` bytes: within `bound` and the bytes left."""
        at = self.pos
        n = self.u64(what)
        if bound is not None and n > bound:
            raise GgufInvalid(f"the GGUF header claims {n} for {what} at byte {at}, more than {bound}")
        if n * each > self.left():
            self.take(n * each, what)  # raises, saying whether the file or the read was short
        return n


def read_header(data: bytes, *, file_bytes: int | None = None) -> GgufHeader:
    """The header at the start of `data` (a file's first bytes, or all of it; `file_bytes`: the
    file's size, so that a read cut short says so). Raises GgufInvalid for anything that is not
    a GGUF v2 or v3 header within the bounds above."""
    cur = _Bytes(data, file_bytes)
    magic = bytes(cur.take(4, "the magic"))
    if magic != MAGIC:
        raise GgufInvalid(f"not a GGUF file: it starts with {magic!r}, not {MAGIC!r}")
    version = cur.u32("the version")
    if version not in VERSIONS:
        if version in {v << 24 for v in VERSIONS}:
            raise GgufInvalid("a big-endian GGUF file: llama.cpp on this node reads little-endian ones only")
        raise GgufInvalid(f"GGUF version {version} is not read (versions 2 and 3 are)")
    tensors = cur.u64("the tensor count")
    if tensors > MAX_TENSORS:
        raise GgufInvalid(f"the GGUF header claims {tensors} tensors, more than {MAX_TENSORS}")
    # The smallest entry: a key of 1 byte (8 + 1), its type (4) and a 1-byte value.
    entries = cur.length("the metadata count", MAX_ENTRIES, each=14)
    metadata: dict[str, Value] = {}
    for index in range(entries):
        at = cur.pos
        size = cur.length(f"the key of entry {index}", MAX_KEY_BYTES)
        raw = bytes(cur.take(size, f"the key of entry {index}"))
        try:
            key = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise GgufInvalid(f"the key of entry {index} at byte {at} is not UTF-8") from None
        if not key or key in metadata or any(ord(c) < 0x20 for c in key):
            why = "empty" if not key else "a duplicate" if key in metadata else "has control characters"
            raise GgufInvalid(f"the key of entry {index} at byte {at} is {why}")
        what = f"entry {index} ({key})"
        kind = cur.u32(f"the type of {what}")
        value = _value(cur, kind, what, 1)
        if value is not None:
            metadata[key] = value
        else:
            metadata.setdefault(key, ())  # present, not kept: a duplicate is still one
    return GgufHeader(version=version, tensor_count=tensors, metadata=metadata, metadata_end=cur.pos)


def _value(cur: _Bytes, kind: int, what: str, depth: int) -> Value | None:
    """One value of type `kind`: returned when it is kept, skipped (None) otherwise."""
    if kind in _SCALARS:
        fmt, size = _SCALARS[kind]
        scalar: int | float | bool = struct.unpack(fmt, cur.take(size, what))[0]
        return scalar
    if kind == _STRING:
        size = cur.length(what)
        raw = bytes(cur.take(size, what))
        if size > KEEP_STRING_BYTES:
            return None
        return raw.decode("utf-8", errors="replace")
    if kind != _ARRAY:
        raise GgufInvalid(f"{what} at byte {cur.pos - 4} has the unknown value type {kind}")
    return _array(cur, what, depth)


def _array(cur: _Bytes, what: str, depth: int) -> tuple[int, ...] | None:
    """An array: kept when it holds at most `KEEP_ARRAY_ITEMS` integers, skipped otherwise."""
    if depth > MAX_DEPTH:
        raise GgufInvalid(f"{what} nests arrays deeper than {MAX_DEPTH}")
    element = cur.u32(f"the element type of {what}")
    if element in _SCALARS:
        fmt, size = _SCALARS[element]
        count = cur.length(f"the length of {what}", each=size)
        body = cur.take(count * size, what)
        if element not in _INTEGERS or count > KEEP_ARRAY_ITEMS:
            return None
        return tuple(int(v) for v in struct.unpack(f"<{count}{fmt[1]}", body))
    if element == _STRING:
        count = cur.length(f"the length of {what}", each=8)
        for _ in range(count):
            cur.take(cur.length(what), what)
        return None
    if element == _ARRAY:
        count = cur.length(f"the length of {what}", each=12)
        for _ in range(count):
            _array(cur, what, depth + 1)
        return None
    raise GgufInvalid(f"{what} is an array of the unknown value type {element}")


def attention_figures(header: GgufHeader) -> GgufFigures:
    """The figures llama.cpp sizes the KV cache by, from `general.architecture` and its keys.
    Raises GgufInvalid naming a key that is missing or not a figure."""
    md = header.metadata
    arch = md.get("general.architecture")
    if not isinstance(arch, str) or not arch:
        raise GgufInvalid("the GGUF header names no general.architecture")
    if not ARCHITECTURE_RE.fullmatch(arch):
        raise GgufInvalid(f"the GGUF header's general.architecture {arch[:64]!r} is not an architecture's name")

    def figure(name: str) -> int | tuple[int, ...] | None:
        value = md.get(f"{arch}.{name}")
        if value is None or (isinstance(value, int | tuple) and not isinstance(value, bool)):
            return value
        raise GgufInvalid(f"{arch}.{name} in the GGUF header is not an integer")

    def one(name: str) -> int:
        value = figure(name)
        if not isinstance(value, int):
            raise GgufInvalid(f"the GGUF header has no {arch}.{name} (a figure llama.cpp sizes the KV cache by)")
        return value

    blocks = one("block_count")

    def per_layer(name: str) -> tuple[int, ...] | None:
        """A figure given once or per layer, as its per-layer values (llama.cpp `get_key_or_arr`)."""
        value = figure(name)
        if isinstance(value, tuple):
            if len(value) != blocks:
                raise GgufInvalid(f"{arch}.{name} gives {len(value)} values for {blocks} layers")
            return value
        return None if value is None else (value,)

    embedding = one("embedding_length")
    heads = per_layer("attention.head_count")
    if heads is None or not any(heads):
        raise GgufInvalid(f"the GGUF header has no {arch}.attention.head_count (a model without attention)")
    kv_heads = per_layer("attention.head_count_kv") or heads
    head = next(h for h in heads if h)
    if embedding % head:
        raise GgufInvalid(f"{arch}.embedding_length {embedding} is not a multiple of its head count {head}")
    key = figure("attention.key_length")
    value = figure("attention.value_length")
    try:
        return GgufFigures(
            architecture=arch,
            context_length=one("context_length"),
            block_count=blocks,
            embedding_length=embedding,
            head_count=head,
            head_count_kv=max(kv_heads),
            key_length=key if isinstance(key, int) else embedding // head,
            value_length=value if isinstance(value, int) else embedding // head,
        )
    except ValueError as exc:
        raise GgufInvalid(f"the GGUF header's figures are out of bounds: {exc}") from None
