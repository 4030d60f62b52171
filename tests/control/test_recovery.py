"""Recovery's pure parts: the plan a recovering controller shows (`recovery.plan`), which routes it
refuses, and the store's side (the restore marker, the epoch taken at the end, in one transaction)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from nexa.config import StoreConfig
from nexa.contracts.deployments import Deployment, PlacementSpec, Replica, Resources, RuntimeOptions
from nexa.contracts.domain import SYSTEM, Node, NodeAdminState, NodeId
from nexa.contracts.models import ModelRef
from nexa.contracts.wire import Assignment, AssignmentStatus, DesiredAssignments, RuntimeState
from nexa.control import store as st
from nexa.control.access.accounts import audit_draft
from nexa.control.fleet.nodes import NodeLive
from nexa.control.operations.recovery import plan, refused_while_recovering
from nexa.security import ReplayWindow
from tests.conftest import sample_runtime
from tests.support.postgres import pg_url_fixture, postgres_fixture, store_cfg_fixture  # noqa: F401

REF = ModelRef(model="tiny", version="v1")


def live(
    node_id: str,
    *,
    desired: list[str],
    running: list[str] | None = None,
    reported: tuple[int, int] = (0, 0),
    generation: int = 3,
    heard: bool = True,
    revoked: bool = False,
) -> NodeLive:
    node = Node(
        id=NodeId(node_id),
        hostname=node_id,
        signing_public_key="",
        curve_public_key=node_id,
        labels={},
        enrolled_at=0.0,
        admin_state=NodeAdminState.REVOKED if revoked else NodeAdminState.ACTIVE,
    )
    assignments = [Assignment(id=a, deployment=a.rpartition("-")[0], runtime=sample_runtime()) for a in desired]
    out = NodeLive(
        node=node,
        inventory=None,
        desired=DesiredAssignments(node_id=node_id, generation=generation, assignments=assignments),
        window=ReplayWindow(max_skew_s=30),
        last_seen=1.0 if heard else None,
        reachable=heard,
    )
    out.statuses = [AssignmentStatus(assignment_id=a, state=RuntimeState.READY) for a in running or []]
    out.reported_epoch, out.reported_generation = reported
    return out


def deployment(name: str, *replicas: tuple[str, str]) -> Deployment:
    now = time.time()
    return Deployment(
        name=name,
        runtime="sim",
        alias="chat",
        model=REF,
        replicas=len(replicas),
        resources=Resources(),
        options=RuntimeOptions(),
        placement=PlacementSpec(),
        created_at=now,
        created_by=None,
        updated_at=now,
        placed=[Replica(id=rid, node_id=node, gpus=[], model=REF) for rid, node in replicas],
    )


def test_outside_recovery_the_plan_is_empty() -> None:
    nodes = [live("n1", desired=["chat-a-1"], running=["chat-b-9"], reported=(9, 9))]
    out = plan(
        recovering=False, reason="", epoch=4, nodes=nodes, deployments=[deployment("chat-a", ("chat-a-1", "n1"))]
    )
    assert not out.recovering
    assert (out.epoch, out.next_epoch) == (4, 4)
    assert out.pushes == out.stops == out.replacements == out.unheard == []


def test_the_plan_signs_above_every_node_and_lists_what_changes() -> None:
    nodes = [
        # Runs the restored replica and one made after the backup; accepted a newer controller's epoch.
        live("n1", desired=["chat-a-1"], running=["chat-a-1", "chat-b-7"], reported=(7, 12)),
        # The restored state has a replica here the node no longer runs (deleted after the backup).
        live("n2", desired=["chat-a-2", "chat-c-3"], running=["chat-a-2"], reported=(5, 4), generation=6),
        live("n3", desired=["chat-a-3"], heard=False),  # away: nothing known of it
        live("n4", desired=[], heard=False, revoked=True),  # revoked: not waited for
    ]
    deps = [deployment("chat-a", ("chat-a-1", "n1"), ("chat-a-2", "n2"), ("chat-a-3", "n3"))]
    deps.append(deployment("chat-c", ("chat-c-3", "n2")))
    out = plan(recovering=True, reason="restored", epoch=3, nodes=nodes, deployments=deps)

    assert out.recovering and out.reason == "restored"
    assert (out.epoch, out.next_epoch) == (3, 8)  # above n1's 7, the highest accepted
    assert [
        (p.node_id, p.accepted_epoch, p.accepted_generation, p.epoch, p.generation, p.start) for p in out.pushes
    ] == [
        ("n1", 7, 12, 8, 3, []),
        ("n2", 5, 4, 8, 6, ["chat-c-3"]),
    ]
    assert [(s.node_id, s.assignment_id, s.deployment, s.state) for s in out.stops] == [
        ("n1", "chat-b-7", "chat-b", "Ready")
    ]
    assert [(r.deployment, r.replica_id, r.node_id) for r in out.replacements] == [("chat-a", "chat-a-3", "n3")]
    assert out.unheard == ["n3"]


def test_with_no_node_ahead_the_next_epoch_is_one_above_the_controllers() -> None:
    nodes = [live("n1", desired=["chat-a-1"], running=["chat-a-1"], reported=(2, 1))]
    out = plan(recovering=True, reason="forced", epoch=5, nodes=nodes, deployments=[])
    assert out.next_epoch == 6
    assert out.stops == [] and out.pushes[0].start == []


@pytest.mark.parametrize(
    ("method", "rule", "refused"),
    [
        ("GET", "/api/v1/deployments", False),
        ("HEAD", "/api/v1/nodes", False),
        ("POST", "/api/v1/deployments", True),
        ("DELETE", "/api/v1/keys/<key_id>", True),
        ("PUT", "/api/v1/quotas/<tenant>", True),
        ("POST", "/api/v1/enroll", True),
        ("POST", "/console/deployments/<name>/<action>", True),
        ("POST", "/api/v1/recovery/finish", False),
        ("POST", "/api/v1/audit/verify", False),
        ("POST", "/console/login", False),
    ],
)
def test_which_routes_a_recovering_controller_refuses(method: str, rule: str, refused: bool) -> None:
    assert refused_while_recovering(method, rule) is refused


async def test_ending_recovery_takes_an_epoch_above_and_drops_the_marker(
    tmp_path: Path, store_cfg: StoreConfig
) -> None:
    async with st.open_store(tmp_path / "state", store_cfg) as store:
        assert await store.run(st.recovery_marker) is None
        await store.run(_mark, "backup of 2025-01-01")
        assert await store.run(st.recovery_marker) == "backup of 2025-01-01"
        draft = audit_draft(SYSTEM, "recovery.finish", "controller")
        epoch, event = await store.run(st.end_recovery, 9, draft)
        assert epoch == 10 and event.action == "recovery.finish"
        assert await store.run(st.recovery_marker) is None
        # Above the stored epoch too, when no node is ahead of it.
        epoch, _ = await store.run(st.end_recovery, 0, draft)
        assert epoch == 11
    async with st.open_store(tmp_path / "state", store_cfg) as store:
        # The next start takes one more on SQLite; a shared store's opens take none (takeovers do).
        assert store.epoch == (11 if store_cfg.url else 12)


def _mark(db: object, value: str) -> None:
    db.execute("INSERT INTO meta(key, value) VALUES (?, ?)", (st.RECOVERY_MARKER, value))  # type: ignore[attr-defined]
