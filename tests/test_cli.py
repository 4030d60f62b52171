"""The operator CLI against a controller running as its own process, as an operator would use them."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

from tests.conftest import ControllerProcess, require_tool


def test_first_start_prints_url_and_admin_key(controller_process: ControllerProcess) -> None:
    assert controller_process.admin_key is not None
    assert controller_process.admin_key.startswith("nxk_")
    out = controller_process.cli("keys", "list")
    assert out.returncode == 0, out.stderr
    assert "bootstrap admin" in out.stdout and "admin" in out.stdout


def test_keys_and_tenants_round_trip(controller_process: ControllerProcess) -> None:
    cp = controller_process
    assert cp.cli("tenants", "create", "acme", "--display-name", "Acme Corp").returncode == 0
    tenants = json.loads(cp.cli("tenants", "list", "--json").stdout)["tenants"]
    assert [(t["id"], t["display_name"]) for t in tenants] == [("acme", "Acme Corp")]

    created = cp.cli("keys", "create", "--role", "inference", "--tenant", "acme", "--name", "app", "--json")
    assert created.returncode == 0, created.stderr
    body = json.loads(created.stdout)
    secret, key_id = body["key"], body["info"]["id"]

    human = cp.cli("keys", "create", "--role", "audit")
    assert "shown only this once" in human.stdout
    assert human.stdout.strip().splitlines()[-1].startswith("nxk_")

    listing = cp.cli("keys", "list")
    assert key_id in listing.stdout and "acme" in listing.stdout
    assert secret not in listing.stdout
    assert listing.stdout.splitlines()[0].split()[:3] == ["ID", "ROLE", "TENANT"]

    assert cp.cli("keys", "revoke", key_id).returncode == 0
    keys = json.loads(cp.cli("keys", "list", "--json").stdout)["keys"]
    assert next(k for k in keys if k["id"] == key_id)["revoked_at"] is not None


def test_errors_are_one_clear_line_with_a_nonzero_exit(controller_process: ControllerProcess) -> None:
    cp = controller_process
    wrong = cp.cli("keys", "list", token="nxk_000000000000_" + "A" * 43)
    assert wrong.returncode == 1
    assert wrong.stderr.strip().count("\n") == 0
    assert wrong.stderr.startswith("nexa: error: unauthenticated:")

    audit_key = json.loads(cp.cli("keys", "create", "--role", "audit", "--json").stdout)["key"]
    forbidden = cp.cli("keys", "create", "--role", "admin", token=audit_key)
    assert forbidden.returncode == 1 and "forbidden" in forbidden.stderr

    dup = cp.cli("tenants", "create", "Bad Name")
    assert dup.returncode == 1 and "invalid_request" in dup.stderr

    missing = cp.cli("keys", "revoke", "nosuchkey")
    assert missing.returncode == 1 and "not_found" in missing.stderr

    unreachable = subprocess.run(
        [sys.executable, "-m", "nexa", "keys", "list", "--url", "http://127.0.0.1:9", "--token", "x"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert unreachable.returncode == 1 and "cannot reach the controller" in unreachable.stderr

    no_token = subprocess.run(
        [sys.executable, "-m", "nexa", "keys", "list", "--url", cp.url],
        capture_output=True,
        text=True,
        timeout=60,
        env={"PATH": "/usr/bin:/bin"},
    )
    assert no_token.returncode == 2 and "NEXA_TOKEN" in no_token.stderr


def test_audit_list_and_verify(controller_process: ControllerProcess) -> None:
    cp = controller_process
    cp.cli("tenants", "create", "t1", check=True)
    cp.cli("tenants", "create", "t2", check=True)
    listing = cp.cli("audit", "list", "--action", "tenant.create")
    assert listing.returncode == 0
    assert "tenant/t1" in listing.stdout and "tenant/t2" in listing.stdout
    page = cp.cli("audit", "list", "--limit", "1", "--json")
    assert json.loads(page.stdout)["next_cursor"] == 1
    ok = cp.cli("audit", "verify")
    assert ok.returncode == 0 and "audit chain ok: 3 events verified" in ok.stdout


def test_an_audit_row_edited_with_the_sqlite3_shell_is_named(controller_process: ControllerProcess) -> None:
    cp = controller_process
    for name in ("a", "b", "c"):
        cp.cli("tenants", "create", name, check=True)
    events = json.loads(cp.cli("audit", "list", "--json").stdout)["events"]
    victim = events[2]
    sqlite3_shell = require_tool("sqlite3")
    # The controller keeps running; the edit goes through the real sqlite3 shell, WAL and all.
    subprocess.run(
        [
            sqlite3_shell,
            str(cp.state_dir / "control.db"),
            f"UPDATE audit SET target='tenant/z' WHERE seq={victim['seq']};",
        ],
        check=True,
        timeout=30,
    )
    broken = cp.cli("audit", "verify")
    assert broken.returncode == 1
    assert f"seq {victim['seq']}" in broken.stderr and victim["id"] in broken.stderr
    verdict = json.loads(cp.cli("audit", "verify", "--json").stdout)
    assert verdict["ok"] is False and verdict["first_bad_id"] == victim["id"]


def test_a_second_controller_on_the_same_state_dir_is_refused(controller_process: ControllerProcess) -> None:
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "nexa",
            "control",
            "--state-dir",
            str(controller_process.state_dir),
            "--listen",
            "127.0.0.1:0",
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 1
    assert "in use by another nexa control process" in out.stderr
    assert "Traceback" not in out.stderr


def test_sigterm_exits_zero_and_sigint_too(controller_process: ControllerProcess) -> None:
    assert controller_process.stop(signal.SIGTERM) == 0
    controller_process.start()
    assert controller_process.stop(signal.SIGINT) == 0


def test_version_and_help() -> None:
    out = subprocess.run([sys.executable, "-m", "nexa", "version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("nexa ")
    bare = subprocess.run([sys.executable, "-m", "nexa"], capture_output=True, text=True, timeout=60)
    assert bare.returncode == 2 and "control" in bare.stderr
