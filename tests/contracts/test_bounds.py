"""`bounds.declared_bytes`: a byte count another program declared in text (an S3 store's, a client's or
a remote registry's `Content-Length`), read without letting its value raise where it is read."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nexa.contracts.bounds import MAX_BYTES, declared_bytes


@pytest.mark.parametrize(("text", "count"), [("0", 0), ("1234", 1234), ("007", 7), (str(MAX_BYTES), MAX_BYTES)])
def test_ascii_digits_are_the_count(text: str, count: int) -> None:
    assert declared_bytes(text) == count


@pytest.mark.parametrize(
    "text",
    [
        None,
        "",
        "\u00b2",  # "²": str.isdigit() is true, int() refuses it
        "\u0663",  # ARABIC-INDIC DIGIT THREE: int() takes it, HTTP does not
        "-1",
        "+5",
        " 5",
        "5 ",
        "1e3",
        "1" * 5000,  # int() of this many digits raises ValueError
        str(MAX_BYTES + 1),
    ],
)
def test_anything_else_is_none(text: str | None) -> None:
    assert declared_bytes(text) is None


@given(st.text(max_size=40))
def test_it_never_raises(text: str) -> None:
    count = declared_bytes(text)
    assert count is None or (0 <= count <= MAX_BYTES and text.isascii() and text.isdigit())
