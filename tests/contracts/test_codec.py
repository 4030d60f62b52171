"""The codec: strict structuring (no coercion), unknown keys named, one canonical encoding."""

from __future__ import annotations

import attrs
import pytest

from nexa.contracts import codec
from nexa.contracts.api import KeyCreate
from nexa.contracts.domain import Role
from nexa.errors import ContractError


@attrs.frozen(kw_only=True)
class Sample:
    count: int
    ratio: float = 0.5
    flag: bool = False
    names: list[str] = attrs.field(factory=list)
    tags: tuple[str, ...] = ()
    role: Role = Role.OPERATOR


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        ({"count": True}, "count: expected an integer, got bool"),
        ({"count": "3"}, "count: expected an integer, got str"),
        ({"count": 1, "ratio": "0.5"}, "ratio: expected a number, got str"),
        ({"count": 1, "flag": 1}, "flag: expected true or false, got int"),
        ({"count": 1, "names": "abc"}, "names: expected a list, got str"),
        ({"count": 1, "tags": "abc"}, "tags: expected a list, got str"),
        ({"count": 1, "names": [1]}, "names[0]: expected a string, got int"),
        (
            {"count": 1, "role": "root"},
            "role: must be one of admin, operator, inference, audit, monitoring, retention-reader",
        ),
        ({"count": 1, "extra": 2}, "extra: unknown key"),
        ({}, "count: required key is missing"),
    ],
)
def test_no_coercion_and_every_problem_named(data: dict[str, object], problem: str) -> None:
    with pytest.raises(ContractError) as info:
        codec.structure(codec.api, data, Sample)
    assert problem in info.value.problems


def test_all_problems_at_once() -> None:
    with pytest.raises(ContractError) as info:
        codec.structure(codec.api, {"count": "x", "flag": "y", "zzz": 1}, Sample)
    assert len(info.value.problems) == 3


def test_valid_data_round_trips_in_canonical_form() -> None:
    obj = codec.structure(codec.api, {"count": 2, "ratio": 1, "names": ["b", "a"], "role": "audit"}, Sample)
    assert obj == Sample(count=2, ratio=1.0, names=["b", "a"], role=Role.AUDIT)
    text = codec.dumps(codec.api, obj)
    assert text == '{"count":2,"flag":false,"names":["b","a"],"ratio":1.0,"role":"audit","tags":[]}'
    assert codec.loads(codec.api, text, Sample) == obj


def test_digest_is_stable_and_none_means_no_state() -> None:
    a = KeyCreate(role=Role.ADMIN, name="x")
    assert codec.sha256_of(codec.api, a) == codec.sha256_of(codec.api, KeyCreate(role=Role.ADMIN, name="x"))
    assert codec.sha256_of(codec.api, a) != codec.sha256_of(codec.api, KeyCreate(role=Role.ADMIN, name="y"))
    assert codec.sha256_of(codec.api, None) is None


def test_bad_json_is_a_contract_error() -> None:
    with pytest.raises(ContractError, match="not valid JSON"):
        codec.loads(codec.api, b"{", Sample)
    with pytest.raises(ContractError, match="expected a JSON object"):
        codec.loads(codec.api, b"[]", Sample)
