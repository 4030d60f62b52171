"""Config files: frozen attrs classes, unknown keys and bad values named, flags override the file."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from nexa import cli, config
from nexa.cli import entry, roles
from nexa.config import ControlConfig, LogLevel
from nexa.errors import ConfigError


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "control.toml"
    path.write_text(text)
    return path


def test_empty_file_gives_the_defaults(tmp_path: Path) -> None:
    cfg = config.load(write(tmp_path, ""), ControlConfig)
    assert cfg == ControlConfig()
    assert cfg.http.max_body_bytes == 1_048_576


def test_values_are_read(tmp_path: Path) -> None:
    cfg = config.load(
        write(
            tmp_path,
            'state_dir = "/srv/nexa"\n[http]\nlisten = "[::1]:9000"\ngraceful_timeout_s = 2.5\n'
            '[log]\nlevel = "debug"\n',
        ),
        ControlConfig,
    )
    assert cfg.state_dir == "/srv/nexa"
    assert cfg.http.listen == "[::1]:9000"
    assert cfg.http.graceful_timeout_s == 2.5
    assert cfg.log.level is LogLevel.DEBUG


def test_every_bad_or_unknown_key_is_named(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "colour = 1\n"
        "[http]\nlisten = 'nohost'\nmax_body_bytes = -5\ngraceful_timeout_s = 'soon'\ntimeout = 3\n"
        "[log]\nlevel = 'loud'\n"
        "[extra]\n",
    )
    with pytest.raises(ConfigError) as info:
        config.load(path, ControlConfig)
    problems = "\n".join(info.value.problems)
    for key in (
        "colour",
        "http.listen",
        "http.max_body_bytes",
        "http.graceful_timeout_s",
        "http.timeout",
        "log.level",
        "extra",
    ):
        assert f"{key}:" in problems, key
    assert len(info.value.problems) == 7


@pytest.mark.parametrize(
    ("text", "needle"),
    [
        ("[http]\nmax_body_bytes = true\n", "http.max_body_bytes"),
        ("[http]\ngraceful_timeout_s = 0\n", "http.graceful_timeout_s"),
        ("[http]\nlisten = '127.0.0.1:70000'\n", "http.listen"),
        ("state_dir = 3\n", "state_dir"),
        ("http = 'x'\n", "http"),
        ("[http\n", "not valid TOML"),
    ],
)
def test_bad_values(tmp_path: Path, text: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        config.load(write(tmp_path, text), ControlConfig)


def test_check_config_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    good = write(tmp_path, "[http]\nlisten = '127.0.0.1:1'\n")
    assert cli.main(["check-config", str(good)]) == 0
    assert "ok" in capsys.readouterr().out
    bad = tmp_path / "bad.toml"
    bad.write_text("[http]\nlisten = '127.0.0.1:1'\nlistne = 'x'\n[bogus]\n")
    assert cli.main(["check-config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "http.listne: unknown key" in err and "bogus: unknown key" in err
    assert cli.main(["check-config", str(tmp_path / "missing.toml")]) == 2
    assert "cannot read" in capsys.readouterr().err


def test_check_config_without_a_role_checks_the_file_as_the_role_it_reads_as(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`nexa check-config units/node.toml` works as `--role node` does; a file neither role reads is
    reported as the closer one, with how to choose; `--role` still forces one."""
    node = tmp_path / "node.toml"
    node.write_text("inventory_path = '/etc/nexa/inventory.json'\n[container]\nengine = 'podman'\n")
    assert cli.main(["check-config", str(node)]) == 0
    assert "ok (node config)" in capsys.readouterr().out
    assert cli.main(["check-config", "--role", "control", str(node)]) == 2
    assert "inventory_path: unknown key" in capsys.readouterr().err
    bad = tmp_path / "bad-node.toml"
    bad.write_text("inventory_path = '/etc/nexa/inventory.json'\nheartbeat_interval_s = 1\nheartbeat_intervl_s = 2\n")
    assert cli.main(["check-config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "heartbeat_intervl_s: unknown key" in err and "read as a node config" in err and "--role" in err
    assert "inventory_path" not in err  # the node reading's problems only, not the controller's
    not_toml = tmp_path / "broken.toml"
    not_toml.write_text("[http\n")
    assert cli.main(["check-config", str(not_toml)]) == 2
    err = capsys.readouterr().err
    assert "not valid TOML" in err and "closer" not in err


def test_flags_override_the_file_and_are_validated(tmp_path: Path) -> None:
    path = write(tmp_path, "state_dir = '/from/file'\n[http]\nlisten = '127.0.0.1:1000'\ngraceful_timeout_s = 3\n")
    args = entry.parser().parse_args(["control", "--config", str(path), "--listen", "127.0.0.2:2000"])
    cfg = roles.control_config(args)
    assert cfg.http.listen == "127.0.0.2:2000"
    assert cfg.state_dir == "/from/file"
    assert cfg.http.graceful_timeout_s == 3
    args = entry.parser().parse_args(["control", "--config", str(path), "--state-dir", "/flag", "--log-level", "nope"])
    with pytest.raises(ConfigError, match=r"log\.level"):
        roles.control_config(args)


def test_config_objects_are_frozen() -> None:
    cfg = ControlConfig()
    with pytest.raises(AttributeError):
        cfg.state_dir = "/x"  # type: ignore[misc]


def test_the_channel_takes_host_port_as_http_listen_does() -> None:
    cfg = config.structure_config({"channel": {"listen": "127.0.0.1:8471", "advertise": "[::1]:8471"}}, ControlConfig)
    assert cfg.channel.listen == "tcp://127.0.0.1:8471"
    assert cfg.channel.advertise == "tcp://[::1]:8471"
    unchanged = config.structure_config({"channel": {"listen": "tcp://127.0.0.1:*"}}, ControlConfig)
    assert unchanged.channel.listen == "tcp://127.0.0.1:*" and unchanged.channel.advertise == ""


@pytest.mark.parametrize(
    "bad", ["8471", "127.0.0.1", ":8471", "127.0.0.1:70000", "127.0.0.1:x", "[zz]:8471", "ipc:///run/x", "tcp://"]
)
def test_a_channel_address_that_is_not_host_port_is_refused_by_name(bad: str) -> None:
    for key in ("listen", "advertise"):
        with pytest.raises(ConfigError, match=r"use HOST:PORT or tcp://HOST:PORT") as info:
            config.structure_config({"channel": {key: bad}}, ControlConfig)
        assert repr(bad) in info.value.message


@pytest.mark.parametrize(
    ("key", "bad"), [("gather_s", -0.001), ("gather_s", 0.5), ("idle_gather_s", -1.0), ("idle_gather_s", 2.0)]
)
def test_the_channel_gather_windows_are_bounded_and_refused_by_name(key: str, bad: float) -> None:
    """Wake-up moderation: 0 turns it off; a negative window, or one longer than a stream's token
    may wait (0.1 s) or a beat (1 s), is refused by name."""
    with pytest.raises(ConfigError, match=rf"channel: '{key}' must be"):
        config.structure_config({"channel": {key: bad}}, ControlConfig)
    off = config.structure_config({"channel": {"gather_s": 0, "idle_gather_s": 0.0}}, ControlConfig)
    assert (off.channel.gather_s, off.channel.idle_gather_s) == (0.0, 0.0)
    assert (ControlConfig().channel.gather_s, ControlConfig().channel.idle_gather_s) == (0.002, 0.025)


@pytest.mark.parametrize("bad", [-0.001, 0.5])
def test_the_agents_gather_window_is_bounded_and_refused_by_name(bad: float) -> None:
    """The agent's wake-up moderation (`[relay] gather_s`): 0 turns it off; a negative window, or
    one longer than a streamed token may wait (0.1 s), is refused by name."""
    with pytest.raises(ConfigError, match=r"relay: 'gather_s' must be"):
        config.structure_config({"relay": {"gather_s": bad}}, config.NodeConfig)
    assert config.structure_config({"relay": {"gather_s": 0}}, config.NodeConfig).relay.gather_s == 0.0
    assert config.NodeConfig().relay.gather_s == 0.005


@pytest.mark.parametrize(
    ("value", "needle"),
    [
        ("['']", "evidence: trusted_report_keys: an empty key"),
        ("['not base64!']", r"evidence\.trusted_report_keys\[0\]: not valid base64"),
        ("['AAAA']", r"evidence\.trusted_report_keys\[0\]: an Ed25519 public key is 32 bytes"),
        ("'x'", r"evidence\.trusted_report_keys: expected a list"),
    ],
)
def test_trusted_report_keys_must_be_public_keys(tmp_path: Path, value: str, needle: str) -> None:
    """Issue 30 point 10: the release pipeline's keys, each named when it is not an Ed25519 public key."""
    with pytest.raises(ConfigError, match=needle):
        config.load(write(tmp_path, f"[evidence]\ntrusted_report_keys = {value}\n"), ControlConfig)
    key = "A" * 43 + "="
    loaded = config.load(write(tmp_path, f"[evidence]\ntrusted_report_keys = ['{key}']\n"), ControlConfig)
    assert loaded.evidence.trusted_report_keys == (key,)


# --- the engine's settings: [container], and the deprecated [podman] table --------------------------

_OLD_PODMAN = (
    '[podman]\nsocket = "/run/p.sock"\nregistry_tls_verify = false\nregistry_credentials_file = "/etc/nexa/r.json"\n'
    'leave_running_on_exit = false\nprivate_network = "bridge"\n'
)


def _engine_settings(cfg: config.NodeConfig) -> tuple[object, ...]:
    c = cfg.container
    return (
        c.socket_path,
        c.registry_tls_verify,
        c.registry_credentials_file,
        c.leave_running_on_exit,
        c.private_network,
    )


def test_the_engine_settings_are_read_from_the_container_table(tmp_path: Path) -> None:
    new = _OLD_PODMAN.replace("[podman]", "[container]")
    cfg = config.load(write(tmp_path, new), config.NodeConfig)
    assert _engine_settings(cfg) == ("/run/p.sock", False, "/etc/nexa/r.json", False, "bridge")
    assert config.NodeConfig().container.socket_path == "/run/podman/podman.sock"


def test_the_old_podman_table_still_works_and_logs_each_deprecation_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.WARNING, logger="nexa.config"):
        cfg = config.load(write(tmp_path, _OLD_PODMAN), config.NodeConfig)
    assert _engine_settings(cfg) == ("/run/p.sock", False, "/etc/nexa/r.json", False, "bridge")
    lines = [r.getMessage() for r in caplog.records]
    assert lines.count("[podman] socket is deprecated: write it as [container] socket") == 1
    for key in ("registry_tls_verify", "registry_credentials_file", "leave_running_on_exit", "private_network"):
        assert lines.count(f"[podman] {key} is deprecated: write it as [container] {key}") == 1, key
    assert len(lines) == 5
    # The same file read as the node agent reads it (its flags merged in) says so once, not twice.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="nexa.config"):
        args = entry.parser().parse_args(["node", "--config", str(tmp_path / "control.toml")])
        assert roles._node_config(args).container.socket_path == "/run/p.sock"
    assert len(caplog.records) == 5


def test_podman_s_socket_is_not_docker_s(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """`[podman] socket` was never read with engine = "docker": it does not become Docker's socket."""
    with caplog.at_level(logging.WARNING, logger="nexa.config"):
        cfg = config.load(
            write(tmp_path, '[container]\nengine = "docker"\n[podman]\nsocket = "/run/podman/podman.sock"\n'),
            config.NodeConfig,
        )
    assert cfg.container.socket_path == "/var/run/docker.sock"
    assert [r.getMessage() for r in caplog.records] == [
        '[podman] socket is deprecated and not read with [container] engine = "docker": delete it'
    ]


@pytest.mark.parametrize("key", ["socket = '/a.sock'", "registry_tls_verify = false", "private_network = 'bridge'"])
def test_a_key_in_both_tables_is_a_config_error(tmp_path: Path, key: str) -> None:
    name = key.partition(" ")[0]
    with pytest.raises(ConfigError, match=rf"podman\.{name}: also set as container\.{name}") as info:
        config.load(write(tmp_path, f"[container]\n{key}\n[podman]\n{key}\n"), config.NodeConfig)
    assert f"keep only [container] {name}" in info.value.message


def test_a_key_the_podman_table_never_had_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"podman\.engine: unknown key"):
        config.load(write(tmp_path, "[podman]\nengine = 'docker'\n"), config.NodeConfig)
