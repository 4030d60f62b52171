"""`nexa node` running a python runtime from the Debian python image (`python_image`: debootstrap rootfs,
cached between runs) through real podman, a real registry and real S3: the base later runtimes
(llama-cpp-python) build on. The agent, its controller channel and the artifact are the `node` and
`artifact` fixtures of tests/node/conftest.py.
"""

from __future__ import annotations

import hashlib
import json

import httpx
import pytest
import trio

from nexa.contracts import wire
from nexa.contracts.node import RuntimeKind
from nexa.contracts.runtime import ArtifactRef, HealthProbe, RuntimeSpec
from tests.realparts import PodmanService, _free_port
from tests.support.agent_process import RS, TIMEOUT_S, AgentProcess, beat_until, podman, state_is
from tests.support.nodes import FakeController, aset

PROBE_S = 0.5


def python_runtime(image: str, port: int, artifact: ArtifactRef) -> RuntimeSpec:
    """python's http.server in its own network namespace (`{runtime_host}` is 0.0.0.0 there, and
    127.0.0.1 in the probe, which runs inside), published on the node's loopback, serving the
    artifact's folder (`/models/model`)."""
    fetch = f"import urllib.request;urllib.request.urlopen('http://{{runtime_host}}:{port}/model')"
    return RuntimeSpec(
        kind=RuntimeKind.LLAMACPP,
        image=image,
        command=["python3", "-m", "http.server", str(port), "--bind", "{runtime_host}", "--directory", "/models"],
        env={"MODEL_PATH": "/models/model"},
        port=port,
        artifact=artifact,
        memory_bytes=128 << 20,
        cpus=0.5,
        pids_limit=32,
        health=HealthProbe(
            command=["python3", "-c", fetch], interval_s=PROBE_S, timeout_s=5.0, start_period_s=20.0, retries=1
        ),
        stop_timeout_s=2.0,  # python as PID 1 has no SIGTERM handler, so the kernel ignores it: the stop kills
    )


@pytest.mark.slow
async def test_a_python_runtime_serves_its_artifact_from_a_read_only_root(
    node: tuple[FakeController, AgentProcess],
    podman_service: PodmanService,
    python_image: str,
    artifact: ArtifactRef,
) -> None:
    ctl, _agent = node
    port = _free_port()
    spec = python_runtime(python_image, port, artifact)
    with trio.fail_after(TIMEOUT_S):
        await ctl.next(wire.Hello)
        assignment = wire.Assignment(id="py1", deployment="dpy", runtime=spec)
        assert (await ctl.answer(aset(1, 1, assignments=[assignment]))).accepted
    await beat_until(ctl, state_is("py1", RS.READY), "py1 Ready")

    # The runtime is the pushed python image, pulled by digest, on a read-only root.
    [info] = json.loads(podman(podman_service, "inspect", "nexa-py1"))
    assert info["ImageDigest"] == python_image.split("@", 1)[1]
    assert info["Config"]["Cmd"][:3] == ["python3", "-m", "http.server"]
    assert info["HostConfig"]["ReadonlyRootfs"] is True

    # It serves exactly the artifact's bytes on the node's loopback.
    async with httpx.AsyncClient(trust_env=False, timeout=10) as http:
        response = await http.get(f"http://127.0.0.1:{port}/model")
    assert response.status_code == 200
    assert len(response.content) == artifact.size_bytes
    assert hashlib.sha256(response.content).hexdigest() == artifact.sha256

    # Nothing but /tmp is writable: not the root filesystem, not the model (a read-only mount of a
    # read-only file: without CAP_DAC_OVERRIDE the file's mode refuses first).
    for path, mode, refusal in (
        ("/x", "w", "Read-only file system"),
        ("/usr/lib/x", "w", "Read-only file system"),
        ("/models/model", "a", "Permission denied"),
        ("/models/y", "w", "Read-only file system"),
    ):
        denied = podman_service.cli("exec", "nexa-py1", "python3", "-c", f"open({path!r}, {mode!r})", check=False)
        assert denied.returncode != 0, path
        assert refusal in denied.stderr, denied.stderr
    wrote = podman(
        podman_service,
        "exec",
        "nexa-py1",
        "python3",
        "-c",
        "import pathlib; p = pathlib.Path('/tmp/x'); p.write_text('ok'); print(p.read_text())",
    )
    assert wrote.strip() == "ok"

    # Removing the assignment stops and removes the container.
    with trio.fail_after(TIMEOUT_S):
        assert (await ctl.answer(aset(1, 2, assignments=[]))).accepted
    await beat_until(ctl, lambda b: not b.assignments, "nothing assigned")
    assert not podman(podman_service, "ps", "-aq", "--filter", "label=nexa.assignment=py1").split()
