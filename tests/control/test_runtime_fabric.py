"""Fabric access is opt-in and visible (issue 33, point 4): `nexa runtimes register --fabric rdma|tcp`
against a real controller and registry, shown by `nexa runtimes show`, said in the audit event; a
bad value changes nothing; records from before the option load as `none`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import trio

from nexa.contracts import codec
from nexa.contracts.groups import FabricAccess
from nexa.contracts.models import RuntimeRecord
from tests.conftest import Controller
from tests.realparts import BuiltImages
from tests.support.api import assert_envelope, ok
from tests.support.models import audit_events
from tests.support.realmodel import cli


async def test_register_with_fabric_rdma_shows_it_and_audits_it(reg: Controller, test_images: BuiltImages) -> None:
    image = test_images.busybox
    argv = ["runtimes", "register", "vllm-ib", "--kind", "vllm", "--version", "0.12.0", "--image", image]
    out = await trio.to_thread.run_sync(cli, reg, *argv, "--fabric", "rdma")
    assert "fabric: rdma (a replica group's containers get it" in out
    await trio.to_thread.run_sync(
        cli, reg, "runtimes", "register", "vllm-plain", "--kind", "vllm", "--version", "1", "--image", image
    )

    shown = await trio.to_thread.run_sync(cli, reg, "runtimes", "show", "vllm-ib")
    assert "rdma (opt-in: groups get the node's network namespace, RDMA devices, IPC_LOCK, unlimited memlock" in shown
    plain = await trio.to_thread.run_sync(cli, reg, "runtimes", "show", "vllm-plain")
    assert "none (groups keep a namespace of their own)" in plain
    record = codec.loads(
        codec.api, await trio.to_thread.run_sync(cli, reg, "runtimes", "show", "vllm-ib", "--json"), RuntimeRecord
    )
    assert record.fabric is FabricAccess.RDMA

    async with reg.client() as http:
        tcp = await ok(
            http.post(
                "/api/v1/runtimes",
                json={"name": "sg-tcp", "kind": "sglang", "version": "1", "image": image, "fabric": "tcp"},
            ),
            201,
        )
        assert tcp["fabric"] == "tcp" and (await ok(http.get("/api/v1/runtimes/sg-tcp")))["fabric"] == "tcp"
        events = {e["target"]: e for e in await audit_events(http) if e["action"] == "runtime.register"}
    assert events["runtime/vllm-ib"]["detail"] == "fabric rdma"
    assert events["runtime/sg-tcp"]["detail"] == "fabric tcp"
    assert events["runtime/vllm-plain"]["detail"] == ""  # nothing opted into, as before
    # The event's digest covers the record, fabric included.
    assert events["runtime/vllm-ib"]["next_sha256"] == codec.sha256_of(codec.store, record)


async def test_a_bad_fabric_is_refused_and_changes_nothing(reg: Controller, test_images: BuiltImages) -> None:
    image = test_images.busybox
    async with reg.client() as http:
        for body, code in (
            ({"name": "x", "kind": "vllm", "version": "1", "image": image, "fabric": "infiniband"}, "invalid_request"),
            ({"name": "x", "kind": "vllm", "version": "1", "image": image, "fabric": True}, "invalid_request"),
            ({"name": "x", "kind": "sim", "version": "1", "image": image, "fabric": "tcp"}, "invalid_request"),
        ):
            err = assert_envelope(await http.post("/api/v1/runtimes", json=body), 400, code)
            assert "fabric" in str(err["message"])
        assert (await ok(http.get("/api/v1/runtimes")))["runtimes"] == []
        assert [e for e in await audit_events(http) if e["action"] == "runtime.register"] == []
    refused = await trio.to_thread.run_sync(
        _cli_failing, reg, "runtimes", "register", "x", "--kind", "vllm", "--version", "1", "--image", image,
        "--fabric", "ib",
    )  # fmt: skip
    assert "invalid choice: 'ib' (choose from 'none', 'tcp', 'rdma')" in refused


def _cli_failing(controller: Controller, *argv: str) -> str:
    env = {**os.environ, "NEXA_URL": controller.url, "NEXA_TOKEN": controller.admin_key}
    done = subprocess.run([sys.executable, "-m", "nexa", *argv], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 2, done
    return done.stderr


def test_records_from_before_the_option_load_without_fabric_access() -> None:
    old = {
        "name": "vllm",
        "kind": "vllm",
        "version": "1",
        "image": f"r.example/v@sha256:{'1' * 64}",
        "media_type": "application/vnd.oci.image.index.v1+json",
        "registered_at": 1.0,
        "registered_by": None,
        "host_network": False,
        "platforms": [],
        "image_configs": [],
    }
    assert codec.loads(codec.store, json.dumps(old), RuntimeRecord).fabric is FabricAccess.NONE
