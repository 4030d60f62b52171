"""`nexa backup --out` against a real `nexa control`, `nexa restore` onto a new directory, and a
controller started there: same keys, tenants, API keys and audit chain. Plus the refusals, by CLI,
`nexa backup list`, and the schedule (`[backup] interval_s`, `keep`) of a real controller."""

from __future__ import annotations

import contextlib
import json
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import ControllerProcess, free_port
from tests.support.api import wait_for

#: Polls of the schedule: generous, the machine is shared (the schedule's interval is 1 s).
SCHEDULE_TIMEOUT_S = 90


def _nexa(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nexa", *args], capture_output=True, text=True, timeout=120, check=False, env=env
    )


def _started(tmp_path: Path, name: str, key_file: Path, extra: str = "") -> ControllerProcess:
    config = tmp_path / f"{name}.toml"
    config.write_text(f'[backup]\nkey_file = "{key_file}"\nkeep = 2\n{extra}')
    cp = ControllerProcess(state_dir=tmp_path / name, port=free_port())
    cp.start("--config", str(config))
    return cp


def _get(cp: ControllerProcess, path: str, token: str) -> object:
    resp = httpx.get(cp.url + path, headers={"Authorization": f"Bearer {token}"}, timeout=30)
    assert resp.status_code == 200, resp.text
    return resp.json()


@pytest.mark.slow
def test_backup_restore_and_a_controller_on_the_restored_state(tmp_path: Path) -> None:
    key_file = tmp_path / "backup.key"
    made = _nexa("keygen", "--backup", "--out", str(key_file))
    assert made.returncode == 0 and made.stdout == "", made.stderr
    assert key_file.stat().st_mode & 0o777 == 0o600

    first = _started(tmp_path, "state", key_file)
    restored: ControllerProcess | None = None
    try:
        assert first.admin_key is not None
        admin = first.admin_key
        assert first.cli("tenants", "create", "acme").returncode == 0
        assert first.cli("keys", "create", "--role", "inference", "--tenant", "acme").returncode == 0

        # Mutations go on over HTTP while the backups are made; all of them succeed.
        errors: list[str] = []
        stop = threading.Event()

        def mutate() -> None:
            i = 0
            with httpx.Client(base_url=first.url, headers={"Authorization": f"Bearer {admin}"}, timeout=30) as c:
                while not stop.is_set() and i < 200:
                    resp = c.post("/api/v1/tenants", json={"id": f"t{i}", "display_name": ""})
                    if resp.status_code != 201:
                        errors.append(resp.text)
                    i += 1

        writer = threading.Thread(target=mutate)
        writer.start()
        try:
            out = tmp_path / "b.nxbk"
            for i in range(3):
                taken = first.cli("backup", "--out", str(tmp_path / f"extra{i}.nxbk"))
                assert taken.returncode == 0, taken.stderr
            taken = first.cli("backup", "--out", str(out))
            assert taken.returncode == 0, taken.stderr
        finally:
            stop.set()
            writer.join(timeout=60)
        assert errors == []
        assert out.stat().st_mode & 0o777 == 0o600
        assert "written to" in taken.stdout and "sha256" in taken.stdout

        # Listed (keep = 2: the two newest stay) and audited.
        listed = _get(first, "/api/v1/backups", admin)
        assert isinstance(listed, dict) and len(listed["backups"]) == 2
        events = _get(first, "/api/v1/audit?action=backup.created", admin)
        assert isinstance(events, dict) and len(events["events"]) == 4
        again = first.cli("backup", "--out", str(out))
        assert again.returncode == 1 and "exists already" in again.stderr

        expected_keys = _get(first, "/api/v1/receipts/public-key", admin)
        first.kill()  # the disk "died": restore from the file alone

        # The refusals, each a clear message, exit 1, nothing written.
        target = tmp_path / "new"
        wrong = tmp_path / "wrong.key"
        assert _nexa("keygen", "--backup", "--out", str(wrong)).returncode == 0
        refused = _nexa("restore", str(out), "--state-dir", str(target), "--key-file", str(wrong))
        assert refused.returncode == 1 and "not with the key given" in refused.stderr
        tampered = tmp_path / "tampered.nxbk"
        data = bytearray(out.read_bytes())
        data[len(data) // 2] ^= 0x40
        tampered.write_bytes(bytes(data))
        refused = _nexa("restore", str(tampered), "--state-dir", str(target), "--key-file", str(key_file))
        assert refused.returncode == 1 and "truncated or edited" in refused.stderr
        busy = tmp_path / "busy"
        busy.mkdir()
        (busy / "notes").write_text("mine")
        refused = _nexa("restore", str(out), "--state-dir", str(busy), "--key-file", str(key_file))
        assert refused.returncode == 1 and "is not empty" in refused.stderr
        no_key = _nexa("restore", str(out), "--state-dir", str(target), env={"PATH": "/usr/bin:/bin"})
        assert no_key.returncode == 2 and "NEXA_BACKUP_KEY" in no_key.stderr
        assert not target.exists() and [p.name for p in busy.iterdir()] == ["notes"]
        assert [p.name for p in tmp_path.iterdir() if ".restore-" in p.name] == []

        done = _nexa("restore", str(out), "--state-dir", str(target), "--key-file", str(key_file))
        assert done.returncode == 0, done.stderr
        assert "audit chain ok" in done.stdout

        restored = ControllerProcess(state_dir=target, port=free_port())
        restored.start()
        restored.admin_key = admin
        assert _get(restored, "/api/v1/receipts/public-key", admin) == expected_keys
        tenants = _get(restored, "/api/v1/tenants?limit=1000", admin)
        assert isinstance(tenants, dict) and "acme" in {t["id"] for t in tenants["tenants"]}
        keys = _get(restored, "/api/v1/keys", admin)
        assert isinstance(keys, dict) and {k["role"] for k in keys["keys"]} >= {"admin", "inference"}
        verified = restored.cli("audit", "verify")
        assert verified.returncode == 0 and "audit chain ok" in verified.stdout, verified.stderr
    finally:
        first.kill()
        if restored is not None:
            restored.kill()


@pytest.mark.slow
def test_backup_without_a_key_is_refused_and_needs_admin(controller_process: ControllerProcess, tmp_path: Path) -> None:
    refused = controller_process.cli("backup", "--out", str(tmp_path / "b.nxbk"))
    assert refused.returncode == 1 and "backup_not_configured" in refused.stderr
    assert "nexa keygen --backup" in refused.stderr
    assert not (tmp_path / "b.nxbk").exists()
    assert controller_process.cli("tenants", "create", "acme").returncode == 0
    made = controller_process.cli("keys", "create", "--role", "operator", "--json")
    operator = made.stdout.split('"key": "')[1].split('"')[0]
    forbidden = controller_process.cli("backup", "--out", str(tmp_path / "b.nxbk"), token=operator)
    assert forbidden.returncode == 1 and "forbidden" in forbidden.stderr
    missing = httpx.get(
        controller_process.url + "/api/v1/backups/nexa-20990101T000000.000Z-e1.nxbk",
        headers={"Authorization": f"Bearer {controller_process.admin_key}"},
    )
    assert missing.status_code == 404


@pytest.mark.slow
def test_backup_without_out_or_a_verb_is_a_usage_error_and_list_takes_flags_either_side(
    controller_process: ControllerProcess,
) -> None:
    bare = controller_process.cli("backup")
    assert bare.returncode == 2 and "nexa backup --out FILE" in bare.stderr and "nexa backup list" in bare.stderr
    bare = controller_process.cli("backup", "create")
    assert bare.returncode == 2 and "nexa backup --out FILE" in bare.stderr
    helped = controller_process.cli("backup", "--help")
    assert helped.returncode == 0 and "list" in helped.stdout and "--out FILE" in helped.stdout
    # Listing needs no backup key: none yet.
    listed = controller_process.cli("backup", "list")
    assert listed.returncode == 0 and "(none)" in listed.stdout, listed.stderr
    for args in (("backup", "list", "--json"), ("backup", "--json", "list")):
        listed = controller_process.cli(*args)
        assert listed.returncode == 0 and json.loads(listed.stdout) == {"backups": [], "next_cursor": None}
    # A flag given before the verb holds after it (a sub-parser's default would overwrite it).
    token = controller_process.admin_key or ""
    env_free = controller_process.cli("backup", "--token", token, "list", "--json", token="nexa_bad")
    assert env_free.returncode == 0, env_free.stderr


def _backup_files(directory: Path) -> list[str]:
    """The backups in `directory` (not the temporary file of one being written), each mode 0600."""
    names = []
    for path in directory.iterdir():
        if path.name.endswith(".nxbk") and not path.name.startswith("."):
            names.append(path.name)
            with contextlib.suppress(FileNotFoundError):  # pruned since
                assert path.stat().st_mode & 0o777 == 0o600
    return sorted(names)


async def _api(cp: ControllerProcess, path: str) -> Any:
    async with httpx.AsyncClient(
        base_url=cp.url, headers={"Authorization": f"Bearer {cp.admin_key}"}, timeout=30
    ) as http:
        resp = await http.get(path)
    assert resp.status_code == 200, resp.text
    return resp.json() if path != "/metrics" else resp.text


async def _events(cp: ControllerProcess, action: str) -> list[dict[str, Any]]:
    page = await _api(cp, f"/api/v1/audit?action={action}&limit=1000")
    return list(page["events"])


async def _metric(cp: ControllerProcess, name: str) -> float:
    match = re.search(rf"^{name} (\S+)$", await _api(cp, "/metrics"), re.M)
    return float(match.group(1)) if match else 0.0


@pytest.mark.slow
async def test_the_schedule_writes_backups_prunes_to_keep_and_advances_the_metric(tmp_path: Path) -> None:
    key_file = tmp_path / "backup.key"
    assert _nexa("keygen", "--backup", "--out", str(key_file)).returncode == 0
    cp = _started(tmp_path, "state", key_file, extra="interval_s = 1\n")
    try:
        # The first backups appear, and the metric names the newest.
        async def made(n: int) -> bool:
            return len(await _events(cp, "backup.created")) >= n

        await wait_for(lambda: made(1), timeout_s=SCHEDULE_TIMEOUT_S)
        first = await _metric(cp, "nexa_backup_last_success_timestamp_seconds")
        assert first > 0
        assert await _metric(cp, "nexa_backup_interval_seconds") == 1

        async def advanced() -> bool:
            return await _metric(cp, "nexa_backup_last_success_timestamp_seconds") > first

        await wait_for(advanced, timeout_s=SCHEDULE_TIMEOUT_S)

        # keep = 2: once four are made, the oldest two are gone and two stay (a third exists
        # only while the next one is written, before its prune).
        directory = cp.state_dir / "backups"

        async def pruned() -> bool:
            names = [e["target"] for e in await _events(cp, "backup.created")]
            on_disk = _backup_files(directory)
            return len(names) >= 4 and len(on_disk) == 2 and set(on_disk) <= set(names[2:])

        await wait_for(pruned, timeout_s=SCHEDULE_TIMEOUT_S)

        # `nexa backup list` names what is on disk: keep (+ one while it is written), all made.
        listed = cp.cli("backup", "list", "--json")
        assert listed.returncode == 0, listed.stderr
        page = json.loads(listed.stdout)
        created = {e["target"] for e in await _events(cp, "backup.created")}
        assert 2 <= len(page["backups"]) <= 3 and page["next_cursor"] is None
        assert {b["name"] for b in page["backups"]} <= created
        assert all(e["actor_role"] is None and e["result"] == "ok" for e in await _events(cp, "backup.created"))
        table = cp.cli("backup", "list")
        assert table.returncode == 0 and table.stdout.splitlines()[0].split()[:3] == ["NAME", "CREATED_AT", "EPOCH"]
        one = cp.cli("backup", "list", "--limit", "1")
        assert one.returncode == 0 and len(one.stdout.splitlines()) == 2 and "more: --cursor" in one.stderr
        assert await _events(cp, "backup.failed") == []
        assert await _metric(cp, "nexa_backup_failures_total") == 0
    finally:
        cp.kill()


@pytest.mark.slow
async def test_a_failed_scheduled_backup_is_audited_with_its_code_and_counted(tmp_path: Path) -> None:
    key_file = tmp_path / "backup.key"
    assert _nexa("keygen", "--backup", "--out", str(key_file)).returncode == 0
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    cp = _started(tmp_path, "state", key_file, extra=f'interval_s = 1\ndir = "{blocker}/backups"\n')
    try:

        async def failed() -> bool:
            return bool(await _events(cp, "backup.failed"))

        await wait_for(failed, timeout_s=SCHEDULE_TIMEOUT_S)
        event = (await _events(cp, "backup.failed"))[0]
        assert event["actor_role"] is None and event["target"] == f"{blocker}/backups"
        detail = json.loads(event["detail"])
        assert detail == {"code": "os_error.ENOTDIR", "message": "Not a directory"}
        assert await _metric(cp, "nexa_backup_failures_total") >= 1
        assert await _metric(cp, "nexa_backup_last_success_timestamp_seconds") == 0
        assert await _events(cp, "backup.created") == []
        # Never the key: not in the audit chain's events, not in the log.
        secret = key_file.read_text().strip()
        assert secret not in json.dumps(await _events(cp, "backup.failed"))
        assert cp.stderr_path is not None and secret not in cp.stderr_path.read_text()
        assert "scheduled backup failed" in cp.stderr_path.read_text()
    finally:
        cp.kill()
