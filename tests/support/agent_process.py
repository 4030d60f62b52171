"""`nexa node` as its own process (so a test can SIGKILL it and start it again), its heartbeats as
`FakeController` receives them, a busybox runtime for it to run under real podman, and the podman
CLI on the run's store to look at what it did."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import attrs
import trio

from nexa.contracts import wire
from nexa.contracts.node import RuntimeKind
from nexa.contracts.runtime import ArtifactRef, HealthProbe, RuntimeSpec
from tests.realparts import PodmanService
from tests.support.nodes import FakeController

TIMEOUT_S = 60
PROBE_S = 0.5
RS = wire.RuntimeState


@attrs.define
class AgentProcess:
    config: Path
    log: Path
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "nexa", "node", "--config", str(self.config)], stdout=out, stderr=out
            )

    def kill(self, sig: int = signal.SIGKILL) -> int:
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.proc.wait(timeout=30)


def podman(service: PodmanService, *args: str) -> str:
    """The podman CLI on the run's store: the test looks at what the agent did (the agent never uses it)."""
    return service.cli(*args).stdout


def busybox_runtime(image: str, port: int, artifact: ArtifactRef, gpu: str) -> RuntimeSpec:
    # httpd on the node's loopback; the probe checks a file on the container's tmpfs, which the
    # test removes to make the runtime unhealthy.
    serve = f"touch /tmp/ok && exec /bin/httpd -f -p 127.0.0.1:{port} -h /www"
    return RuntimeSpec(
        kind=RuntimeKind.LLAMACPP,
        image=image,
        command=["/bin/sh", "-c", serve],
        env={"MODEL_PATH": "/models/model"},
        port=port,
        artifact=artifact,
        gpus=[gpu],
        memory_bytes=64 << 20,
        cpus=0.5,
        pids_limit=64,
        health=HealthProbe(
            command=["/bin/sh", "-c", f"test -f /tmp/ok && wget -q -O /dev/null http://127.0.0.1:{port}/"],
            interval_s=PROBE_S,
            timeout_s=2.0,
            start_period_s=10.0,
            retries=1,
        ),
        stop_timeout_s=2.0,  # busybox httpd as PID 1 ignores SIGTERM: the stop ends in a kill
    )


async def beat_until(ctl: FakeController, check: Any, what: str) -> wire.Heartbeat:
    with trio.fail_after(TIMEOUT_S):
        return await ctl.next(wire.Heartbeat, check)


def status(beat: wire.Heartbeat, aid: str) -> wire.AssignmentStatus | None:
    return next((s for s in beat.assignments if s.assignment_id == aid), None)


def state_is(aid: str, state: wire.RuntimeState, reason: str | None = None) -> Any:
    def check(beat: wire.Heartbeat) -> bool:
        s = status(beat, aid)
        return s is not None and s.state is state and (reason is None or s.reason == reason)

    return check
