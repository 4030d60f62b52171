"""The one strict decoder, attacked: it refuses with ContractError, and raises nothing else.

Unit cases name each rule (NaN, integer bound, depth, sizes, duplicates, surrogates, UTF-8); the
hypothesis fuzzers throw arbitrary bytes, hostile JSON and mutated real messages at the body
decoder (`codec.parse_json`, `codec.loads`) and the frame decoders (`framing.decode_frames`,
`framing.decode_data`) and accept only a value or a ContractError (or BadSignature, for frames
whose signature does not verify).
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from typing import Any

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nexa import security
from nexa.channel import framing
from nexa.contracts import codec, wire
from nexa.contracts.bounds import MAX_TOKENS
from nexa.errors import BadSignature, ContractError
from tests.conftest import gb10_inventory

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
KEY = security.generate_signing_key()


def _heartbeat() -> wire.Heartbeat:
    return wire.Heartbeat(
        node_id="n1",
        seq=7,
        ts=time.time(),
        inventory=gb10_inventory("n1"),
        free_memory_bytes=1 << 30,
        free_accelerators=1,
        assignments=[wire.AssignmentStatus(assignment_id="a1", state=wire.RuntimeState.READY)],
    )


HEARTBEAT: dict[str, Any] = json.loads(codec.dumps(codec.wire, _heartbeat()))

# --- the rules, one by one ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("raw", "problem"),
    [
        (b'{"a":NaN}', "NaN is not a JSON number"),
        (b'{"a":-Infinity}', "-Infinity is not a JSON number"),
        (b'{"a":1e999}', "a number too large"),
        (b'{"a":' + b"9" * 5000 + b"}", "an integer beyond"),
        (b'{"a":9223372036854775808}', "an integer beyond"),
        (b"[" * 33 + b"]" * 33, "nested deeper than 32"),
        (b"[" * 100_000, "nested too deeply"),
        (b'"' + b"x" * (64 * 1024 + 1) + b'"', "a string longer than"),
        (b"[" + b",".join([b"0"] * 4097) + b"]", "an array of more than 4096"),
        (b'{"a":1,"a":2}', "duplicate key"),
        (b'"\\ud800"', "unpaired surrogate"),
        (b"\xff\xfe", "not UTF-8"),
        (b"{", "not valid JSON"),
    ],
    ids=[
        "nan",
        "infinity",
        "float-overflow",
        "5000-digits",
        "int64+1",
        "depth",
        "deeper-than-recursion",
        "long-string",
        "long-array",
        "duplicate-key",
        "surrogate",
        "not-utf8",
        "truncated",
    ],
)
def test_each_rule_is_a_contract_error(raw: bytes, problem: str) -> None:
    with pytest.raises(ContractError, match=problem):
        codec.parse_json(raw, codec.WIRE_LIMITS)


def test_the_largest_allowed_values_pass() -> None:
    data = codec.parse_json(b'{"a":9223372036854775807,"b":-9223372036854775807,"c":1.5e308,"d":"\\ud83d\\ude00"}')
    assert data == {"a": 2**63 - 1, "b": -(2**63 - 1), "c": 1.5e308, "d": "\U0001f600"}
    assert codec.parse_json(b"[" * 32 + b"]" * 32, codec.WIRE_LIMITS) is not None


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("prompt_tokens", MAX_TOKENS + 1),
        ("prompt_tokens", -1),
        ("completion_tokens", 2**63 - 1),
        ("runtime_ms", -0.5),
        ("http_status", 1000),
    ],
)
def test_end_head_numbers_are_range_checked_at_decode(field: str, value: object) -> None:
    raw = json.dumps({"status": "ok", field: value}).encode()
    with pytest.raises(ContractError, match=field):
        codec.loads(codec.wire, raw, wire.EndHead)
    ok = codec.loads(codec.wire, json.dumps({"status": "ok", "prompt_tokens": MAX_TOKENS}).encode(), wire.EndHead)
    assert ok.prompt_tokens == MAX_TOKENS


@pytest.mark.parametrize(
    ("path", "value"),
    [
        (("inventory", "gpus", 0, "utilization_pct"), 101.0),
        (("inventory", "gpus", 0, "temperature_c"), 1e6),
        (("inventory", "gpus", 0, "power_draw_w"), -1.0),
        (("inventory", "gpus", 0, "memory_used_bytes"), -5),
        (("inventory", "memory_available_bytes"), 2**62 + 1),
        (("inventory", "discovered_at"), -1.0),
        (("free_accelerators",), 10**6),
        (("ts",), -1.0),
        (("assignments", 0, "restarts"), -1),
    ],
)
def test_heartbeat_figures_are_range_checked_at_decode(path: tuple[Any, ...], value: object) -> None:
    data = json.loads(json.dumps(HEARTBEAT))
    target = data
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    with pytest.raises(ContractError, match=str(path[-1])):
        codec.loads(codec.wire, json.dumps(data).encode(), wire.Heartbeat)


def test_a_heartbeat_with_nan_never_gets_past_the_decoder() -> None:
    body = re.sub(r'"utilization_pct":[^,}]+', '"utilization_pct":NaN', codec.dumps(codec.wire, _heartbeat()))
    assert "NaN" in body
    frames = [b"heartbeat", body.encode(), security.sign(KEY, b"heartbeat", body.encode())]
    with pytest.raises(ContractError, match="NaN"):
        framing.decode_frames(frames, KEY.public, wire.FROM_NODE)


# --- fuzzing ------------------------------------------------------------------------------------

_EXTREME = st.sampled_from(
    ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", "9" * 30, "9" * 5000, "-0", "1E+2", '"\\ud800"', "[]", "{}"]
)
_SCALAR = st.one_of(
    st.integers(min_value=-(2**70), max_value=2**70).map(str),
    st.floats(allow_nan=False, allow_infinity=False).map(repr),
    st.text(max_size=20).map(json.dumps),
    st.sampled_from(["true", "false", "null"]),
    _EXTREME,
)


def _join_list(items: list[str]) -> str:
    return "[" + ",".join(items) + "]"


def _join_object(pairs: list[tuple[str, str]]) -> str:
    return "{" + ",".join(f"{json.dumps(k)}:{v}" for k, v in pairs) + "}"


#: JSON-looking text with hostile pieces anywhere in it (also invalid JSON, now and then).
HOSTILE_JSON = st.recursive(
    _SCALAR,
    lambda inner: st.one_of(
        st.lists(inner, max_size=5).map(_join_list),
        st.lists(st.tuples(st.text(max_size=8), inner), max_size=5).map(_join_object),
        st.tuples(st.integers(min_value=1, max_value=3000), inner).map(lambda t: "[" * t[0] + t[1] + "]" * t[0]),
    ),
    max_leaves=30,
)

WIRE_TYPES = [wire.Hello, wire.Heartbeat, wire.Ack, wire.AssignmentSet, wire.EndHead, wire.InferHead, wire.CreditHead]


def _only_contract_errors(fn: Any, *args: Any) -> None:
    with contextlib.suppress(ContractError):
        fn(*args)


@FUZZ
@given(st.binary(max_size=512))
def test_arbitrary_bytes_raise_only_contract_errors(raw: bytes) -> None:
    _only_contract_errors(codec.parse_json, raw)
    for cls in WIRE_TYPES:
        _only_contract_errors(codec.loads, codec.wire, raw, cls)


@pytest.mark.slow
@FUZZ
@given(HOSTILE_JSON, st.sampled_from(WIRE_TYPES))
def test_hostile_json_raises_only_contract_errors(text: str, cls: type) -> None:
    _only_contract_errors(codec.parse_json, text.encode("utf-8", "surrogatepass"))
    _only_contract_errors(codec.loads, codec.wire, text.encode("utf-8", "surrogatepass"), cls)
    _only_contract_errors(codec.loads, codec.api, text, dict[str, object])


def _paths(value: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, (*prefix, i))
    return out


HEARTBEAT_PATHS = [p for p in _paths(HEARTBEAT) if p]


@FUZZ
@given(st.lists(st.tuples(st.sampled_from(HEARTBEAT_PATHS), HOSTILE_JSON), min_size=1, max_size=4))
def test_a_signed_heartbeat_with_hostile_values_is_refused_only_with_contract_errors(
    edits: list[tuple[tuple[Any, ...], str]],
) -> None:
    """A node that signs what it sends (it has its key) still cannot make decoding raise anything else."""
    data = json.loads(json.dumps(HEARTBEAT))
    applied: list[tuple[str, str]] = []
    for i, (path, replacement) in enumerate(edits):
        target = data
        try:
            for step in path[:-1]:
                target = target[step]
            target[path[-1]] = marker = f"\x00MARK{i}\x00"
        except (KeyError, IndexError, TypeError):
            continue  # an earlier edit replaced what held that path
        applied.append((json.dumps(marker), replacement))
    text = json.dumps(data)
    for marker_json, replacement in applied:
        text = text.replace(marker_json, replacement)
    body = text.encode("utf-8", "surrogatepass")
    frames = [b"heartbeat", body, security.sign(KEY, b"heartbeat", body)]
    try:
        msg = framing.decode_frames(frames, KEY.public, wire.FROM_NODE)
    except ContractError:
        return
    assert isinstance(msg, wire.Heartbeat)
    codec.dumps(codec.store, msg.inventory)  # what the store would write: no NaN, no overflow


@FUZZ
@given(st.lists(st.binary(max_size=64), max_size=6))
def test_frame_decoders_raise_only_contract_errors_or_bad_signature(frames: list[bytes]) -> None:
    with contextlib.suppress(ContractError, BadSignature):
        framing.decode_frames(frames, KEY.public, wire.FROM_NODE)
    _only_contract_errors(framing.decode_data, frames, wire.DATA_FROM_NODE)
    if len(frames) == 4:
        _only_contract_errors(framing.decode_data, [b"end", *frames[1:]], wire.DATA_FROM_NODE)


@FUZZ
@given(st.sampled_from(sorted(wire.FROM_NODE)), HOSTILE_JSON)
def test_signed_bodies_of_every_kind_raise_only_contract_errors(kind: str, text: str) -> None:
    body = text.encode("utf-8", "surrogatepass")
    frames = [kind.encode(), body, security.sign(KEY, kind.encode(), body)]
    _only_contract_errors(framing.decode_frames, frames, KEY.public, wire.FROM_NODE)


def test_decoded_contracts_are_plain_values() -> None:
    """What the decoder accepts round-trips through the canonical encoding unchanged."""
    msg = codec.loads(codec.wire, json.dumps(HEARTBEAT).encode(), wire.Heartbeat)
    assert attrs.asdict(msg) == attrs.asdict(codec.loads(codec.wire, codec.dumps(codec.wire, msg), wire.Heartbeat))
