"""The shipped systemd units and example configs: `systemd-analyze verify` clean, configs valid.

`systemd-analyze verify` exits 0 on unknown keys and bad values and only warns on stderr
(REAL_PARTS.md §8), so a unit passes only with exit 0 AND an empty stderr. It also insists that
ExecStart's binary exists, so each unit is checked from a copy whose /usr/local/bin/nexa points
at a nexa that exists here.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest

from nexa import config

ROOT = Path(__file__).resolve().parent.parent
UNITS = ROOT / "units"
INSTALLED_BINARY = "/usr/local/bin/nexa"
UNIT_NAMES = ("nexa-control.service", "nexa-node.service")
EXEC_START = {
    "nexa-control.service": f"{INSTALLED_BINARY} control --config /etc/nexa/control.toml",
    "nexa-node.service": f"{INSTALLED_BINARY} node --config /etc/nexa/node.toml",
}
#: `systemd-analyze security` exposure (0 = locked down, 10 = fully exposed) the units stay under.
MAX_EXPOSURE = 2.5


def _systemd_analyze() -> str:
    path = shutil.which("systemd-analyze")
    if path is None:
        if os.environ.get("CI") == "true":
            pytest.fail("systemd-analyze is missing; CI must install systemd to check units/*.service")
        pytest.skip("systemd-analyze is not installed")
    return path


def _local_nexa() -> str:
    """A nexa executable present on this machine: $NEXA_BINARY, dist/nexa, else the venv's script."""
    for candidate in (os.environ.get("NEXA_BINARY"), str(ROOT / "dist" / "nexa")):
        if candidate and os.access(candidate, os.X_OK):
            return str(Path(candidate).resolve())
    script = Path(sys.executable).parent / "nexa"
    if os.access(script, os.X_OK):
        return str(script)
    found = shutil.which("nexa")
    if found is None:
        pytest.fail("no nexa executable: build dist/nexa or install the package (pip install -e .)")
    return found


def _directives(text: str) -> list[tuple[str, str, str]]:
    """(section, key, value) in file order; systemd allows a key more than once, so no dict."""
    out: list[tuple[str, str, str]] = []
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            continue
        key, sep, value = line.partition("=")
        assert sep, f"not a key=value line: {raw!r}"
        out.append((section, key.strip(), value.strip()))
    return out


def _values(text: str, section: str, key: str) -> list[str]:
    return [v for s, k, v in _directives(text) if s == section and k == key]


def _one(text: str, section: str, key: str) -> str:
    values = _values(text, section, key)
    assert len(values) == 1, f"[{section}] {key}= appears {len(values)} times"
    return values[0]


def _local_copy(name: str, dest: Path) -> Path:
    """The unit with every Exec*= line's /usr/local/bin/nexa replaced by a nexa that exists here."""
    text = (UNITS / name).read_text(encoding="utf-8")
    binary = _local_nexa()
    lines = [
        line.replace(INSTALLED_BINARY, binary) if re.match(r"\s*Exec\w*=", line) else line
        for line in text.splitlines(keepends=True)
    ]
    copy = dest / name  # same file name: the unit name is part of what verify checks
    copy.write_text("".join(lines), encoding="utf-8")
    return copy


@pytest.mark.parametrize("name", UNIT_NAMES)
def test_unit_passes_systemd_analyze_verify(name: str, tmp_path: Path) -> None:
    analyze = _systemd_analyze()
    unit = _local_copy(name, tmp_path)
    proc = subprocess.run(
        [analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path
    )
    assert proc.returncode == 0, f"systemd-analyze verify {name} exited {proc.returncode}:\n{proc.stderr}"
    assert proc.stderr.strip() == "", f"systemd-analyze verify {name} warned:\n{proc.stderr}"


@pytest.mark.parametrize("name", UNIT_NAMES)
def test_unit_exposure_stays_low(name: str, tmp_path: Path) -> None:
    """`systemd-analyze security --offline` rates the sandbox; loosening it should be a visible choice."""
    analyze = _systemd_analyze()
    _assert_exposure_low(analyze, _local_copy(name, tmp_path))


def _assert_exposure_low(analyze: str, unit: Path) -> None:
    proc = subprocess.run(
        [analyze, "security", "--offline=true", "--no-pager", str(unit)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=unit.parent,
    )
    assert proc.returncode == 0, proc.stderr
    match = re.search(rf"Overall exposure level for {re.escape(unit.name)}: (\d+(?:\.\d+)?)", proc.stdout)
    assert match is not None, proc.stdout[-2000:]
    assert float(match.group(1)) <= MAX_EXPOSURE, proc.stdout


@pytest.mark.parametrize("name", UNIT_NAMES)
def test_unit_runs_the_installed_binary_sandboxed(name: str) -> None:
    text = (UNITS / name).read_text(encoding="utf-8")
    assert _one(text, "Service", "ExecStart") == EXEC_START[name]
    assert _one(text, "Service", "User") == "nexa"
    assert _one(text, "Service", "Group") == "nexa"
    assert _one(text, "Service", "KillSignal") == "SIGTERM"
    assert _one(text, "Service", "Restart") == "on-failure"
    required = {
        "ProtectSystem": "strict",
        "ProtectHome": "yes",
        "PrivateTmp": "yes",
        "NoNewPrivileges": "yes",
        "ProtectKernelTunables": "yes",
        "ProtectKernelModules": "yes",
        "ProtectControlGroups": "yes",
        "LockPersonality": "yes",
        "ConfigurationDirectory": "nexa",
        "CapabilityBoundingSet": "",
    }
    for key, value in required.items():
        assert _one(text, "Service", key) == value, key
    role = name.removeprefix("nexa-").removesuffix(".service")
    # The state dir the example config names is the one the sandbox leaves writable.
    assert _one(text, "Service", "StateDirectory") == f"nexa/{role}"
    families = set(_one(text, "Service", "RestrictAddressFamilies").split())
    assert families <= {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"}
    assert {"AF_UNIX", "AF_INET", "AF_INET6"} <= families


@pytest.mark.parametrize("name", UNIT_NAMES)
def test_stop_timeout_exceeds_the_graceful_drain(name: str) -> None:
    """systemd must not SIGKILL a process that is still draining within graceful_timeout_s."""
    text = (UNITS / name).read_text(encoding="utf-8")
    stop_s = float(_one(text, "Service", "TimeoutStopSec"))
    assert stop_s >= config.HttpConfig().graceful_timeout_s + 10


def test_node_unit_orders_after_podman_and_the_network() -> None:
    text = (UNITS / "nexa-node.service").read_text(encoding="utf-8")
    wants = " ".join(_values(text, "Unit", "Wants")).split()
    after = " ".join(_values(text, "Unit", "After")).split()
    assert "podman.socket" in wants
    assert {"podman.socket", "network-online.target"} <= set(after)


DOCKER_DROP_IN = UNITS / "nexa-node.service.d" / "docker.conf"


def test_node_unit_with_the_docker_drop_in_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    """The Docker Engine variant (DGX OS): nexa-node.service plus nexa-node.service.d/docker.conf,
    which verify loads from beside the unit."""
    analyze = _systemd_analyze()
    unit = _local_copy("nexa-node.service", tmp_path)
    drop_ins = tmp_path / "nexa-node.service.d"
    drop_ins.mkdir()
    shutil.copy(DOCKER_DROP_IN, drop_ins / DOCKER_DROP_IN.name)
    proc = subprocess.run(
        [analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path
    )
    assert proc.returncode == 0, f"systemd-analyze verify exited {proc.returncode}:\n{proc.stderr}"
    assert proc.stderr.strip() == "", f"systemd-analyze verify warned:\n{proc.stderr}"


FABRIC_DROP_IN = UNITS / "nexa-node.service.d" / "fabric.conf"


def test_node_unit_with_the_fabric_drop_in_passes_verify_and_gives_cap_net_admin_only(tmp_path: Path) -> None:
    """The fabric firewall's drop-in (nft needs CAP_NET_ADMIN): verified beside the base unit and the
    Docker drop-in, and the one capability it gives is CAP_NET_ADMIN, bounding and ambient."""
    analyze = _systemd_analyze()
    unit = _local_copy("nexa-node.service", tmp_path)
    drop_ins = tmp_path / "nexa-node.service.d"
    drop_ins.mkdir()
    for drop_in in (DOCKER_DROP_IN, FABRIC_DROP_IN):
        shutil.copy(drop_in, drop_ins / drop_in.name)
    proc = subprocess.run(
        [analyze, "verify", str(unit)], capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path
    )
    assert proc.returncode == 0, f"systemd-analyze verify exited {proc.returncode}:\n{proc.stderr}"
    assert proc.stderr.strip() == "", f"systemd-analyze verify warned:\n{proc.stderr}"
    text = FABRIC_DROP_IN.read_text(encoding="utf-8")
    assert _values(text, "Service", "CapabilityBoundingSet") == ["CAP_NET_ADMIN"]
    assert _values(text, "Service", "AmbientCapabilities") == ["CAP_NET_ADMIN"]
    settings = [line for line in text.splitlines() if line and not line.startswith("#")]
    assert settings == [
        "[Service]",
        *(f"{key}=CAP_NET_ADMIN" for key in ("CapabilityBoundingSet", "AmbientCapabilities")),
    ]


def test_docker_drop_in_orders_after_docker_and_swaps_the_socket_group() -> None:
    text = DOCKER_DROP_IN.read_text(encoding="utf-8")
    assert _values(text, "Unit", "Requires") == ["docker.service"]
    assert _values(text, "Unit", "After") == ["docker.service"]
    # The empty assignment resets the base unit's nexa-podman group; then only docker.
    assert _values(text, "Service", "SupplementaryGroups") == ["", "docker"]
    assert {section for section, _, _ in _directives(text)} == {"Unit", "Service"}


def _check_config(path: Path, *role: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nexa", "check-config", *role, str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


@pytest.mark.parametrize(("name", "role"), [("control.toml", ()), ("node.toml", ("--role", "node"))])
def test_example_config_passes_check_config(name: str, role: tuple[str, ...]) -> None:
    proc = _check_config(UNITS / name, *role)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"{UNITS / name}: ok" + ("" if role else " (control config)")  # no --role: found


def _leaves(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict):
            out.update(_leaves(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


@pytest.mark.parametrize(("name", "cls"), [("control.toml", config.ControlConfig), ("node.toml", config.NodeConfig)])
def test_example_config_shows_every_key_with_its_default(name: str, cls: type[Any]) -> None:
    """The examples document the whole config: a key added to config.py must appear here too.

    A key whose default is None cannot be written in TOML; it must appear commented out.
    """
    text = (UNITS / name).read_text(encoding="utf-8")
    shown = _leaves(tomllib.loads(text))
    defaults = _leaves(config.unstructure_config(cls()))
    assert set(shown) <= set(defaults)  # check-config enforces this too; repeated for a clear diff
    for key, default in defaults.items():
        if default is None:
            leaf = key.rpartition(".")[2]
            assert re.search(rf"^# {re.escape(leaf)} = ", text, re.MULTILINE), f"{key} is not shown (commented out)"
            continue
        assert key in shown, f"{name} does not show {key} (default {default!r})"
        assert shown[key] == default, f"{name}: {key} = {shown[key]!r}, but the default is {default!r}"


def test_example_control_config_state_dir_matches_the_unit() -> None:
    data = tomllib.loads((UNITS / "control.toml").read_text(encoding="utf-8"))
    unit = (UNITS / "nexa-control.service").read_text(encoding="utf-8")
    assert data["state_dir"] == "/var/lib/" + _one(unit, "Service", "StateDirectory")
    node = tomllib.loads((UNITS / "node.toml").read_text(encoding="utf-8"))
    node_unit = (UNITS / "nexa-node.service").read_text(encoding="utf-8")
    assert node["state_dir"] == "/var/lib/" + _one(node_unit, "Service", "StateDirectory")


# The template unit for several gateway workers on one host (`nexa-control@N.service`, one config each).
TEMPLATE = "nexa-control@.service"


def test_template_unit_instance_passes_systemd_analyze_verify_and_security(tmp_path: Path) -> None:
    analyze = _systemd_analyze()
    _local_copy(TEMPLATE, tmp_path)
    instance = str(tmp_path / "nexa-control@1.service")  # loaded from the template beside it
    proc = subprocess.run(
        [analyze, "verify", instance], capture_output=True, text=True, timeout=60, check=False, cwd=tmp_path
    )
    assert (proc.returncode, proc.stderr.strip()) == (0, ""), proc.stderr
    _assert_exposure_low(analyze, Path(instance))


@pytest.mark.slow
def test_template_unit_is_the_controller_unit_with_a_config_per_instance() -> None:
    single = (UNITS / "nexa-control.service").read_text(encoding="utf-8")
    template = (UNITS / TEMPLATE).read_text(encoding="utf-8")
    assert _one(template, "Service", "ExecStart") == f"{INSTALLED_BINARY} control --config /etc/nexa/control-%i.toml"
    assert "%i" in _one(template, "Unit", "Description")

    def rest(text: str) -> list[tuple[str, str, str]]:
        return [d for d in _directives(text) if d[1] not in {"ExecStart", "Description"}]

    assert rest(template) == rest(single)  # the same sandbox, restart policy and state directory
    # Every instance's state_dir is the one directory the unit leaves writable.
    state_dir = config.load(UNITS / "control-worker.toml", config.ControlConfig).state_dir
    assert state_dir == "/var/lib/" + _one(template, "Service", "StateDirectory")
