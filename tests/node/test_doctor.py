"""`nexa node doctor` (issue 14, point 5): one result per check, each failing one with its fix.

The good path runs against the real parts: an in-process controller (`/version`, enrollment, its
zmq channel) and the run's rootful podman socket. Faults are injected per check: a fake
`nvidia-smi`, a tmp CDI directory, sockets that do not answer, a fake controller with a skewed
clock or other keys, bad modes in the state directory, an impossible disk threshold. The last
test runs the command itself as a subprocess against `nexa control` as an operator starts it.
"""

from __future__ import annotations

import email.utils
import http.server
import json
import os
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import attrs
import httpx
import pytest
import trio

from nexa import cli, security
from nexa.channel import links
from nexa.config import ArtifactsConfig, Bytes, ContainerConfig, FirewallConfig, NodeConfig
from nexa.contracts import codec
from nexa.contracts.api import EnrollResponse
from nexa.contracts.doctor import CheckResult, CheckStatus, DoctorReport
from nexa.errors import ConfigError
from nexa.node import doctor, identity
from nexa.node.doctor import DoctorOptions, parse_cdi_yaml, run_doctor
from tests.conftest import FIXTURES, Controller, ControllerProcess, serving_http
from tests.realparts import DockerService, need

NEXA = (sys.executable, "-m", "nexa")
GB10_CSV = FIXTURES / "nvidia-smi" / "gb10_dgx_spark.csv"
GB10_MEMINFO = str(FIXTURES / "meminfo" / "gb10_dgx_spark.meminfo")
GB10_UUID = "GPU-a5b0c1e2-7f3d-4c9a-b8e6-2d1f0e9c7b54"

#: What `nvidia-ctk cdi generate` writes (block style, keys sorted, `kind` last), shortened.
NVIDIA_CTK_YAML = f"""\
---
cdiVersion: 0.5.0
containerEdits:
  deviceNodes:
  - path: /dev/nvidiactl
  env:
  - NVIDIA_VISIBLE_DEVICES=void
  hooks:
  - args:
    - nvidia-cdi-hook
    - update-ldcache
    hookName: createContainer
    path: /usr/bin/nvidia-cdi-hook
devices:
- containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
  name: "0"
- containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
  name: {GB10_UUID}
- containerEdits:
    deviceNodes:
    - path: /dev/nvidia0
  name: all
kind: nvidia.com/gpu
"""


def _fake_smi(tmp_path: Path, body: str | None = None, name: str = "nvidia-smi") -> str:
    script = tmp_path / name
    script.write_text("#!/bin/sh\n" + (body if body is not None else f"cat '{GB10_CSV}'") + "\n")
    script.chmod(0o755)
    return str(script)


def _cdi_dir(tmp_path: Path, text: str = NVIDIA_CTK_YAML, name: str = "nvidia.yaml") -> str:
    directory = tmp_path / "cdi"
    directory.mkdir(parents=True, exist_ok=True)
    (directory / name).write_text(text)
    return str(directory)


def _cfg(tmp_path: Path, socket_path: str, **kw: Any) -> NodeConfig:
    base = NodeConfig(
        state_dir=str(tmp_path / "node"),
        nvidia_smi=_fake_smi(tmp_path),
        container=ContainerConfig(socket=socket_path),
        artifacts=ArtifactsConfig(cache_max_bytes=Bytes(1024**2)),
    )
    return attrs.evolve(base, **kw)


def _opts(tmp_path: Path, **kw: Any) -> DoctorOptions:
    base = DoctorOptions(min_free_bytes=1024**2, cdi_dirs=(_cdi_dir(tmp_path),), meminfo_path=GB10_MEMINFO)
    return attrs.evolve(base, **kw)


def _by_name(report: DoctorReport) -> dict[str, CheckResult]:
    return {c.name: c for c in report.checks}


def _statuses(report: DoctorReport) -> dict[str, str]:
    return {c.name: c.status.value for c in report.checks}


async def _enroll(controller: Controller, state_dir: Path) -> str:
    async with controller.client() as http_client:
        token = (await http_client.post("/api/v1/enrollment-tokens", json={"ttl_s": 60})).json()["token"]
    argv = ["node", "enroll", "--controller", controller.url, "--token", token, "--state-dir", str(state_dir)]
    assert await trio.to_thread.run_sync(cli.main, argv) == 0
    return token.partition(".")[2]


# --- the good path, against the real parts ------------------------------------------------------


async def test_an_enrolled_node_with_everything_in_place_passes(
    controller: Controller, podman_socket: str, tmp_path: Path
) -> None:
    cfg = _cfg(tmp_path, podman_socket)
    before = await run_doctor(cfg, _opts(tmp_path, controller_url=controller.url))
    # Before enrollment: the local checks pass; what needs enrollment is a warning, not a failure.
    assert _statuses(before) == {
        "state_dir": "warn",
        "engine": "ok",
        "nvidia": "ok",
        "cdi": "ok",
        "disk": "ok",
        "cache_disk": "ok",
        "firewall": "ok",
        "controller": "ok",
        "fingerprint": "warn",
        "clock": "ok",
        "channel": "warn",
    }
    assert before.passed and before.node_id == ""
    fingerprint = await _enroll(controller, Path(cfg.state_dir))
    assert _by_name(before)["fingerprint"].detail == f"not enrolled: the controller reports {fingerprint}"

    # After: the URL comes from the enrollment record, the fingerprint from the pinned keys.
    report = await run_doctor(cfg, _opts(tmp_path))
    checks = _by_name(report)
    assert all(c.status is CheckStatus.OK for c in report.checks), report
    assert report.passed and report.node_id
    assert checks["engine"].detail.startswith("podman 4.") and podman_socket in checks["engine"].detail
    assert checks["nvidia"].detail == "1 GPU (0: NVIDIA GB10), driver 580.95.05"
    assert checks["cdi"].detail.startswith("nvidia.com/gpu=0 in ")
    assert checks["fingerprint"].detail == f"{fingerprint} (pinned at enrollment)"
    assert f"enrolled as node {report.node_id}" in checks["state_dir"].detail
    assert checks["channel"].detail.endswith("accepts connections")
    assert [c.name for c in report.checks] == list(checks)  # one result per check, in a fixed order
    # The JSON form is the contract type through the one codec, and reads back as it was.
    assert codec.loads(codec.api, codec.dumps(codec.api, report), DoctorReport) == report


async def test_version_reports_what_nodes_check(controller: Controller) -> None:
    async with httpx.AsyncClient(base_url=controller.url) as http_client:
        before = time.time()
        body = (await http_client.get("/version")).json()
    assert len(body["controller_fingerprint"]) == security.CONTROLLER_FINGERPRINT_HEX
    assert before - 1 <= body["now"] <= time.time() + 1
    assert body["max_clock_skew_s"] == 30.0


# --- a fake controller for clock and fingerprint faults ---------------------------------------


class _FakeController(http.server.BaseHTTPRequestHandler):
    """Answers `GET /version` with `answer` and a Date header `skew_s` off this host's clock."""

    answer: ClassVar[dict[str, object]] = {}
    skew_s: ClassVar[float] = 0.0

    def do_GET(self) -> None:
        body = json.dumps(type(self).answer).encode()
        self.send_response(200 if self.path == "/version" else 404)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def date_time_string(self, timestamp: float | None = None) -> str:
        return email.utils.formatdate(time.time() + type(self).skew_s, usegmt=True)

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def fake_controller() -> Iterator[str]:
    try:
        with serving_http(_FakeController) as url:
            yield url
    finally:
        _FakeController.answer, _FakeController.skew_s = {}, 0.0


def _answer(**kw: object) -> dict[str, object]:
    return {"version": "0.0-fake", "epoch": 1, "started_at": 1.0, **kw}


async def _controller_checks(url: str, tmp_path: Path, **opts: Any) -> dict[str, CheckResult]:
    results = await doctor.check_controller(DoctorOptions(controller_url=url, **opts), None, doctor.fetch_version)
    return {c.name: c for c in results}


async def test_a_skewed_controller_clock_fails_with_the_ntp_fix(fake_controller: str, tmp_path: Path) -> None:
    # Through `now` in the answer (sub-second), then through the Date header alone (older controller).
    _FakeController.answer = _answer(now=time.time() + 120, max_clock_skew_s=30.0)
    clock = (await _controller_checks(fake_controller, tmp_path))["clock"]
    assert clock.status is CheckStatus.FAIL and clock.fix == doctor.NTP_FIX
    assert clock.detail.startswith("1") and "behind the controller's" in clock.detail and "allowed 30 s" in clock.detail

    _FakeController.answer, _FakeController.skew_s = _answer(), -300.0
    clock = (await _controller_checks(fake_controller, tmp_path))["clock"]
    assert clock.status is CheckStatus.FAIL and "ahead of the controller's" in clock.detail

    _FakeController.answer = _answer(now=time.time() - 20, max_clock_skew_s=30.0)
    assert (await _controller_checks(fake_controller, tmp_path))["clock"].status is CheckStatus.WARN
    _FakeController.answer = _answer(now=time.time(), max_clock_skew_s=30.0)
    assert (await _controller_checks(fake_controller, tmp_path))["clock"].status is CheckStatus.OK


async def test_a_controller_with_other_keys_fails_the_fingerprint_check(fake_controller: str, tmp_path: Path) -> None:
    signing, curve = security.generate_signing_key(), links.generate_curve_keypair()
    pinned = security.controller_fingerprint(signing.public.b64, curve.public)
    other = security.controller_fingerprint(security.generate_signing_key().public.b64, curve.public)
    _FakeController.answer = _answer(controller_fingerprint=other, now=time.time())

    # Before enrollment: against --controller-fingerprint.
    checks = await _controller_checks(fake_controller, tmp_path, controller_fingerprint=pinned)
    assert checks["controller"].status is CheckStatus.OK
    assert checks["fingerprint"].status is CheckStatus.FAIL
    assert f"has fingerprint {other}, --controller-fingerprint says {pinned}" in checks["fingerprint"].detail

    # After: against the keys the node pinned (the URL comes from the record).
    state_dir = tmp_path / "node"
    identity.create_keys(state_dir)
    resp = EnrollResponse(
        node_id="spark-1",
        controller_signing_public_key=signing.public.b64,
        controller_curve_public_key=curve.public,
        channel_endpoint="tcp://127.0.0.1:1",
        labels={},
    )
    identity.save_enrollment(state_dir, resp, pin=pinned, controller_url=fake_controller)
    record = identity.load_enrollment(state_dir)
    assert record.controller_url == fake_controller
    results = await doctor.check_controller(DoctorOptions(), record, doctor.fetch_version)
    fp = {c.name: c for c in results}["fingerprint"]
    assert fp.status is CheckStatus.FAIL and f"this node pinned {pinned}" in fp.detail
    assert "enroll it again" in fp.fix

    # A flag that disagrees with the pin is a failure of its own.
    results = await doctor.check_controller(DoctorOptions(controller_fingerprint=other), record, doctor.fetch_version)
    assert "is not the pinned one" in {c.name: c for c in results}["fingerprint"].detail


async def test_an_unreachable_or_foreign_controller_fails_and_skips_what_depends_on_it(
    fake_controller: str, tmp_path: Path
) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}"
    checks = await _controller_checks(closed, tmp_path)
    assert (
        checks["controller"].status is CheckStatus.FAIL and "cannot reach the controller" in checks["controller"].detail
    )
    assert "nexa control" in checks["controller"].fix
    assert checks["fingerprint"].status is checks["clock"].status is CheckStatus.WARN

    _FakeController.answer = {"hello": "world"}  # something else answers on that port
    checks = await _controller_checks(fake_controller, tmp_path)
    assert checks["controller"].status is CheckStatus.FAIL and "not a nexa controller" in checks["controller"].detail

    no_url = await _controller_checks("", tmp_path)
    assert no_url["controller"].status is CheckStatus.WARN and "--controller" in no_url["controller"].detail


def test_a_controller_url_must_be_http() -> None:
    assert doctor.check_controller_url("https://control.lab:8470/") == "https://control.lab:8470"
    for bad in ("control.lab:8470", "tcp://control.lab:8471", "http://"):
        with pytest.raises(ConfigError):
            doctor.check_controller_url(bad)


# --- the engine ---------------------------------------------------------------------------------


async def test_an_engine_socket_that_does_not_answer_fails_with_the_fix(tmp_path: Path) -> None:
    missing = await doctor.check_engine(_cfg(tmp_path, str(tmp_path / "nothing.sock")))
    assert missing.status is CheckStatus.FAIL and "no socket at" in missing.detail
    assert "podman.socket" in missing.fix

    plain = tmp_path / "plain"
    plain.write_text("")
    assert "is not a unix socket" in (await doctor.check_engine(_cfg(tmp_path, str(plain)))).detail

    # A socket file nobody listens on any more: connection refused.
    dead = tmp_path / "dead.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(dead))
    refused = await doctor.check_engine(_cfg(tmp_path, str(dead)))
    assert refused.status is CheckStatus.FAIL and "does not answer on its socket" in refused.detail

    docker_cfg = _cfg(tmp_path, str(dead), container=ContainerConfig(engine="docker", socket=str(dead)))
    refused = await doctor.check_engine(docker_cfg)
    assert refused.detail.startswith("docker") and "docker.socket" in refused.fix


async def test_the_docker_engine_is_asked_through_its_own_api(tmp_path: Path) -> None:
    def answer(version: str, api: str) -> httpx.MockTransport:
        def handler(request: httpx.Request) -> httpx.Response:
            assert request.url.path == "/version"  # Docker's unversioned path, not libpod's
            return httpx.Response(200, json={"Version": version, "ApiVersion": api})

        return httpx.MockTransport(handler)

    cfg = _cfg(tmp_path, "", container=ContainerConfig(engine="docker", socket="/run/docker-test.sock"))
    good = await doctor.check_engine(cfg, transport=answer("28.2.2", "1.50"))
    assert good.status is CheckStatus.OK and good.detail == "docker 28.2.2 answers on /run/docker-test.sock"
    old = await doctor.check_engine(cfg, transport=answer("19.03.1", "1.40"))
    assert old.status is CheckStatus.FAIL and "older than 1.41" in old.detail


async def test_docker_with_gpu_method_cdi_must_have_cdi_on(tmp_path: Path) -> None:
    """`GET /info` lists `CDISpecDirs` when CDI is on (Docker Engine API, SystemInfo); an empty list means off."""

    def info(answer: dict[str, object]) -> httpx.MockTransport:
        def handler(request: httpx.Request) -> httpx.Response:
            if request.url.path == "/version":
                return httpx.Response(200, json={"Version": "27.5.1", "ApiVersion": "1.47"})
            assert request.url.path == "/info"
            return httpx.Response(200, json=answer)

        return httpx.MockTransport(handler)

    cfg = _cfg(tmp_path, "", container=ContainerConfig(engine="docker", socket="/run/docker-test.sock"))
    on = await doctor.check_docker_cdi(cfg, transport=info({"CDISpecDirs": ["/etc/cdi", "/var/run/cdi"]}))
    assert on.status is CheckStatus.OK and on.detail == "docker 27.5.1 reads CDI specs from /etc/cdi, /var/run/cdi"
    off = await doctor.check_docker_cdi(cfg, transport=info({"CDISpecDirs": []}))
    assert off.status is CheckStatus.FAIL and "CDI off" in off.detail
    assert off.fix.startswith('add "features": {"cdi": true} to /etc/docker/daemon.json')


@pytest.mark.slow
async def test_an_old_real_docker_daemon_fails_the_cdi_check_with_the_daemon_json_fix(
    dockerd_service: DockerService, tmp_path: Path
) -> None:
    """Debian's dockerd (20.10) predates CDI: its `GET /info` has no CDISpecDirs at all."""
    container = ContainerConfig(engine="docker", socket=dockerd_service.socket, docker_network=dockerd_service.network)
    cfg = _cfg(tmp_path, "", container=container)
    got = await doctor.check_docker_cdi(cfg)
    assert got.status is CheckStatus.FAIL, got
    assert got.detail.startswith(f"docker {dockerd_service.version} reports no CDISpecDirs in GET /info")
    assert 'add "features": {"cdi": true} to /etc/docker/daemon.json' in got.fix
    assert 'gpu_method = "nvidia-runtime"' in got.fix
    # The NVIDIA runtime's device requests need no CDI: the check is not run then.
    runtime_cfg = attrs.evolve(cfg, container=attrs.evolve(container, gpu_method="nvidia-runtime"))
    report = await run_doctor(runtime_cfg, _opts(tmp_path, controller_url=""))
    assert "docker_cdi" not in _by_name(report)
    report = await run_doctor(cfg, _opts(tmp_path, controller_url=""))
    assert _by_name(report)["docker_cdi"].status is CheckStatus.FAIL and not report.passed


# --- GPUs: nvidia-smi and CDI ---------------------------------------------------------------------


async def test_a_broken_driver_fails_the_nvidia_check_unless_the_node_is_a_simulation(tmp_path: Path) -> None:
    smi = _fake_smi(
        tmp_path,
        'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver."; exit 9',
        "broken-smi",
    )
    cfg = _cfg(tmp_path, "/nonexistent.sock", nvidia_smi=smi)
    report = await run_doctor(cfg, _opts(tmp_path))
    nvidia = _by_name(report)["nvidia"]
    assert nvidia.status is CheckStatus.FAIL and "couldn't communicate with the NVIDIA driver" in nvidia.detail
    assert "nvidia-smi" in nvidia.fix
    # With no GPU listed, a spec naming GPUs is only suspicious.
    assert _by_name(report)["cdi"].status is CheckStatus.WARN
    assert not report.passed

    sim = await run_doctor(attrs.evolve(cfg, simulation=True), _opts(tmp_path, cdi_dirs=(str(tmp_path / "none"),)))
    checks = _by_name(sim)
    assert checks["nvidia"].status is CheckStatus.WARN and checks["nvidia"].detail.startswith("simulation node")
    assert checks["cdi"].status is CheckStatus.WARN

    empty = _fake_smi(tmp_path, "true", "empty-smi")
    assert doctor.check_nvidia(attrs.evolve(cfg, nvidia_smi=empty), (), ()).detail == "nvidia-smi lists no GPUs"


async def test_a_cdi_spec_without_the_gpus_fails_with_nvidia_ctk_as_the_fix(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "/nonexistent.sock")
    gpus = tuple(parse_nvidia_smi_rows())
    empty = tmp_path / "empty"
    empty.mkdir()
    none = doctor.check_cdi(cfg, gpus, (str(empty), str(tmp_path / "absent")))
    assert none.status is CheckStatus.FAIL and none.fix == doctor.CDI_FIX and "no CDI spec in" in none.detail

    other = NVIDIA_CTK_YAML.replace('name: "0"', 'name: "1"')
    stale = doctor.check_cdi(cfg, gpus, (_cdi_dir(tmp_path / "stale", other),))
    assert stale.status is CheckStatus.FAIL and "lists nvidia.com/gpu=0" in stale.detail

    flow = 'cdiVersion: "0.5.0"\nkind: nvidia.com/gpu\ndevices: [{name: "0"}]\n'
    unread = doctor.check_cdi(cfg, gpus, (_cdi_dir(tmp_path / "flow", flow),))
    assert unread.status is CheckStatus.FAIL and "could not read" in unread.detail

    as_json = json.dumps({"cdiVersion": "0.5.0", "kind": "nvidia.com/gpu", "devices": [{"name": "0"}]})
    good = doctor.check_cdi(cfg, gpus, (_cdi_dir(tmp_path / "json", as_json, "nvidia.json"),))
    assert good.status is CheckStatus.OK

    # Docker's NVIDIA runtime finds the GPUs without CDI: a missing spec is only a warning there.
    docker = attrs.evolve(cfg, container=ContainerConfig(engine="docker", gpu_method="nvidia-runtime"))
    assert doctor.check_cdi(docker, gpus, (str(empty),)).status is CheckStatus.WARN


def parse_nvidia_smi_rows() -> list[Any]:
    from nexa.node.inventory import parse_nvidia_smi_csv

    return parse_nvidia_smi_csv(GB10_CSV.read_text())


def test_the_yaml_reader_takes_what_nvidia_ctk_writes_and_refuses_what_it_cannot_follow() -> None:
    assert parse_cdi_yaml(NVIDIA_CTK_YAML) == ("nvidia.com/gpu", ["0", GB10_UUID, "all"])
    # The hand-written style (indented list, name first, flow mappings inside an item).
    hand = 'cdiVersion: "0.5.0"\nkind: "nexa-test.test/gpu"\ndevices:\n  - name: "0"\n    containerEdits:\n'
    hand += '      env: ["X=0"]\n  - name: \'1\'\n    containerEdits: {env: ["X=1"]}\n'
    assert parse_cdi_yaml(hand) == ("nexa-test.test/gpu", ["0", "1"])
    for refused in (
        "kind: nvidia.com/gpu\ndevices: [{name: '0'}]\n",  # flow-style list
        "kind: nvidia.com/gpu\ndevices:\n- containerEdits: {}\n",  # an item without a name
        "kind: nvidia.com/gpu\ndevices:\n- name: &a '0'\n",  # an anchor
        "kind: nvidia.com/gpu\ndevices:\n\t- name: '0'\n",  # a tab
        'kind: nvidia.com/gpu\ndevices:\n- name: "\\u0030"\n',  # an escape
        "devices:\n- name: '0'\n",  # no kind
        "kind: nvidia.com/gpu\ndevices:\n- name: '0'\n  name: '1'\n",  # two names in one item
    ):
        assert parse_cdi_yaml(refused) is None, refused


# --- disk, state directory, channel -------------------------------------------------------------


def test_low_disk_fails_and_a_cache_larger_than_the_disk_warns(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "/nonexistent.sock")
    low = doctor.check_disk(cfg, 1 << 60)
    assert low.status is CheckStatus.FAIL and "--min-free-gib" in low.detail and "cache_dir" in low.fix
    assert doctor.check_disk(cfg, 1).status is CheckStatus.OK
    huge_cache = attrs.evolve(cfg, artifacts=ArtifactsConfig(cache_max_bytes=Bytes(1 << 60)))
    assert doctor.check_disk(huge_cache, 1).status is CheckStatus.WARN


def test_low_disk_for_the_runtime_caches_fails(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "/nonexistent.sock")
    low = doctor.check_cache_disk(cfg, 1 << 60)
    assert low.status is CheckStatus.FAIL and low.name == "cache_disk"
    assert f"for the runtime caches {tmp_path / 'node' / 'runtime-cache'}" in low.detail
    assert "--min-cache-free-gib" in low.detail and "state_dir" in low.fix
    assert doctor.check_cache_disk(cfg, 1).status is CheckStatus.OK


async def test_the_firewall_check_warns_without_nft_and_says_so_when_turned_off(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "/nonexistent.sock")
    missing = await doctor.check_firewall(attrs.evolve(cfg, firewall=FirewallConfig(nft=str(tmp_path / "no-nft"))))
    assert missing.status is CheckStatus.WARN and missing.name == "firewall"
    assert "cannot run" in missing.detail and "would not start here" in missing.detail
    assert "apt install nftables" in missing.fix and "nexa-node.service.d/fabric.conf" in missing.fix
    assert "[firewall] enabled = false" in missing.fix
    off = await doctor.check_firewall(attrs.evolve(cfg, firewall=FirewallConfig(enabled=False)))
    assert off.status is CheckStatus.OK and "host's firewall" in off.detail
    need("nft")
    found = await doctor.check_firewall(cfg)  # the real nft, as root: it answers
    assert found.status is CheckStatus.OK and "table inet nexa" in found.detail


def test_bad_modes_in_the_state_directory_fail_with_the_chmod(tmp_path: Path) -> None:
    state_dir = tmp_path / "node"
    identity.create_keys(state_dir)
    assert doctor.check_state_dir(state_dir, record=None).status is CheckStatus.OK
    key = state_dir / identity.SIGNING_KEY_FILE
    assert stat.S_IMODE(key.stat().st_mode) == 0o600

    state_dir.chmod(0o755)
    key.chmod(0o644)
    bad = doctor.check_state_dir(state_dir, record=None)
    assert bad.status is CheckStatus.FAIL
    assert "has mode 0755, not 0700" in bad.detail and "node.key has mode 0644, not 0600" in bad.detail
    assert f"chmod 0700 {state_dir}" in bad.fix and f"chmod 0600 {key}" in bad.fix

    state_dir.chmod(0o700)
    key.chmod(0o600)
    if os.geteuid() == 0:  # only root can give a file away
        os.chown(key, 65534, -1)
        other = doctor.check_state_dir(state_dir, record=None)
        assert other.status is CheckStatus.FAIL and "node.key is owned by uid 65534" in other.detail
        assert "chown -R" in other.fix
        os.chown(key, 0, -1)

    (state_dir / identity.ENROLLMENT_FILE).write_text("{not json")
    (state_dir / identity.ENROLLMENT_FILE).chmod(0o600)
    report = trio.run(run_doctor, _cfg(tmp_path, "/nonexistent.sock"), _opts(tmp_path))
    damaged = _by_name(report)["state_dir"]
    assert damaged.status is CheckStatus.FAIL and "is damaged" in damaged.detail

    not_dir = tmp_path / "file"
    not_dir.write_text("")
    assert doctor.check_state_dir(not_dir, record=None).status is CheckStatus.FAIL


async def test_a_channel_endpoint_that_refuses_fails(tmp_path: Path) -> None:
    cfg = _cfg(tmp_path, "/nonexistent.sock")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    record = identity.EnrollmentRecord(
        node_id="n1",
        controller_signing_public_key=security.generate_signing_key().public.b64,
        controller_curve_public_key=links.generate_curve_keypair().public,
        channel_endpoint=f"tcp://127.0.0.1:{port}",
    )
    refused = await doctor.check_channel(cfg, record)
    assert refused.status is CheckStatus.FAIL and "cannot connect to" in refused.detail and "firewall" in refused.fix
    odd = await doctor.check_channel(cfg, attrs.evolve(record, channel_endpoint="ipc:///tmp/x"))
    assert odd.status is CheckStatus.FAIL and "is not tcp://HOST:PORT" in odd.detail
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        up = attrs.evolve(record, channel_endpoint=f"tcp://127.0.0.1:{listener.getsockname()[1]}")
        assert (await doctor.check_channel(cfg, up)).status is CheckStatus.OK


def test_the_text_form_puts_each_fix_under_its_failure() -> None:
    rep = doctor.report(
        (
            CheckResult(name="disk", status=CheckStatus.OK, detail="plenty"),
            CheckResult(name="cdi", status=CheckStatus.FAIL, detail="no spec", fix=doctor.CDI_FIX),
        )
    )
    assert not rep.passed
    lines = doctor.render_text(rep)
    assert lines[0].split() == ["ok", "disk", "plenty"]
    assert lines[1].startswith("FAIL  cdi")
    assert lines[2].strip() == f"fix: {doctor.CDI_FIX}"


# --- the real command against the real controller process -------------------------------------


def _doctor_cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*NEXA, "node", "doctor", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_nexa_node_doctor_against_nexa_control_and_podman(
    controller_process: ControllerProcess, podman_socket: str, tmp_path: Path
) -> None:
    created = controller_process.cli("tokens", "create", "--ttl", "60", "--json")
    assert created.returncode == 0, created.stderr
    token = json.loads(created.stdout)["token"]
    fingerprint = token.partition(".")[2]
    state_dir = tmp_path / "node-state"
    config = tmp_path / "node.toml"
    config.write_text(
        f'state_dir = "{state_dir}"\nnvidia_smi = "{_fake_smi(tmp_path)}"\nsimulation = true\n'
        f'[container]\nsocket = "{podman_socket}"\n[artifacts]\ncache_max_bytes = 1048576\n'
    )
    cdi = _cdi_dir(tmp_path)
    common = ("--config", str(config), "--cdi-dir", cdi, "--min-free-gib", "0.001")

    before = _doctor_cli(*common, "--controller", controller_process.url, "--controller-fingerprint", fingerprint)
    assert before.returncode == 0, before.stdout + before.stderr
    assert "warn  channel" in before.stdout and "ok    fingerprint" in before.stdout

    enroll = subprocess.run(
        [*NEXA, "node", "enroll", "--config", str(config), "--controller", controller_process.url, "--token", token],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert enroll.returncode == 0, enroll.stderr

    after = _doctor_cli(*common, "--json")
    assert after.returncode == 0, after.stdout + after.stderr
    report = codec.loads(codec.api, after.stdout, DoctorReport)
    assert report.passed and report.node_id
    assert {c.name: c.status.value for c in report.checks} == {
        name: "ok"
        for name in (
            "state_dir",
            "engine",
            "nvidia",
            "cdi",
            "disk",
            "cache_disk",
            "firewall",
            "controller",
            "fingerprint",
            "clock",
            "channel",
        )
    }

    wrong = _doctor_cli(*common, "--controller-fingerprint", "0" * 64)
    assert wrong.returncode == 1 and "FAIL  fingerprint" in wrong.stdout
    bad_flag = _doctor_cli(*common, "--controller-fingerprint", "xyz")
    assert bad_flag.returncode == 2 and "--controller-fingerprint" in bad_flag.stderr
