"""`nexa node` measures what a replica holds: a runtime that allocates a known amount, run by real podman
(the run's busybox image, pulled by digest from the run's registry), is measured through its
container's cgroup within 10 %. The agent and its channel are the `node` fixture (tests/node/conftest.py).
"""

from __future__ import annotations

import attrs
import pytest
import trio

from nexa.contracts import wire
from nexa.contracts.runtime import ArtifactRef
from nexa.localparts import free_ports
from tests.realparts import BuiltImages, FakeGpu, PodmanService
from tests.support.agent_process import RS, TIMEOUT_S, AgentProcess, beat_until, busybox_runtime, status
from tests.support.nodes import FakeController, aset

MIB = 1024 * 1024
#: What the runtime allocates and touches before it serves: a file of this size on its /tmp, a
#: tmpfs whose pages are charged to the container's memory cgroup (shared memory, never reclaimable
#: page cache), as a model server's weights and KV cache would be.
HELD_MIB = 256


@pytest.mark.slow
async def test_a_runtime_that_holds_a_known_amount_is_measured_within_ten_percent(
    node: tuple[FakeController, AgentProcess],
    podman_service: PodmanService,
    test_images: BuiltImages,
    fake_gpu_cdi: FakeGpu,
    artifact: ArtifactRef,
) -> None:
    ctl, _agent = node
    [port] = free_ports(1)
    base = busybox_runtime(test_images.busybox, port, artifact, fake_gpu_cdi.device)
    hold = f"dd if=/dev/zero of=/tmp/held bs=1M count={HELD_MIB} 2>/dev/null && touch /tmp/ok"
    spec = attrs.evolve(
        base,
        command=["/bin/sh", "-c", f"{hold} && exec /bin/httpd -f -p 127.0.0.1:{port} -h /www"],
        memory_bytes=(HELD_MIB + 128) * MIB,
    )
    with trio.fail_after(TIMEOUT_S):
        await ctl.next(wire.Hello)
        assignment = wire.Assignment(id="m1", deployment="dm", runtime=spec)
        assert (await ctl.answer(aset(1, 1, assignments=[assignment]))).accepted

    def measured(beat: wire.Heartbeat) -> bool:
        s = status(beat, "m1")
        return s is not None and s.state is RS.READY and s.memory is not None

    beat = await beat_until(ctl, measured, "m1 Ready and measured")
    got = status(beat, "m1")
    assert got is not None and got.memory is not None
    memory = got.memory
    # Through the container's cgroup (no GPU processes here, and not a unified-memory node).
    assert memory.cgroup_bytes is not None and memory.gpu_bytes is None and memory.available_drop_bytes is None
    assert memory.measured_bytes == memory.cgroup_bytes
    assert abs(memory.measured_bytes - HELD_MIB * MIB) <= HELD_MIB * MIB // 10, memory
