"""The operator CLI against a controller running as its own process, as an operator would use them."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from nexa.contracts.models import ModelFormat
from nexa.contracts.node import RuntimeKind
from tests.conftest import ControllerProcess, require_tool


def test_first_start_prints_url_and_admin_key(controller_process: ControllerProcess) -> None:
    assert controller_process.admin_key is not None
    assert controller_process.admin_key.startswith("nxk_")
    out = controller_process.cli("keys", "list")
    assert out.returncode == 0, out.stderr
    assert "bootstrap admin" in out.stdout and "admin" in out.stdout


@pytest.mark.slow
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


@pytest.mark.slow
def test_control_characters_a_client_chose_never_reach_the_terminal_raw(controller_process: ControllerProcess) -> None:
    """Issue 30 point 8: a tenant's display name and a key's name with an escape sequence that would
    retitle or clear the terminal, a bell and a right-to-left override are printed as escapes."""
    cp = controller_process
    evil = "Evil\x1b]0;pwned\x07\u202eName\x1b[2J"
    assert cp.cli("tenants", "create", "evil", "--display-name", evil).returncode == 0
    assert cp.cli("keys", "create", "--role", "audit", "--name", evil).returncode == 0
    for argv in (("tenants", "list"), ("keys", "list"), ("tenants", "list", "--json"), ("audit", "list")):
        out = cp.cli(*argv)
        assert out.returncode == 0, out.stderr
        assert not any(c in out.stdout for c in "\x1b\x07\u202e"), argv
    table = cp.cli("tenants", "list").stdout
    assert "Evil\\x1b]0;pwned\\x07\\u202eName\\x1b[2J" in table
    # JSON keeps the value itself (escaped the JSON way), for a program to read back.
    tenants = json.loads(cp.cli("tenants", "list", "--json").stdout)["tenants"]
    assert [t["display_name"] for t in tenants] == [evil]
    # An error that quotes what a client sent is escaped too.
    refused = cp.cli("tenants", "create", "evil", "--display-name", evil)
    assert refused.returncode != 0 and "\x1b" not in refused.stderr


@pytest.mark.slow
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


@pytest.mark.slow
def test_audit_list_and_verify(controller_process: ControllerProcess) -> None:
    cp = controller_process
    cp.cli("tenants", "create", "t1", check=True)
    cp.cli("tenants", "create", "t2", check=True)
    listing = cp.cli("audit", "list", "--action", "tenant.create")
    assert listing.returncode == 0
    assert "tenant/t1" in listing.stdout and "tenant/t2" in listing.stdout
    page = json.loads(cp.cli("audit", "list", "--limit", "1", "--json").stdout)
    assert [e["seq"] for e in page["events"]] == [1] and isinstance(page["next_cursor"], str)
    ok = cp.cli("audit", "verify")
    assert ok.returncode == 0 and "audit chain ok: 3 events verified" in ok.stdout


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_sigterm_exits_zero_and_sigint_too(controller_process: ControllerProcess) -> None:
    assert controller_process.stop(signal.SIGTERM) == 0
    controller_process.start()
    assert controller_process.stop(signal.SIGINT) == 0


def test_version_and_help() -> None:
    out = subprocess.run([sys.executable, "-m", "nexa", "version"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.startswith("nexa ")
    bare = subprocess.run([sys.executable, "-m", "nexa"], capture_output=True, text=True, timeout=60)
    assert bare.returncode == 2 and "control" in bare.stderr


@pytest.mark.parametrize(
    ("noun", "flag", "wanted"),
    [("runtimes", "--kind", {str(k) for k in RuntimeKind}), ("models", "--format", {str(f) for f in ModelFormat})],
)
def test_register_takes_every_kind_and_format_whisper_cpp_too(noun: str, flag: str, wanted: set[str]) -> None:
    """The controller takes every `RuntimeKind` and `ModelFormat`; the CLI once offered hand-kept lists
    without whisper.cpp's `whispercpp` and `ggml`."""
    out = subprocess.run(
        [sys.executable, "-m", "nexa", noun, "register", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0
    choices = out.stdout.split(f"{flag} {{", 1)[1].split("}", 1)[0]
    assert set(choices.split(",")) == wanted, choices


@pytest.mark.slow  # about 20 CLI runs: 28 s on a busy 2-core machine
def test_list_commands_page_with_cursor_and_limit(controller_process: ControllerProcess) -> None:
    cp = controller_process
    for name in ("p1", "p2", "p3"):
        cp.cli("tenants", "create", name, check=True)
    first = cp.cli("audit", "list", "--limit", "2")
    assert first.returncode == 0, first.stderr
    assert "tenant/p1" in first.stdout and "tenant/p2" not in first.stdout  # seq 1: the admin key
    (more,) = [line for line in first.stderr.splitlines() if line.startswith("more: --cursor ")]
    cursor = more.removeprefix("more: --cursor ")
    second = json.loads(cp.cli("audit", "list", "--limit", "2", "--cursor", cursor, "--json").stdout)
    assert [e["target"] for e in second["events"]] == ["tenant/p2", "tenant/p3"]
    # The deprecated `--after SEQ` still reads (hidden from --help).
    after = json.loads(cp.cli("audit", "list", "--after", "2", "--limit", "1", "--json").stdout)
    assert [e["target"] for e in after["events"]] == ["tenant/p2"]
    assert "--after" not in cp.cli("audit", "list", "--help").stdout
    tenants = json.loads(cp.cli("tenants", "list", "--limit", "2", "--json").stdout)
    assert [t["id"] for t in tenants["tenants"]] == ["p1", "p2"] and tenants["next_cursor"]
    last = cp.cli("tenants", "list", "--cursor", tenants["next_cursor"])
    assert [line.split()[0] for line in last.stdout.splitlines()[1:]] == ["p3"] and "more:" not in last.stderr

    for _ in range(2):
        cp.cli("keys", "create", "--role", "audit", check=True)
    keys = cp.cli("keys", "list", "--limit", "2", "--json")
    page = json.loads(keys.stdout)
    assert len(page["keys"]) == 2 and page["next_cursor"]
    rest = json.loads(cp.cli("keys", "list", "--cursor", page["next_cursor"], "--json").stdout)
    assert len(rest["keys"]) == 1 and rest["next_cursor"] is None
    ids = {k["id"] for k in page["keys"]} | {k["id"] for k in rest["keys"]}
    assert len(ids) == 3
    human = cp.cli("keys", "list", "--limit", "1")
    assert len(human.stdout.splitlines()) == 2 and human.stderr.startswith("more: --cursor ")
    bad = cp.cli("nodes", "list", "--cursor", "not-a-cursor")
    assert bad.returncode == 1 and "invalid_request" in bad.stderr


#: `nexa quotas show`'s head: the limits, then the use (media use in its units, then each adapter's, last).
QUOTA_HEAD = (
    "TENANT CONCURRENT RPM TPM TPD IN_FLIGHT REQ_1M TOK_1M TOK_TODAY AUDIO_S_TODAY SPEECH_CHARS_TODAY IMAGES_TODAY"
    " ADAPTER_TOK_TODAY"
)


@pytest.mark.slow  # every list and show through the CLI: 21-27 s
def test_every_list_and_show_renders_its_table(controller_process: ControllerProcess) -> None:
    """Through the real CLI against a real controller: each resource's table has its columns."""
    cp = controller_process
    cp.cli("tenants", "create", "acme", "--display-name", "Acme", check=True)
    quota_set = ("quotas", "set", "acme", "--rpm", "60", "--tpd", "1000")
    cp.cli(*quota_set, "--adapter-tokens-per-day", "ner=500", "--adapter-tokens-per-day", "tone=0", check=True)
    headers = {
        ("nodes", "list"): "ID STATE HEARTBEAT LABELS ACCELERATORS FREE_MEMORY ASSIGNMENTS",
        ("keys", "list"): "ID ROLE TENANT NAME STATE CREATED_AT EXPIRES_AT",
        ("tenants", "list"): "ID DISPLAY_NAME CREATED_AT",
        ("runtimes", "list"): "NAME KIND VERSION IMAGE REGISTERED_AT",
        ("models", "list"): "NAME VERSION STATE FORMAT SIZE MEMORY LICENSE REGISTERED_AT",
        ("aliases", "list"): "ALIAS TARGET GENERATION UPDATED_AT",
        ("deployments", "list"): "NAME MODEL RUNTIME REPLICAS NODES PROBLEM",
        ("quotas", "show"): QUOTA_HEAD,
        ("quotas", "show", "acme"): QUOTA_HEAD,
        ("usage",): "DAY TENANT MODEL REQUESTS ERRORS PROMPT_TOKENS COMPLETION_TOKENS AUDIO_SECONDS"
        " SPEECH_CHARACTERS IMAGES",
        ("audit", "list"): "SEQ TIME ACTION TARGET ACTOR_KEY_ID ACTOR_ROLE RESULT",
    }
    for argv, header in headers.items():
        out = cp.cli(*argv)
        assert out.returncode == 0, (argv, out.stderr)
        lines = out.stdout.splitlines()
        assert " ".join(lines[0].split()) == header, argv
        if argv[0] in {"nodes", "runtimes", "models", "aliases", "deployments", "usage"}:
            assert lines[1:] == ["(none)"], argv
        as_json = json.loads(cp.cli(*argv, "--json").stdout)
        assert isinstance(as_json, dict), argv
    quota = cp.cli("quotas", "show", "acme").stdout.splitlines()[1].split()
    assert quota[:5] == ["acme", "-", "60", "-", "1000"]
    assert quota[-1] == "ner=0/500,tone=0/0"
    # Bad adapter limits say what to do; the controller's refusal changes nothing.
    malformed = cp.cli(*quota_set, "--adapter-tokens-per-day", "ner")
    assert malformed.returncode == 2 and "not NAME=N: 'ner'" in malformed.stderr
    superscript = cp.cli(*quota_set, "--adapter-tokens-per-day", "ner=\u00b2")  # isdigit, yet no int
    assert superscript.returncode == 2 and "not NAME=N" in superscript.stderr
    twice = cp.cli(*quota_set, "--adapter-tokens-per-day", "ner=1", "--adapter-tokens-per-day", "ner=2")
    assert twice.returncode == 1 and "give each one once" in twice.stderr
    refused = cp.cli(*quota_set, "--adapter-tokens-per-day", "Ner:1=5")
    assert refused.returncode == 1 and "adapter_tokens_per_day['Ner:1']" in refused.stderr, refused.stderr
    assert cp.cli("quotas", "show", "acme").stdout.splitlines()[1].split()[-1] == "ner=0/500,tone=0/0"
    assert "Acme" in cp.cli("tenants", "list").stdout
    missing = cp.cli("runtimes", "show", "nope")
    assert missing.returncode == 1 and "not_found" in missing.stderr
    assert cp.cli("nodes", "show", "nope").returncode == 1


@pytest.mark.slow
def test_control_takes_the_channel_as_host_port(controller_process: ControllerProcess, tmp_path: Path) -> None:
    cp = controller_process
    assert cp.stop() == 0
    cp.start("--channel", f"127.0.0.1:{cp.channel_port}")
    with socket.create_connection(("127.0.0.1", cp.channel_port), timeout=5):
        pass  # the node channel is bound where HOST:PORT said
    refused = subprocess.run(
        [sys.executable, "-m", "nexa", "control", "--state-dir", str(tmp_path / "other"), "--channel", "8471"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2, refused.stderr
    assert "use HOST:PORT or tcp://HOST:PORT" in refused.stderr and "Traceback" not in refused.stderr
    assert not (tmp_path / "other").exists()
