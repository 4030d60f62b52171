"""How the operator commands print: tables of cells, `--json`, sizes and times, the next cursor."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TextIO

from nexa.contracts import codec
from nexa.contracts.models import ModelRef
from nexa.contracts.text import visible_text

#: One table row: column name -> value (None prints as `-`, Unix times as UTC).
Cells = Mapping[str, object]


class _TerminalSafe:
    """A text stream that writes `visible_text` of everything to the stream it wraps."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream

    def write(self, text: str) -> int:
        self._stream.write(visible_text(text))
        return len(text)

    def __getattr__(self, name: str) -> object:
        return getattr(self._stream, name)  # flush, isatty, fileno, encoding, ...


@contextmanager
def terminal_safe_stdout() -> Iterator[None]:
    """While inside: whatever a command prints shows control characters escaped, whoever chose
    them (a client's tenant name, a node's hostname or label, a runtime's problem text)."""
    original = sys.stdout
    sys.stdout = _TerminalSafe(original)
    try:
        yield
    finally:
        sys.stdout = original


def print_json(value: object) -> None:
    """A contract value as the controller sent it: its JSON, indented, keys sorted."""
    print(json.dumps(codec.api.unstructure(value), indent=2, sort_keys=True))


def emit(args: argparse.Namespace, value: object, rows: Sequence[Cells], columns: Sequence[str]) -> None:
    """`--json`: the answer itself; otherwise a table of `rows`."""
    if args.json:
        print_json(value)
        return
    print(table(rows, columns))


def table(rows: Sequence[Cells], columns: Sequence[str]) -> str:
    cells = [[cell(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    if not rows:
        lines.append("(none)")
    return "\n".join(lines)


def cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and value > 1e9:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(value))
    return str(value)


def print_more(cursor: str | None) -> None:
    """The flag that shows the next page, on stderr (stdout stays the table)."""
    if cursor is not None:
        print(f"more: --cursor {cursor}", file=sys.stderr)


def gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.1f} GiB"


def size_text(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, factor in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= factor:
            return f"{n / factor:.1f} {unit}"
    return f"{n} B"


def ref(model: ModelRef | None) -> str:
    return "-" if model is None else f"{model.model}@{model.version}"
