"""`nexa.contracts.groups`: a rank's part in a replica group, as the signed set carries it in
`RuntimeSpec.group`. What a node decodes from the wire is checked there (`codec.wire` → ContractError,
naming the problem); old sets without a group decode and hash exactly as before."""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest

from nexa import container_spec
from nexa.contracts import codec, wire
from nexa.contracts.groups import FabricAccess, GroupMember, GroupRole
from nexa.contracts.runtime import RuntimeSpec
from nexa.errors import ContractError
from tests.conftest import sample_runtime


def members(n: int = 2) -> list[dict[str, Any]]:
    return [{"rank": r, "node_id": f"spark-{r + 1}", "address": f"10.10.0.{r + 1}", "port": 50052} for r in range(n)]


def role_body(**changes: Any) -> dict[str, Any]:
    return {"group": "g-chat-0", "rank": 1, "members": members(), "fabric": "rdma"} | changes


def test_a_role_names_its_head_its_size_and_its_peers() -> None:
    role = codec.structure(codec.wire, role_body(), GroupRole)
    assert (role.size, role.is_head, role.fabric) == (2, False, FabricAccess.RDMA)
    assert role.head == GroupMember(rank=0, node_id="spark-1", address="10.10.0.1", port=50052)
    assert role.me.node_id == "spark-2" and [m.rank for m in role.others] == [0]
    head = attrs.evolve(role, rank=0)
    assert head.is_head and [m.node_id for m in head.others] == ["spark-2"]
    assert codec.structure(codec.wire, codec.wire.unstructure(role), GroupRole) == role
    # IPv6 fabrics too, in canonical form.
    v6 = role_body(members=[m | {"address": f"fd00::{m['rank'] + 1}"} for m in members()])
    assert codec.structure(codec.wire, v6, GroupRole).head.address == "fd00::1"


@pytest.mark.parametrize(
    ("changes", "problem"),
    [
        ({"members": members(1)}, "a group has 2 to 16 members, not 1"),
        ({"members": members(17)}, "a group has 2 to 16 members, not 17"),
        ({"members": list(reversed(members()))}, "ranks must be 0 to 1 in order, not [1, 0]"),
        ({"members": [m | {"rank": m["rank"] + 1} for m in members()]}, "ranks must be 0 to 1 in order"),
        ({"rank": 2}, "rank must be one of the members' ranks (0 to 1), not 2"),
        ({"rank": -1}, "rank must be one of the members' ranks"),
        ({"members": [m | {"node_id": "spark-1"} for m in members()]}, "a node id appears twice"),
        ({"members": [m | {"address": "spark-1.fabric"} for m in members()]}, "must be an IP address literal"),
        ({"members": [members()[0] | {"address": "0.0.0.0"}, members()[1]]}, "unicast IP address"),
        ({"members": [members()[0] | {"address": "010.10.0.1"}, members()[1]]}, "IP address"),
        ({"members": [members()[0] | {"address": "FD00::1"}, members()[1]]}, "canonical form"),
        ({"members": [members()[0] | {"port": 0}, members()[1]]}, "port must be a port from 1 to 65535"),
        ({"members": [members()[0] | {"port": 65536}, members()[1]]}, "port must be a port from 1 to 65535"),
        ({"members": [members()[0] | {"port": "50052"}, members()[1]]}, "expected an integer"),
        ({"fabric": "infiniband"}, "must be one of none, tcp, rdma"),
        ({"group": ""}, "group must be 1 to 128 printable characters"),
        ({"extra": 1}, "extra: unknown key"),
    ],
)
def test_a_bad_role_is_a_contract_error_naming_the_problem(changes: dict[str, Any], problem: str) -> None:
    with pytest.raises(ContractError) as caught:
        codec.structure(codec.wire, role_body(**changes), GroupRole)
    assert problem in str(caught.value)


def test_two_members_on_one_endpoint_are_refused() -> None:
    same = [m | {"node_id": f"n{m['rank']}", "address": "10.10.0.1"} for m in members()]
    with pytest.raises(ContractError, match="two members share a fabric address and port"):
        codec.structure(codec.wire, role_body(members=same), GroupRole)


def test_the_runtime_spec_carries_the_role_signed_and_old_sets_are_unchanged() -> None:
    runtime = sample_runtime()
    body = codec.wire.unstructure(runtime)
    # The last fields: groups, then LoRA adapters.
    assert body["group"] is None and list(body)[-3:] == ["group", "loras", "live_loras"]
    # A set signed before groups (no `group` key, nor `loras`) decodes to the same spec and hashes as before.
    del body["group"], body["loras"]
    old = codec.loads(codec.wire, json.dumps(body), RuntimeSpec)
    assert old == runtime and old.group is None
    # (tests/test_container_spec.py pins the digest of a spec without a group: unchanged.)
    before = container_spec.spec_sha256(old)
    # A rank's spec: the role travels with it (decoded strictly) and changes its digest.
    role = codec.structure(codec.wire, role_body(), GroupRole)
    ranked = attrs.evolve(runtime, group=role)
    set_ = wire.AssignmentSet(
        node_id="spark-2",
        epoch=1,
        generation=1,
        lease_expires_at=10.0,
        assignments=[wire.Assignment(id="a1", deployment="chat", runtime=ranked)],
    )
    again = codec.loads(codec.wire, codec.dumps(codec.wire, set_), wire.AssignmentSet)
    assert again.assignments[0].runtime.group == role
    assert container_spec.spec_sha256(ranked) != before
    bad = codec.wire.unstructure(ranked)
    bad["group"]["members"][1]["address"] = "fabric-host"
    with pytest.raises(ContractError, match="IP address literal"):
        codec.structure(codec.wire, bad, RuntimeSpec)
