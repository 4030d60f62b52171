"""The data path's head codec (`contracts.heads`): the same JSON as `codec.wire_sent` both ways (peers
of either codec read each other), and hostile bytes end in ContractError, never in anything else."""

from __future__ import annotations

import contextlib
import json
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nexa.contracts import codec, heads, wire
from nexa.contracts.bounds import MAX_TOKENS
from nexa.errors import ContractError

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

HEADS: list[Any] = [
    wire.InferHead(
        assignment_id="r-1",
        path="/v1/chat/completions",
        stream=True,
        deadline_at=1.8e9,
        window=64,
        strip_usage_chunk=True,
        prompt_tokens_estimate=12,
    ),
    wire.InferHead(assignment_id="r-é", path="/v1/embeddings", stream=False, deadline_at=0, window=1),
    wire.InferHead(
        assignment_id="r-2",
        path="/v1/responses/resp_1",
        method=wire.RuntimeMethod.GET,
        stream=False,
        deadline_at=1,
        window=4,
    ),
    wire.EndHead(
        status=wire.EndStatus.OK,
        http_status=200,
        prompt_tokens=MAX_TOKENS,
        completion_tokens=0,
        runtime_ms=1.25,
        overhead_ms=0.3,
        first_byte_sent=True,
    ),
    wire.EndHead(
        status=wire.EndStatus.ERROR, code="runtime_rejected", http_status=400, message="bad “input” \U0001f600"
    ),
    wire.EndHead(status=wire.EndStatus.CANCELLED),
    wire.ChunkHead(overhead_ms=0.5),
    wire.ChunkHead(),
    wire.CancelHead(reason="the client went away"),
    wire.CreditHead(chunks=32),
]
KINDS = [wire.InferHead, wire.EndHead, wire.ChunkHead, wire.CancelHead, wire.CreditHead]


@pytest.mark.parametrize("head", HEADS, ids=lambda h: type(h).__name__)
def test_a_head_round_trips_and_is_the_json_codec_wire_writes_and_reads(head: Any) -> None:
    raw = heads.encode(head)
    assert raw == codec.dumps(codec.wire_sent, head).encode()  # byte for byte: a peer of either codec reads it
    assert heads.decode(raw, type(head)) == head
    assert codec.loads(codec.wire, raw, type(head)) == head
    # A head an older peer wrote in full, its defaults included, reads the same.
    assert heads.decode(codec.dumps(codec.wire, head).encode(), type(head)) == head


def test_a_head_an_older_peer_wrote_with_spaces_or_in_another_key_order_is_read() -> None:
    raw = b'{ "status": "error", "code": "node_busy", "http_status": 503 }'
    assert heads.decode(raw, wire.EndHead) == wire.EndHead(
        status=wire.EndStatus.ERROR, code="node_busy", http_status=503
    )
    assert heads.decode(b'{"overhead_ms": 2}', wire.ChunkHead) == wire.ChunkHead(overhead_ms=2.0)


@pytest.mark.parametrize(
    ("raw", "cls"),
    [
        (b'{"status":"ok","prompt_tokens":9223372036854775807}', wire.EndHead),
        (b'{"status":"ok","completion_tokens":-1}', wire.EndHead),
        (b'{"status":"ok","prompt_tokens":2147483649}', wire.EndHead),
        (b'{"status":"ok","runtime_ms":1e999}', wire.EndHead),
        (b'{"status":"ok","runtime_ms":NaN}', wire.EndHead),
        (b'{"status":"ok","runtime_ms":-Infinity}', wire.EndHead),
        (b'{"status":"ok","http_status":' + b"9" * 5000 + b"}", wire.EndHead),
        (b'{"status":"ok","http_status":true}', wire.EndHead),
        (b'{"status":"ok","http_status":"200"}', wire.EndHead),
        (b'{"status":"fine"}', wire.EndHead),
        (b'{"status":"ok","extra":1}', wire.EndHead),
        (b'{"status":"ok","message":"\\ud800"}', wire.EndHead),
        (b'{"status":"ok","message":"\xff"}', wire.EndHead),
        (b'{"status":"ok","message":"' + b"a" * (codec.WIRE_LIMITS.max_string_chars + 1) + b'"}', wire.EndHead),
        (b'{"code":null}', wire.EndHead),
        (b"[" * 100_000, wire.EndHead),
        (b'{"status":"ok"', wire.EndHead),
        (b"", wire.EndHead),
        (b"null", wire.ChunkHead),
        (b'{"overhead_ms":"1"}', wire.ChunkHead),
        (b'{"chunks":1.5}', wire.CreditHead),
        (b'{"chunks":-1}', wire.CreditHead),
        (b'{"chunks":' + str(wire.MAX_WINDOW + 1).encode() + b"}", wire.CreditHead),
        (b'{"reason":7}', wire.CancelHead),
        (b'{"assignment_id":"a","path":"/v1/x","stream":true,"deadline_at":1,"window":0}', wire.InferHead),
        (b'{"assignment_id":"a","path":"/v1/x","stream":1,"deadline_at":1,"window":4}', wire.InferHead),
        (b'{"assignment_id":"a","path":"/v1/x","stream":true,"deadline_at":-1,"window":4}', wire.InferHead),
        (b'{"assignment_id":"a","path":"/v1/x","stream":true,"window":4}', wire.InferHead),
        (
            b'{"assignment_id":"a","path":"/v1/x","stream":false,"deadline_at":1,"window":4,"method":"PUT"}',
            wire.InferHead,
        ),
        (
            b'{"assignment_id":"a","path":"/v1/x","stream":false,"deadline_at":1,"window":4,"method":"get"}',
            wire.InferHead,
        ),
    ],
)
def test_a_hostile_head_is_a_contract_error_as_the_strict_decoder_says(raw: bytes, cls: type[Any]) -> None:
    with pytest.raises(ContractError):
        heads.decode(raw, cls)
    with pytest.raises(ContractError):  # the same verdict as codec.wire's
        codec.loads(codec.wire, raw, cls)


def test_a_duplicate_key_is_read_as_its_last_value() -> None:
    """The one relaxation against the strict decoder (the module docstring says it)."""
    assert heads.decode(b'{"chunks":1,"chunks":2}', wire.CreditHead) == wire.CreditHead(chunks=2)


@FUZZ
@given(raw=st.binary(max_size=300), cls=st.sampled_from(KINDS))
def test_arbitrary_bytes_decode_or_raise_contract_error(raw: bytes, cls: type[Any]) -> None:
    with contextlib.suppress(ContractError):
        heads.decode(raw, cls)


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@FUZZ
@given(head=st.sampled_from(HEADS), field=st.integers(min_value=0, max_value=8), value=_JSON)
def test_a_real_head_with_one_field_changed_decodes_to_a_valid_record_or_raises_contract_error(
    head: Any, field: int, value: object
) -> None:
    obj = json.loads(codec.dumps(codec.wire, head))  # every field written, its defaults too
    name = sorted(obj)[field % len(obj)]
    obj[name] = value
    raw = json.dumps(obj).encode()  # NaN and Infinity included, as a hostile node could write them
    try:
        decoded = heads.decode(raw, type(head))
    except ContractError:
        return
    assert codec.loads(codec.wire, heads.encode(decoded), type(head)) == decoded
