"""Acknowledged writes survive `kill -9`; the audit chain stays intact; metrics lint clean."""

from __future__ import annotations

import json
import signal
import subprocess
import threading

import httpx
import pytest

from tests.conftest import ControllerProcess, require_tool


@pytest.mark.slow
def test_kill_9_during_a_burst_of_500_key_creations_loses_no_acknowledged_key(
    controller_process: ControllerProcess,
) -> None:
    cp = controller_process
    acknowledged: list[str] = []
    lock = threading.Lock()
    stop = threading.Event()
    started = threading.Barrier(9)

    def creator(worker: int) -> None:
        headers = {"Authorization": f"Bearer {cp.admin_key}"}
        with httpx.Client(base_url=cp.url, headers=headers, timeout=10) as http:
            started.wait()
            for i in range(500 // 8 + 1):
                if stop.is_set():
                    return
                try:
                    resp = http.post("/api/v1/keys", json={"role": "operator", "name": f"w{worker}-{i}"})
                except httpx.TransportError:
                    return  # the controller died under us; this one was never acknowledged
                if resp.is_success:
                    with lock:
                        acknowledged.append(resp.json()["info"]["id"])

    workers = [threading.Thread(target=creator, args=(w,)) for w in range(8)]
    for t in workers:
        t.start()
    started.wait()
    # Let the burst run until about half of it is acknowledged, then pull the plug.
    while True:
        with lock:
            if len(acknowledged) >= 250:
                break
        if not any(t.is_alive() for t in workers):
            break
    assert cp.proc is not None
    cp.proc.send_signal(signal.SIGKILL)
    cp.proc.wait(timeout=30)
    cp.close_files()
    stop.set()
    for t in workers:
        t.join(timeout=30)
    assert len(acknowledged) >= 250

    cp.start()
    page = json.loads(cp.cli("keys", "list", "--limit", "1000", "--json", check=True).stdout)
    assert page["next_cursor"] is None  # at most 1 + 8 x 63 keys: one page holds them all
    present = {k["id"] for k in page["keys"]}
    missing = set(acknowledged) - present
    assert not missing, f"{len(missing)} acknowledged keys were lost"
    verify = cp.cli("audit", "verify", "--json")
    assert verify.returncode == 0, verify.stderr
    # bootstrap key + every acknowledged creation (+ those committed but never answered)
    assert json.loads(verify.stdout)["checked"] >= len(acknowledged) + 1


@pytest.mark.slow
def test_metrics_pass_promtool(controller_process: ControllerProcess) -> None:
    promtool = require_tool("promtool")
    cp = controller_process
    key = json.loads(cp.cli("keys", "create", "--role", "monitoring", "--json", check=True).stdout)["key"]
    with httpx.Client(base_url=cp.url, headers={"Authorization": f"Bearer {key}"}) as http:
        http.get("/healthz")
        http.get("/api/v1/keys")  # a 403 shows up in the auth failure counter
        exposition = http.get("/metrics")
    assert exposition.status_code == 200
    lint = subprocess.run(
        [promtool, "check", "metrics"], input=exposition.text, capture_output=True, text=True, timeout=30
    )
    assert lint.returncode == 0, lint.stdout + lint.stderr
    assert 'nexa_auth_failures_total{code="forbidden"} 1.0' in exposition.text
