"""The supervisor against in-memory podman and artifact-cache fakes, in virtual time.

Policy: every test runs under `autojump_clock` and asserts in virtual seconds; no threads and no
real podman here (the podman client's own tests run the real one). The fakes (tests/support/supervisor.py)
implement the supervisor's `ContainerDriver` and `Artifacts` protocols and record every call that changes something.
"""

from __future__ import annotations

import itertools
import logging
from pathlib import Path

import attrs
import pytest
import trio
import trio.testing

from nexa import container_spec
from nexa.config import Seconds
from nexa.contracts import wire
from nexa.contracts.groups import FabricAccess, GroupMember, GroupRole
from nexa.contracts.node import RuntimeKind
from nexa.contracts.runtime import LABEL_ASSIGNMENT, LABEL_GENERATION, LABEL_SPEC, RuntimeSpec
from nexa.errors import RuntimeCacheNoRoom
from nexa.node.firewall import Closed, FabricFirewall, FirewallError
from nexa.node.rdma import rdma_device_nodes
from nexa.node.replicas import Backoff
from nexa.node.supervisor import ORPHAN_STOP_TIMEOUT_S, TEARDOWN_GRACE_S, Supervisor
from nexa.supervision import Supervision
from tests.support.supervisor import (
    CFG,
    IMAGE,
    NODE,
    PROBE,
    SHA,
    FakeArtifacts,
    FakePodman,
    assignment,
    runtime,
    start,
    status,
    wait_for,
)

S = wire.RuntimeState
OTHER_DIGEST = "sha256:" + "f" * 64


@pytest.fixture
def podman() -> FakePodman:
    return FakePodman(registry={IMAGE})


@pytest.fixture
def artifacts() -> FakeArtifacts:
    return FakeArtifacts()


# --- the value objects --------------------------------------------------------------------------


def test_backoff_doubles_up_to_its_cap() -> None:
    b = Backoff(initial_s=1.0, max_s=60.0)
    delays = []
    for _ in range(10):
        delays.append(b.delay_s)
        b = b.next()
    assert delays == [1, 2, 4, 8, 16, 32, 60, 60, 60, 60]
    assert b.next() is b  # capped: no more state to change
    assert Backoff(initial_s=1.0, max_s=60.0).delay_s == 1.0  # next() never changed the original


# --- start, readiness, identity -----------------------------------------------------------------


async def test_missing_runtime_is_pulled_fetched_started_and_ready_once_the_probe_passes(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, podman: FakePodman, artifacts: FakeArtifacts
) -> None:
    podman.pull_gate, artifacts.fetch_gate, podman.healthy = trio.Event(), trio.Event(), False
    sup = Supervisor(CFG, podman, artifacts, node_id=NODE)
    sup.update(1, [assignment()])
    assert sup.statuses() == [wire.AssignmentStatus(assignment_id="a1", state=S.PENDING)]
    t0 = trio.current_time()
    await nursery.start(sup.run)
    await trio.testing.wait_all_tasks_blocked()
    assert status(sup).state == S.PULLING
    podman.pull_gate.set()
    await trio.testing.wait_all_tasks_blocked()
    assert status(sup).state == S.FETCHING
    artifacts.fetch_gate.set()
    await trio.testing.wait_all_tasks_blocked()
    assert status(sup).state == S.STARTING
    c = podman.only()
    assert podman.mutations() == [("pull", IMAGE), ("create", "nexa-a1"), ("start", c.id)]
    assert c.spec.labels[LABEL_ASSIGNMENT] == "a1"
    assert c.spec.labels[LABEL_SPEC] == container_spec.spec_sha256(runtime())
    assert c.spec.labels[container_spec.LABEL_NODE] == NODE
    assert c.spec.ro_mounts == [(f"/var/cache/nexa/artifacts/{SHA}", "/models/model")]
    # Running, right image, right labels, but the probe fails: not Ready (still in the start period).
    await trio.sleep(8)
    assert status(sup).state == S.STARTING
    podman.healthy = True
    ready_at = await wait_for(sup, S.READY)
    assert ready_at - t0 <= 8 + PROBE.interval_s + 0.05
    # Pinned before the fetch: no other fetch may evict what this replica is about to use.
    assert artifacts.calls == [("pin", SHA), ("fetch", SHA)]
    assert sup.statuses() == [wire.AssignmentStatus(assignment_id="a1", state=S.READY)]


async def test_a_present_image_is_not_pulled(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, podman: FakePodman, artifacts: FakeArtifacts
) -> None:
    podman.images.add(IMAGE)
    sup = await start(nursery, podman, artifacts, assignment())
    await wait_for(sup, S.READY)
    assert podman.mutations("pull") == []
    assert sup.statistics().pulls == 0


@pytest.mark.parametrize(
    "reported",
    [
        pytest.param(("127.0.0.1:5000/nexa/other@" + OTHER_DIGEST, OTHER_DIGEST), id="substituted"),
        pytest.param((IMAGE, OTHER_DIGEST), id="assigned-name-other-digest"),
    ],
)
async def test_a_wrong_digest_in_inspect_fails_and_removes_the_container(
    autojump_clock: trio.testing.MockClock,
    nursery: trio.Nursery,
    podman: FakePodman,
    artifacts: FakeArtifacts,
    reported: tuple[str, str],
) -> None:
    podman.reported_image = reported
    sup = await start(nursery, podman, artifacts, assignment())
    await wait_for(sup, S.FAILED, "digest_mismatch")
    s = status(sup)
    assert OTHER_DIGEST in s.detail
    assert container_spec.image_digest(IMAGE) in s.detail
    (created,) = podman.mutations("start")
    assert podman.mutations("remove") == [("remove", created[1], True)]
    assert podman.containers == {}
    # It keeps failing the same way, slowly, and is never Ready.
    for _ in range(40):
        await trio.sleep(5)
        assert status(sup).state != S.READY


# --- crashes ------------------------------------------------------------------------------------


async def test_crashed_runtime_restarts_with_capped_exponential_backoff(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, podman: FakePodman, artifacts: FakeArtifacts
) -> None:
    podman.crash_on_start = True
    cfg = attrs.evolve(CFG, restart_backoff_max_s=Seconds(8.0), crash_loop_restarts=1000)
    sup = await start(nursery, podman, artifacts, assignment(), cfg=cfg)
    await trio.sleep(100)
    delays = [b - a for a, b in itertools.pairwise(podman.start_times)]
    # Starts at 0, 1, 3, 7, 15, 23, …, 95 virtual seconds.
    assert delays == [1, 2, 4] + [8] * 11
    assert len(podman.mutations("create")) == 1  # restarts start the same container again
    s = status(sup)
    assert (s.state, s.reason, s.restarts) == (S.STARTING, None, 14)
    assert "exited with code 1" in s.detail
    assert sup.statistics().restarts == 14


async def test_a_ready_runtime_that_exits_127_is_restarted_not_taken_for_a_missing_program(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, podman: FakePodman, artifacts: FakeArtifacts
) -> None:
    """127 is "command not found" only before the runtime was ever Ready (tests/node/test_entrypoints.py
    has the real missing programs); later it is a crash like any other."""
    sup = await start(nursery, podman, artifacts, assignment())
    await wait_for(sup, S.READY)
    podman.crash(podman.only().id, code=127)
    with trio.fail_after(100):
        while status(sup).restarts < 1:  # noqa: ASYNC110 - polling the supervisor in virtual time
            await trio.sleep(0.05)
    await wait_for(sup, S.READY)
    assert status(sup).restarts == 1


async def test_crash_loop_is_reported_and_retried_at_the_maximum_backoff(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, podman: FakePodman, artifacts: FakeArtifacts
) -> None:
    podman.crash_on_start = True
    cfg = attrs.evolve(
        CFG, restart_backoff_max_s=Seconds(8.0), crash_loop_restarts=3, crash_loop_window_s=Seconds(60.0)
    )
    sup = await start(nursery, podman, artifacts, assignment(), cfg=cfg)
    await trio.sleep(30)
    delays = [b - a for a, b in itertools.pairwise(podman.start_times)]
    # Crashes at 0 and 1 back off 1 s then 2 s; the third (at 3) is a crash loop: 8 s from then on.
    assert delays == [1, 2, 8, 8, 8]
    s = status(sup)
    assert (s.state, s.reason, s.restarts) == (S.FAILED, "crash_loop", 5)
    # Sticky through the restarts, until the runtime is Ready again.
    podman.crash_on_start = False
    ready_at = await wait_for(sup, S.READY)
    assert ready_at <= podman.start_times[-1] + 0.05
    assert status(sup).restarts == 6
    # Long after the window, a new crash starts the backoff over.
    await trio.sleep(120)
    podman.crash(podman.only().id)
    await trio.sleep(PROBE.interval_s)
    s = status(sup)
    assert (s.state, s.reason) == (S.STARTING, None)
    assert s.detail == "exited with code 137; restarting in 1 s"


async def test_a_vanished_container_is_recreated(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, podman: FakePodman, artifacts: FakeArtifacts
) -> None:
    sup = await start(nursery, podman, artifacts, assignment())
    await wait_for(sup, S.READY)
    podman.containers.clear()
    await trio.sleep(PROBE.interval_s + CFG.restart_backoff_initial_s)
    await wait_for(sup, S.READY)
    assert len(podman.mutations("create")) == 2
    assert status(sup).restarts == 1


# --- adoption, replacement, orphans, removal ----------------------------------------------------


async def test_a_restarted_agent_adopts_running_containers_without_restarting_them(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, podman: FakePodman, artifacts: FakeArtifacts
) -> None:
    async with trio.open_nursery() as first_agent:
        sup1 = await start(first_agent, podman, artifacts, assignment())
        await wait_for(sup1, S.READY)
        first_agent.cancel_scope.cancel()
    c = podman.only()
    started_at = c.started_at
    # Cancelling the supervisor (the agent stopping) leaves the runtime running.
    assert c.running
    assert podman.mutations("stop", "remove") == []
    assert ("unpin", SHA) not in artifacts.calls
    podman.calls.clear()

    sup2 = await start(nursery, podman, artifacts, assignment())
    await wait_for(sup2, S.READY)
    assert podman.mutations() == []
    assert podman.only().started_at == started_at
    stats = sup2.statistics()
    assert (stats.adopted, stats.created) == (1, 0)
    assert artifacts.calls[-2:] == [("pin", SHA), ("fetch", SHA)]


async def test_an_adopted_container_with_a_stale_spec_is_replaced(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, podman: FakePodman, artifacts: FakeArtifacts
) -> None:
    podman.images.add(IMAGE)
    old = podman.add(container_spec.container_spec(NODE, assignment(command=["old"]), 1, Path("/x")))
    sup = await start(nursery, podman, artifacts, assignment())
    await wait_for(sup, S.READY)
    new = podman.only()
    assert new.id != old.id
    assert podman.mutations("stop", "remove") == [("stop", old.id, 30.0), ("remove", old.id, True)]


async def test_a_changed_spec_replaces_the_container(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, podman: FakePodman, artifacts: FakeArtifacts
) -> None:
    sup = await start(nursery, podman, artifacts, assignment())
    await wait_for(sup, S.READY)
    old = podman.only()
    podman.calls.clear()
    sup.update(2, [assignment(command=["python3", "-m", "llama_cpp.server", "--n_ctx", "4096"])])
    await trio.testing.wait_all_tasks_blocked()
    await wait_for(sup, S.READY)
    new = podman.only()
    assert new.id != old.id
    assert new.spec.command[-1] == "4096"
    assert new.spec.labels[LABEL_GENERATION] == "2"
    assert new.spec.labels[LABEL_SPEC] != old.spec.labels[LABEL_SPEC]
    # Break before make: same name and port, so the old one is gone before the new one exists.
    assert podman.mutations() == [
        ("stop", old.id, 30.0),
        ("remove", old.id, True),
        ("create", "nexa-a1"),
        ("start", new.id),
    ]
    # The same artifact stays pinned throughout: never unpinned, never evicted.
    assert artifacts.calls.count(("pin", SHA)) == 1
    assert ("unpin", SHA) not in artifacts.calls
    # An unchanged set at a newer generation changes nothing.
    podman.calls.clear()
    sup.update(3, [assignment(command=["python3", "-m", "llama_cpp.server", "--n_ctx", "4096"])])
    await trio.sleep(CFG.reconcile_interval_s * 2)
    assert podman.mutations() == []


async def test_orphans_are_removed_once_the_desired_set_is_known(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, podman: FakePodman, artifacts: FakeArtifacts
) -> None:
    podman.images.add(IMAGE)
    ghost = podman.add(container_spec.container_spec(NODE, assignment("ghost"), 1, Path("/x")))
    other_node = podman.add(container_spec.container_spec("n2", assignment("b1"), 1, Path("/x")))
    not_ours = podman.add(attrs.evolve(ghost.spec, name="postgres", labels={"app": "db"}))
    sup = Supervisor(CFG, podman, artifacts, node_id=NODE)
    await nursery.start(sup.run)
    # Until the agent hands over the accepted set, a container cannot be told to be an orphan.
    await trio.sleep(CFG.reconcile_interval_s * 3)
    assert podman.mutations() == []
    sup.update(1, [assignment()])
    await wait_for(sup, S.READY)
    assert ("stop", ghost.id, ORPHAN_STOP_TIMEOUT_S) in podman.calls
    assert ("remove", ghost.id, True) in podman.calls
    assert set(podman.containers) == {other_node.id, not_ours.id, podman.mutations("start")[0][1]}
    assert sup.statistics().orphans_removed == 1


async def test_a_removed_assignment_is_stopped_gracefully_then_removed_and_its_artifact_released(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, podman: FakePodman, artifacts: FakeArtifacts
) -> None:
    sup = await start(nursery, podman, artifacts, assignment(stop_timeout_s=20.0))
    await wait_for(sup, S.READY)
    c = podman.only()
    podman.calls.clear()
    podman.stop_delay_s = 5.0  # the runtime drains for 5 s after SIGTERM
    sup.update(2, [])
    stopping = [wire.AssignmentStatus(assignment_id="a1", state=S.STOPPED, detail="stopping")]
    assert sup.statuses() == stopping  # at once, before the reconcile loop has run
    await trio.testing.wait_all_tasks_blocked()
    assert sup.statuses() == stopping
    assert podman.mutations() == [("stop", c.id, 20.0)]
    assert sup.statistics().stopping == 1
    await trio.sleep(5.01)
    assert podman.mutations() == [("stop", c.id, 20.0), ("remove", c.id, True)]
    assert podman.containers == {}
    assert sup.statuses() == []
    assert artifacts.calls[-4:] == [("pin", SHA), ("fetch", SHA), ("unpin", SHA), ("evict",)]
    stats = sup.statistics()
    assert (stats.assignments, stats.stopping, stats.removed) == (0, 0, 1)


async def test_an_assignment_readded_while_its_container_stops_waits_for_it(
    autojump_clock: trio.testing.MockClock,
    nursery: trio.Nursery,
    podman: FakePodman,
    artifacts: FakeArtifacts,
    caplog: pytest.LogCaptureFixture,
) -> None:
    sup = await start(nursery, podman, artifacts, assignment())
    await wait_for(sup, S.READY)
    old = podman.only()
    podman.stop_delay_s = 5.0
    sup.update(2, [])
    await trio.testing.wait_all_tasks_blocked()
    sup.update(3, [assignment()])  # back before the old container is gone: same name, same port
    await trio.testing.wait_all_tasks_blocked()
    assert status(sup).state == S.STARTING
    await wait_for(sup, S.READY)
    new = podman.only()
    assert new.id != old.id
    assert [c[0] for c in podman.mutations()][-4:] == ["stop", "remove", "create", "start"]
    assert "already in use" not in caplog.text


async def test_removal_is_bounded_when_the_stop_hangs(
    autojump_clock: trio.testing.MockClock,
    nursery: trio.Nursery,
    podman: FakePodman,
    artifacts: FakeArtifacts,
    caplog: pytest.LogCaptureFixture,
) -> None:
    sup = await start(nursery, podman, artifacts, assignment(stop_timeout_s=20.0))
    await wait_for(sup, S.READY)
    podman.stop_delay_s = 10_000.0  # the podman call itself never returns
    t0 = trio.current_time()
    sup.update(2, [])
    with trio.fail_after(1000):
        while True:
            if not sup.statuses():
                break
            await trio.sleep(0.5)
    assert trio.current_time() - t0 <= 20.0 + TEARDOWN_GRACE_S + 0.5
    assert "did not stop within 20 s" in caplog.text
    assert artifacts.calls[-2:] == [("unpin", SHA), ("evict",)]


async def test_removal_while_the_supervisor_stops_still_finishes(
    autojump_clock: trio.testing.MockClock, podman: FakePodman, artifacts: FakeArtifacts
) -> None:
    async with trio.open_nursery() as agent:
        sup = await start(agent, podman, artifacts, assignment())
        await wait_for(sup, S.READY)
        podman.stop_delay_s = 3.0
        sup.update(2, [])
        await trio.testing.wait_all_tasks_blocked()
        agent.cancel_scope.cancel()  # the agent stops in the middle of the graceful stop
    assert podman.containers == {}
    assert [c[0] for c in podman.mutations()][-2:] == ["stop", "remove"]


# --- health ---------------------------------------------------------------------------------------


async def test_failing_probes_flip_ready_to_unhealthy_within_two_intervals_and_back(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, podman: FakePodman, artifacts: FakeArtifacts
) -> None:
    sup = await start(nursery, podman, artifacts, assignment())
    await wait_for(sup, S.READY)
    await trio.sleep(PROBE.start_period_s + 1.3)  # off the probe ticks
    podman.healthy = False
    await trio.sleep(PROBE.interval_s)
    assert status(sup).state == S.READY  # one failure is tolerated (retries = 2)
    await trio.sleep(PROBE.interval_s)
    s = status(sup)
    assert (s.state, s.detail) == (S.UNHEALTHY, "2 consecutive failed health probes")
    podman.healthy = True
    await trio.sleep(PROBE.interval_s)
    assert status(sup).state == S.READY
    assert sup.statistics().probes_failed == 2


async def test_failures_during_the_start_period_keep_the_runtime_starting(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, podman: FakePodman, artifacts: FakeArtifacts
) -> None:
    podman.healthy = False
    t0 = trio.current_time()
    sup = await start(nursery, podman, artifacts, assignment())
    await trio.sleep(PROBE.start_period_s - 0.1)
    assert status(sup).state == S.STARTING
    # Probes at 10 and 12 are the first two counted.
    unhealthy_at = await wait_for(sup, S.UNHEALTHY)
    assert unhealthy_at - t0 == pytest.approx(12.0, abs=0.06)


async def test_podman_going_away_is_reported_and_the_running_runtime_kept(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, podman: FakePodman, artifacts: FakeArtifacts
) -> None:
    sup = await start(nursery, podman, artifacts, assignment())
    await wait_for(sup, S.READY)
    podman.calls.clear()
    podman.unavailable = True
    await wait_for(sup, S.FAILED, "engine_unavailable")
    await trio.sleep(20)
    podman.unavailable = False
    await wait_for(sup, S.READY)
    assert podman.mutations() == []  # not restarted, not recreated


# --- failures that never start a runtime ----------------------------------------------------------


async def test_an_artifact_digest_mismatch_fails_and_never_creates_the_container(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, podman: FakePodman, artifacts: FakeArtifacts
) -> None:
    artifacts.mismatch.add(SHA)
    sup = await start(nursery, podman, artifacts, assignment())
    await wait_for(sup, S.FAILED, "artifact_digest_mismatch")
    await trio.sleep(200)
    assert status(sup).reason == "artifact_digest_mismatch"
    assert podman.mutations("create", "start") == []
    # Retried slowly (at the maximum backoff): 0, 60, 120, 180.
    assert artifacts.calls == [("pin", SHA)] + [("fetch", SHA)] * 4


async def test_a_missing_image_fails_then_starts_when_the_registry_has_it(
    autojump_clock: trio.testing.MockClock,
    nursery: trio.Nursery,
    podman: FakePodman,
    artifacts: FakeArtifacts,
    caplog: pytest.LogCaptureFixture,
) -> None:
    podman.registry.clear()
    caplog.set_level(logging.INFO, logger="nexa.node.supervisor")
    sup = await start(nursery, podman, artifacts, assignment())
    await wait_for(sup, S.FAILED, "image_not_found")
    await trio.sleep(200)
    assert podman.mutations("create") == []
    assert len(podman.mutations("pull")) == 4
    # Logged once, not once per attempt.
    assert caplog.text.count("image_not_found") == 1
    podman.registry.add(IMAGE)
    t = trio.current_time()
    ready_at = await wait_for(sup, S.READY)
    assert ready_at - t <= CFG.restart_backoff_max_s
    assert status(sup).reason is None


async def test_a_secret_in_env_is_refused_before_anything_happens(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, podman: FakePodman, artifacts: FakeArtifacts
) -> None:
    sup = await start(nursery, podman, artifacts, assignment(env={"HF_TOKEN": "hf_abcdef", "OMP_NUM_THREADS": "4"}))
    await wait_for(sup, S.FAILED, "secret_in_env")
    await trio.sleep(300)
    s = status(sup)
    assert (s.state, s.reason) == (S.FAILED, "secret_in_env")
    assert "HF_TOKEN" in s.detail
    assert "hf_abcdef" not in s.detail
    assert podman.mutations() == []
    # Nothing fetched (the artifact is only pinned, in memory, while the assignment is desired).
    assert artifacts.calls == [("pin", SHA)]


async def test_an_rdma_rank_on_a_node_without_rdma_devices_fails_saying_why_and_creates_nothing(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, podman: FakePodman, artifacts: FakeArtifacts
) -> None:
    """A replica group's rank whose runtime opted into `--fabric rdma`, on a node with no
    /dev/infiniband (this machine has none): refused before any container, and asked again later."""
    members = [GroupMember(rank=r, node_id=f"n{r}", address=f"10.10.0.{r + 1}", port=50052) for r in (0, 1)]
    group = GroupRole(group="g", rank=1, members=members, fabric=FabricAccess.RDMA)
    assert rdma_device_nodes() == []
    sup = await start(nursery, podman, artifacts, assignment(group=group))
    await wait_for(sup, S.FAILED, "spec_refused")
    assert "no RDMA verbs device under /dev/infiniband" in status(sup).detail
    assert "--fabric tcp" in status(sup).detail
    await trio.sleep(300)
    assert podman.mutations("create") == [] and status(sup).reason == "spec_refused"


# --- reports and the artifact cache ----------------------------------------------------------------


async def test_statuses_and_statistics_shapes(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, podman: FakePodman, artifacts: FakeArtifacts
) -> None:
    sup = await start(
        nursery, podman, artifacts, assignment("a2", env={"DB_PASSWORD": "x"}), assignment("a1", port=18301)
    )
    await wait_for(sup, S.READY, aid="a1")
    assert sup.statuses() == [
        wire.AssignmentStatus(
            assignment_id="a2",
            state=S.FAILED,
            reason="secret_in_env",
            detail="runtimes never receive keys, tokens or credentials; refused environment variable DB_PASSWORD",
        ),
        wire.AssignmentStatus(assignment_id="a1", state=S.READY),
    ]
    stats = sup.statistics()
    assert stats.generation == 1
    assert stats.assignments == 2
    assert dict(stats.states) == {state: {S.READY: 1, S.FAILED: 1}.get(state, 0) for state in S}
    assert (stats.created, stats.adopted, stats.restarts, stats.pulls) == (1, 0, 0, 1)
    assert stats.reconcile_passes >= 1
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        stats.created = 5  # type: ignore[misc]


async def test_a_shared_artifact_is_pinned_once_and_released_with_its_last_assignment(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, podman: FakePodman, artifacts: FakeArtifacts
) -> None:
    a1, a2 = assignment("a1"), assignment("a2", port=18301, gpus=["nvidia.com/gpu=1"])
    sup = await start(nursery, podman, artifacts, a1, a2)
    await wait_for(sup, S.READY, aid="a1")
    await wait_for(sup, S.READY, aid="a2")
    assert [c for c in artifacts.calls if c[0] != "fetch"] == [("pin", SHA)]
    sup.update(2, [a2])
    await trio.sleep(1)
    assert [c[0] for c in artifacts.calls if c[0] != "fetch"] == ["pin"]
    sup.update(3, [])
    await trio.sleep(1)
    assert [c for c in artifacts.calls if c[0] != "fetch"] == [("pin", SHA), ("unpin", SHA), ("evict",)]
    assert podman.containers == {}


async def test_programming_errors_are_logged_counted_and_the_runtime_retried(
    autojump_clock: trio.testing.MockClock, podman: FakePodman, artifacts: FakeArtifacts
) -> None:
    # Issue 12 point 1: a bug met by one runtime's task restarts that task (nexa.supervision),
    # it never ends the agent.
    podman.broken_inspect = KeyError("bug")
    with Supervision(first_backoff_s=1.0, max_backoff_s=4.0).installed() as supervision:
        async with trio.open_nursery() as agent:
            await start(agent, podman, artifacts, assignment())
            await trio.sleep(30)
            assert supervision.statistics().failures["supervisor.runtime"] >= 3
            podman.broken_inspect = None
            await trio.sleep(30)
            failures = supervision.statistics().failures["supervisor.runtime"]
            await trio.sleep(30)
            assert supervision.statistics().failures["supervisor.runtime"] == failures
            agent.cancel_scope.cancel()


# --- each replica's writable cache (issue 29 point 2; `node.runtime_cache` has its own tests) ----


@attrs.define
class FakeCaches:
    """The supervisor's `RuntimeCaches` in memory, with a disk that can be full (fault injection)."""

    full: bool = False
    holders: dict[str, str] = attrs.Factory(dict)
    calls: list[tuple[str, str]] = attrs.Factory(list)

    def wants(self, runtime: RuntimeSpec) -> bool:
        return runtime.kind is not RuntimeKind.SIM

    async def acquire(self, holder: str, runtime: RuntimeSpec) -> Path:
        self.calls.append(("acquire", holder))
        if self.full:
            raise RuntimeCacheNoRoom("no room for the runtime cache", needed_bytes=2, free_bytes=1)
        self.holders[holder] = runtime.image
        return Path("/var/lib/nexa/node/runtime-cache") / ("k" * 64)

    def release(self, holder: str) -> None:
        self.calls.append(("release", holder))
        del self.holders[holder]


async def test_a_replica_without_room_for_its_cache_fails_typed_then_starts_with_it_mounted(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, podman: FakePodman, artifacts: FakeArtifacts
) -> None:
    caches = FakeCaches(full=True)
    sup = Supervisor(CFG, podman, artifacts, node_id=NODE, caches=caches)
    sup.update(1, [assignment()])
    await nursery.start(sup.run)
    await wait_for(sup, S.FAILED, "runtime_cache_no_room")
    assert podman.mutations("create", "start") == []  # never started without room
    caches.full = False
    await wait_for(sup, S.READY)
    spec = podman.only().spec
    assert spec.rw_mounts == [("/var/lib/nexa/node/runtime-cache/" + "k" * 64, "/var/cache/nexa-runtime")]
    [holder] = caches.holders
    # A crash restarts the same container: the hold is kept; removal gives it back.
    podman.crash(podman.only().id)
    await wait_for(sup, S.READY)
    assert list(caches.holders) == [holder]
    sup.update(2, [])
    with trio.fail_after(120):
        while caches.holders:  # noqa: ASYNC110 - virtual time
            await trio.sleep(1)
    assert caches.calls[-1] == ("release", holder)


# --- the fabric firewall: a group member's port closed but on the fabric while its container runs ----


class RecordingFirewall(FabricFirewall):
    """The real hold bookkeeping, its nft transaction replaced by a record of each table written
    (the real nft runs in tests/node/test_firewall.py); `refuse` injects nft's refusal."""

    def __init__(self, podman: FakePodman) -> None:
        super().__init__("nexa")
        self.podman = podman
        self.tables: list[tuple[dict[int, str], int]] = []
        self.refuse = False

    async def _apply(self) -> None:
        if self.refuse:
            raise FirewallError("nft refused table inet nexa (exit 1): Operation not permitted")
        containers = len(self.podman.mutations("create"))
        self.tables.append(({port: c.address for port, c in self.closed().items()}, containers))


def _group_of_two(rank: int, fabric: FabricAccess = FabricAccess.TCP) -> GroupRole:
    members = [GroupMember(rank=r, node_id=f"n{r}", address=f"127.0.0.{11 + r}", port=29500 + r) for r in (0, 1)]
    return GroupRole(group="g", rank=rank, members=members, fabric=fabric)


async def test_a_fabric_group_member_s_port_is_closed_before_its_container_and_opened_after_it_is_gone(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, podman: FakePodman, artifacts: FakeArtifacts
) -> None:
    firewall = RecordingFirewall(podman)
    sup = await start(nursery, podman, artifacts, assignment(group=_group_of_two(0)), firewall=firewall)
    await wait_for(sup, S.READY)
    # The head's port, on its own fabric address, closed while no container had been created yet.
    assert firewall.tables == [({29500: "127.0.0.11"}, 0)]
    c = podman.only()
    sup.update(2, [])
    with trio.fail_after(60):
        while sup.statuses():  # noqa: ASYNC110 - virtual time
            await trio.sleep(0.5)
    assert ("remove", c.id, True) in podman.mutations()
    assert firewall.tables[-1] == ({}, 1)  # opened once the container was removed
    assert firewall.closed() == {}


async def test_every_new_member_s_port_is_closed_in_one_write_before_any_of_them_is_adopted(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, podman: FakePodman, artifacts: FakeArtifacts
) -> None:
    """An agent restarted beside two running group members (of two deployments): their ports go into
    its first table write together, so neither is open between two writes while the other is adopted."""
    firewall = RecordingFirewall(podman)
    second = attrs.evolve(
        _group_of_two(1), group="g2", members=[attrs.evolve(m, port=29700) for m in _group_of_two(1).members]
    )
    sup = await start(
        nursery,
        podman,
        artifacts,
        assignment(group=_group_of_two(0)),
        assignment("a2", group=second),
        firewall=firewall,
    )
    await wait_for(sup, S.READY)
    await wait_for(sup, S.READY, aid="a2")
    assert firewall.tables == [({29500: "127.0.0.11", 29700: "127.0.0.12"}, 0)]  # one write, no container yet


async def test_a_member_whose_port_cannot_be_closed_is_not_started_and_says_what_to_do(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, podman: FakePodman, artifacts: FakeArtifacts
) -> None:
    firewall = RecordingFirewall(podman)
    firewall.refuse = True
    sup = await start(nursery, podman, artifacts, assignment(group=_group_of_two(1)), firewall=firewall)
    await wait_for(sup, S.FAILED, "fabric_firewall")
    assert "Operation not permitted" in status(sup).detail
    assert podman.mutations("create") == [] and firewall.closed() == {}
    firewall.refuse = False  # nft allowed (the agent run as root): asked again after the longest backoff
    await wait_for(sup, S.READY)
    assert firewall.tables == [({29501: "127.0.0.12"}, 0)]


async def test_members_without_fabric_access_and_single_replicas_leave_the_firewall_alone(
    autojump_clock: trio.testing.MockClock, nursery: trio.Nursery, podman: FakePodman, artifacts: FakeArtifacts
) -> None:
    """Without fabric access a rank has a network namespace of its own: nothing of it listens on the host."""
    firewall = RecordingFirewall(podman)
    alone = assignment("a2")
    grouped = assignment(group=_group_of_two(0, FabricAccess.NONE))
    sup = await start(nursery, podman, artifacts, grouped, alone, firewall=firewall)
    await wait_for(sup, S.READY)
    await wait_for(sup, S.READY, aid="a2")
    assert firewall.tables == []


async def test_a_supervisor_that_stops_keeps_its_running_members_ports_closed(
    autojump_clock: trio.testing.MockClock, podman: FakePodman, artifacts: FakeArtifacts
) -> None:
    """The agent stopping leaves its runtimes running (the next one adopts them): their ports stay closed."""
    firewall = RecordingFirewall(podman)
    async with trio.open_nursery() as inner:
        sup = await start(inner, podman, artifacts, assignment(group=_group_of_two(0)), firewall=firewall)
        await wait_for(sup, S.READY)
        inner.cancel_scope.cancel()
    assert podman.mutations("remove") == []
    assert firewall.closed() == {29500: Closed(port=29500, address="127.0.0.11")}
    assert firewall.tables == [({29500: "127.0.0.11"}, 0)]
