"""`nexa node doctor`: checks that this host can run the node agent, before it is enrolled and after.

Each check returns one `CheckResult` and never raises for what it finds: a broken part is a `fail`
result with its fix. It only reads: nothing is written, created or started. Paths, the CDI
directories, the disk threshold and the controller fetch are arguments, so tests inject faults.
The report stays on this host (it is printed, never sent), so it may name local paths.
"""

from __future__ import annotations

import email.utils
import logging
import os
import shutil
import stat
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Final

import attrs
import trio

from nexa import security
from nexa.config import NodeConfig, NodesConfig, parse_host_port
from nexa.contracts import codec
from nexa.contracts.api import VersionInfo
from nexa.contracts.doctor import CheckResult, CheckStatus, DoctorReport, report
from nexa.contracts.node import CDI_NVIDIA_GPU, Gpu
from nexa.errors import CertificateNotTrusted, ConfigError, ContractError, EngineError, NexaError, Unavailable
from nexa.node import firewall, identity, inventory
from nexa.node.engines.configured import configured_engine
from nexa.node.engines.docker import GPU_NVIDIA_RUNTIME, DockerEngine
from nexa.node.engines.interface import EngineTransport
from nexa.node.probe import HttpProbe, http_url_host
from nexa.tls import CLIENT_FIX

log = logging.getLogger(__name__)

#: Where CDI specs live (the CDI specification's static and dynamic directories).
DEFAULT_CDI_DIRS: Final = ("/etc/cdi", "/var/run/cdi")
#: Free space the artifact cache's filesystem must have (`--min-free-gib`): one large model.
DEFAULT_MIN_FREE_BYTES: Final = 50 * 1024**3
#: Free space the runtime caches' filesystem must have (`--min-cache-free-gib`): what vLLM and SGLang
#: write at warm-up (torch.compile, Triton, FlashInfer, CUDA) for a few models, with room to spare.
DEFAULT_MIN_CACHE_FREE_BYTES: Final = 10 * 1024**3
#: The runtime caches live in the state directory (one directory per image, model and settings).
RUNTIME_CACHE_DIR: Final = "runtime-cache"
#: How to turn CDI on in Docker 25 to 27 (28 and later have it on by default).
DOCKER_CDI_FIX: Final = (
    'add "features": {"cdi": true} to /etc/docker/daemon.json and `sudo systemctl restart docker` '
    '(Docker 25 or later), or set [container] gpu_method = "nvidia-runtime"'
)
#: Reaching the controller or its channel over the management network.
NETWORK_TIMEOUT_S: Final = 5.0
#: A local engine socket answers at once or is broken.
ENGINE_TIMEOUT_S: Final = 10.0
#: Files in the state directory that hold secrets or the fence: 0600, owned by the agent's user.
PRIVATE_FILES: Final = (
    identity.SIGNING_KEY_FILE,
    f"{identity.CURVE_KEY_NAME}.key",
    identity.ENROLLMENT_FILE,
    identity.FENCE_FILE,
)
CDI_FIX: Final = "sudo nvidia-ctk cdi generate --output=/etc/cdi/nvidia.yaml"
NTP_FIX: Final = (
    "sync the clocks: `timedatectl set-ntp true` (systemd-timesyncd or chrony) on this node and the controller"
)
#: A Date header counts whole seconds.
_DATE_RESOLUTION_S: Final = 1.0
_MAX_SPEC_BYTES: Final = 4 * 1024 * 1024


@attrs.frozen(kw_only=True)
class DoctorOptions:
    """What the command line adds to node.toml."""

    #: `http(s)://host:port` of `nexa control`; empty: the URL recorded at enrollment (if any).
    controller_url: str = ""
    #: A fingerprint to expect (normalised, `security.parse_controller_fingerprint`); before
    #: enrollment the only thing the controller's fingerprint can be compared with.
    controller_fingerprint: str | None = None
    min_free_bytes: int = DEFAULT_MIN_FREE_BYTES
    cdi_dirs: tuple[str, ...] = DEFAULT_CDI_DIRS
    meminfo_path: str = inventory.DEFAULT_MEMINFO_PATH
    min_cache_free_bytes: int = DEFAULT_MIN_CACHE_FREE_BYTES


@attrs.frozen(kw_only=True)
class ControllerAnswer:
    """The controller's `GET /version`, with when it was asked and answered on this node's clock."""

    version: VersionInfo
    #: The Date header (Unix seconds, whole), for a controller that does not report `now`.
    date: float | None
    sent_at: float
    received_at: float


FetchVersion = Callable[[str], Awaitable[ControllerAnswer]]


def check_controller_url(url: str) -> str:
    """The URL without a trailing `/`; ConfigError unless it is http(s)://host[:port]."""
    if not http_url_host(url):
        raise ConfigError(f"--controller must be an http:// or https:// URL of `nexa control`, not {url[:200]!r}")
    return url.rstrip("/")


async def fetch_version(url: str) -> ControllerAnswer:
    """`GET {url}/version`. Raises Unavailable when it cannot be reached or is not a nexa controller."""
    async with HttpProbe(timeout_s=NETWORK_TIMEOUT_S, trust_env=True) as probe:
        sent_at = time.time()
        try:
            resp = await probe.get(f"{url}/version", headers={"Accept": "application/json"})
        except Unavailable as exc:
            raise Unavailable(f"cannot reach the controller at {url}: {exc.message}") from None
        received_at = time.time()
    if resp.status != 200:
        raise Unavailable(f"{url}/version answered {resp.status}: not a nexa controller?")
    try:
        version = codec.loads(codec.api, resp.content, VersionInfo)
    except ContractError as exc:
        raise Unavailable(f"{url}/version is not a nexa controller's answer: {exc.message}") from None
    return ControllerAnswer(
        version=version, date=_date(resp.headers.get("date")), sent_at=sent_at, received_at=received_at
    )


def _date(header: str | None) -> float | None:
    if not header:
        return None
    try:
        return email.utils.parsedate_to_datetime(header).timestamp()
    except (TypeError, ValueError):
        return None


async def run_doctor(
    cfg: NodeConfig,
    opts: DoctorOptions,
    *,
    fetch: FetchVersion = fetch_version,
    engine_transport: EngineTransport | None = None,
) -> DoctorReport:
    """Run every check in a fixed order (one result each) and return the report."""
    state_dir = Path(cfg.state_dir)
    record: identity.EnrollmentRecord | None = None
    damaged = ""
    try:
        if identity.is_enrolled(state_dir):
            record = identity.load_enrollment(state_dir)
    except ConfigError as exc:
        damaged = exc.message
    results = [check_state_dir(state_dir, record=record, damaged=damaged)]
    results.append(await check_engine(cfg, transport=engine_transport))
    if cfg.container.engine == "docker" and cfg.container.gpu_method == "cdi":
        results.append(await check_docker_cdi(cfg, transport=engine_transport))
    discovered = await inventory.discover(
        cfg.nvidia_smi or None, meminfo_path=opts.meminfo_path, sysfs_path=cfg.sysfs_path
    )
    results.append(check_nvidia(cfg, discovered.gpus, discovered.problems))
    results.append(check_cdi(cfg, discovered.gpus, opts.cdi_dirs))
    results.append(check_disk(cfg, opts.min_free_bytes))
    results.append(check_cache_disk(cfg, opts.min_cache_free_bytes))
    results.append(await check_firewall(cfg))
    results.extend(await check_controller(opts, record, fetch))
    # With several controllers (`controllers`), one result for each one's channel endpoint.
    results.extend([await check_channel(cfg, record, endpoint) for endpoint in cfg.controllers or [None]])
    return report(tuple(results), node_id=record.node_id if record is not None else "")


def render_text(rep: DoctorReport) -> list[str]:
    """The report as the command prints it: one line per check, each fix on the line after."""
    lines: list[str] = []
    for check in rep.checks:
        label = "FAIL" if check.status is CheckStatus.FAIL else check.status.value
        lines.append(f"{label:<4}  {check.name:<11}  {check.detail}")
        if check.fix and check.status is not CheckStatus.OK:
            lines.append(f"{'':<4}  {'':<11}  fix: {check.fix}")
    return lines


def _ok(name: str, detail: str) -> CheckResult:
    return CheckResult(name=name, status=CheckStatus.OK, detail=detail)


def _warn(name: str, detail: str, fix: str = "") -> CheckResult:
    return CheckResult(name=name, status=CheckStatus.WARN, detail=detail, fix=fix)


def _fail(name: str, detail: str, fix: str = "") -> CheckResult:
    return CheckResult(name=name, status=CheckStatus.FAIL, detail=detail, fix=fix)


def _gib(n: int) -> str:
    return f"{n / 1024**3:.1f} GiB"


# --- the state directory ----------------------------------------------------------------------


def check_state_dir(state_dir: Path, *, record: identity.EnrollmentRecord | None, damaged: str = "") -> CheckResult:
    """The directory 0700 and the key, enrollment and fence files 0600, all owned by this user."""
    name = "state_dir"
    uid = os.geteuid()
    try:
        st = state_dir.stat()
    except FileNotFoundError:
        return _warn(
            name,
            f"{state_dir} does not exist yet (not enrolled)",
            f"`nexa node enroll` creates it; or: install -d -m 0700 -o <agent user> {state_dir}",
        )
    except OSError as exc:
        return _fail(name, f"cannot look at {state_dir}: {exc.strerror}", "run the doctor as the agent's user")
    if not stat.S_ISDIR(st.st_mode):
        return _fail(name, f"{state_dir} is not a directory", f"remove it; `nexa node enroll` creates {state_dir}")
    problems: list[str] = []
    chmods: list[str] = []
    if st.st_uid != uid:
        problems.append(f"{state_dir} is owned by uid {st.st_uid}, not uid {uid} (this user)")
    if stat.S_IMODE(st.st_mode) & 0o077:
        problems.append(f"{state_dir} has mode {stat.S_IMODE(st.st_mode):04o}, not 0700")
        chmods.append(f"chmod 0700 {state_dir}")
    for file_name in PRIVATE_FILES:
        _check_private_file(state_dir / file_name, uid, problems, chmods)
    if damaged:
        problems.append(damaged)
    if problems:
        fixes = [*chmods]
        if any("owned by" in p for p in problems):
            fixes.append(f"chown -R <agent user> {state_dir} (and run the doctor as the agent's user)")
        if damaged:
            fixes.append("revoke the node on the controller, remove the state directory and enroll again")
        return _fail(name, "; ".join(problems), "; ".join(fixes))
    enrolled = f"enrolled as node {record.node_id}" if record is not None else "not enrolled yet"
    return _ok(name, f"{state_dir}: 0700 and key files 0600, owned by uid {uid}; {enrolled}")


def _check_private_file(path: Path, uid: int, problems: list[str], chmods: list[str]) -> None:
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    except OSError as exc:
        problems.append(f"cannot look at {path}: {exc.strerror}")
        return
    if not stat.S_ISREG(st.st_mode):
        problems.append(f"{path} is not a regular file")
        return
    if st.st_uid != uid:
        problems.append(f"{path.name} is owned by uid {st.st_uid}, not uid {uid}")
    if stat.S_IMODE(st.st_mode) & 0o077:
        problems.append(f"{path.name} has mode {stat.S_IMODE(st.st_mode):04o}, not 0600")
        chmods.append(f"chmod 0600 {path}")


# --- the container engine ---------------------------------------------------------------------


def _engine_fix(engine: str) -> str:
    if engine == "docker":
        return (
            "sudo systemctl enable --now docker.socket docker.service, and give the agent's user the "
            "socket's group (`usermod -aG docker nexa`)"
        )
    return (
        "sudo systemctl enable --now podman.socket, and give the agent's user the socket's group "
        "(units/nexa-node.service: the nexa-podman drop-in)"
    )


async def check_engine(  # noqa: PLR0911 - one result per way the socket can fail
    cfg: NodeConfig, *, transport: EngineTransport | None = None
) -> CheckResult:
    """The configured engine (`[container] engine`, podman by default) answers on its socket."""
    name = "engine"
    engine = cfg.container.engine
    socket_path = cfg.container.socket_path
    fix = _engine_fix(engine)
    if transport is None:
        try:
            st = os.stat(socket_path)
        except FileNotFoundError:
            return _fail(name, f"{engine}: no socket at {socket_path}", fix)
        except OSError as exc:
            return _fail(name, f"{engine}: cannot look at {socket_path}: {exc.strerror}", fix)
        if not stat.S_ISSOCK(st.st_mode):
            return _fail(name, f"{engine}: {socket_path} is not a unix socket", fix)
        if not os.access(socket_path, os.R_OK | os.W_OK):
            return _fail(name, f"{engine}: this user (uid {os.geteuid()}) may not use {socket_path}", fix)
    client = configured_engine(cfg.container, transport=transport)
    with trio.move_on_after(ENGINE_TIMEOUT_S) as scope:
        try:
            async with client:
                version = await client.version()
        except EngineError as exc:
            return _fail(name, f"{engine} on {socket_path}: {exc.message}", fix)
    if scope.cancelled_caught:
        return _fail(name, f"{engine} on {socket_path} did not answer within {ENGINE_TIMEOUT_S:g} s", fix)
    return _ok(name, f"{engine} {version} answers on {socket_path}")


async def check_docker_cdi(cfg: NodeConfig, *, transport: EngineTransport | None = None) -> CheckResult:
    """With `gpu_method = "cdi"`, Docker has CDI on: `GET /info` lists its `CDISpecDirs`."""
    name = "docker_cdi"
    socket_path = cfg.container.socket_path
    client = DockerEngine(
        socket_path, transport=transport, gpu_method=cfg.container.gpu_method, network=cfg.container.docker_network
    )
    dirs: list[str] | None = None
    with trio.move_on_after(ENGINE_TIMEOUT_S) as scope:
        try:
            async with client:
                version = await client.version()
                dirs = await client.cdi_spec_dirs()
        except EngineError as exc:
            return _fail(name, f"docker on {socket_path}: {exc.message}", _engine_fix("docker"))
    if scope.cancelled_caught:
        return _fail(
            name, f"docker on {socket_path} did not answer within {ENGINE_TIMEOUT_S:g} s", _engine_fix("docker")
        )
    if dirs is None:
        return _fail(
            name,
            f"docker {version} reports no CDISpecDirs in GET /info: it predates CDI, or has it off, and "
            'gpu_method = "cdi" gives runtimes their GPUs by CDI name',
            DOCKER_CDI_FIX,
        )
    if not dirs:
        return _fail(name, f"docker {version} has CDI off (GET /info: CDISpecDirs is empty)", DOCKER_CDI_FIX)
    return _ok(name, f"docker {version} reads CDI specs from {', '.join(dirs)}")


# --- GPUs ---------------------------------------------------------------------------------------


def _gpu_result(cfg: NodeConfig, result: CheckResult) -> CheckResult:
    # A simulation node runs `sim` runtimes only: GPUs are welcome but not required.
    if cfg.simulation and result.status is CheckStatus.FAIL:
        return attrs.evolve(result, status=CheckStatus.WARN, detail=f"simulation node, GPUs optional: {result.detail}")
    return result


def check_nvidia(cfg: NodeConfig, gpus: tuple[Gpu, ...], problems: tuple[str, ...]) -> CheckResult:
    """nvidia-smi runs and lists GPUs (from `inventory.discover`'s result)."""
    name = "nvidia"
    driver_fix = (
        "install or repair the NVIDIA driver (DGX OS ships it; after a driver update, reboot) until "
        "`nvidia-smi` lists the GPUs; or set nvidia_smi in node.toml"
    )
    executable = cfg.nvidia_smi or shutil.which("nvidia-smi")
    gpu_problems = [p.removeprefix("gpus: ") for p in problems if p.startswith("gpus:")]
    if executable is None:
        result = _fail(name, "nvidia-smi is not on PATH: no NVIDIA driver?", driver_fix)
    elif gpu_problems:
        result = _fail(name, "; ".join(gpu_problems), driver_fix)
    elif not gpus:
        result = _fail(name, "nvidia-smi lists no GPUs", driver_fix)
    else:
        drivers = sorted({g.driver_version for g in gpus if g.driver_version})
        names = ", ".join(f"{g.index}: {g.name}" for g in gpus)
        plural = "s" if len(gpus) != 1 else ""
        result = _ok(name, f"{len(gpus)} GPU{plural} ({names}), driver {', '.join(drivers) or 'unknown'}")
    return _gpu_result(cfg, result)


def _unquote(text: str) -> str | None:
    text = text.strip()
    if len(text) >= 2 and text[0] == text[-1] and text[0] in "\"'":
        inner = text[1:-1]
        if text[0] == '"' and "\\" in inner:
            return None
        return inner.replace("''", "'") if text[0] == "'" else inner
    if not text or text[0] in "&*!|>[{@`%" or " #" in text:
        return None
    return text


def parse_cdi_yaml(text: str) -> tuple[str, list[str]] | None:  # noqa: PLR0911, PLR0912 - one exit per shape refused
    """The kind and device names of a CDI spec in block-style YAML, as `nvidia-ctk cdi generate`
    writes it; None for anything else (flow-style device lists, anchors, tabs, escapes).

    Read conservatively instead of with a YAML library (PyYAML is not a dependency of the node
    binary): only the top-level `kind:` and the `name:` key of each item of the top-level `devices:`
    list count, and a spec this reader cannot follow is reported as unreadable, never guessed at.
    """
    kind: str | None = None
    names: list[str] = []
    in_devices = False
    dash_col = key_col = -1
    named = True  # whether the current device item has had its name
    for raw in text.splitlines():
        body = raw.lstrip(" ")
        col = len(raw) - len(body)
        stripped = body.strip()
        if body.startswith("\t"):
            return None
        if not stripped or stripped.startswith("#") or stripped in ("---", "..."):
            continue
        if col == 0 and not stripped.startswith("-"):
            # A top-level key ends the devices list.
            if not named:
                return None
            key, sep, value = stripped.partition(":")
            if not sep:
                return None
            in_devices = False
            if key == "kind":
                kind = _unquote(value)
                if kind is None:
                    return None
            elif key == "devices":
                if value.strip():
                    return None  # a flow-style list: not read here
                in_devices, dash_col = True, -1
            continue
        if not in_devices:
            continue
        if dash_col == -1:
            if not stripped.startswith("- "):
                return None
            dash_col = col
        if col < dash_col or (dash_col < col < key_col):
            return None
        if col == dash_col:
            if not stripped.startswith("- ") or not named:
                return None
            content = stripped[2:].lstrip(" ")
            key_col, named = col + len(stripped) - len(content), False
        elif col == key_col and not stripped.startswith("-"):
            content = stripped
        else:
            continue  # deeper: the item's own values
        key, sep, value = content.partition(":")
        if key == "name" and sep:
            device = _unquote(value)
            if device is None or named:
                return None
            names.append(device)
            named = True
    if not named or kind is None:
        return None
    return kind, names


def _read_spec(path: Path) -> tuple[str, list[str]] | None:
    try:
        if path.stat().st_size > _MAX_SPEC_BYTES:
            return None
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None
    return _parse_cdi_json(text) if path.suffix == ".json" else parse_cdi_yaml(text)


def _parse_cdi_json(text: str) -> tuple[str, list[str]] | None:
    try:
        data = codec.parse_json(text)
    except ContractError:
        return None
    if not isinstance(data, dict) or not isinstance(data.get("kind"), str):
        return None
    devices = data.get("devices")
    if not isinstance(devices, list) or not all(
        isinstance(d, dict) and isinstance(d.get("name"), str) for d in devices
    ):
        return None
    return data["kind"], [d["name"] for d in devices]


def read_cdi_specs(dirs: tuple[str, ...]) -> tuple[set[str], list[str], list[str]]:
    """(every fully qualified device name `kind=name`, the spec files read, the ones unreadable)."""
    devices: set[str] = set()
    read: list[str] = []
    unreadable: list[str] = []
    for directory in dirs:
        try:
            entries = sorted(Path(directory).iterdir())
        except OSError:
            continue
        for path in entries:
            if path.suffix not in (".yaml", ".yml", ".json") or not path.is_file():
                continue
            spec = _read_spec(path)
            if spec is None:
                unreadable.append(str(path))
                continue
            read.append(str(path))
            kind, names = spec
            devices.update(f"{kind}={n}" for n in names)
    return devices, read, unreadable


def check_cdi(cfg: NodeConfig, gpus: tuple[Gpu, ...], dirs: tuple[str, ...]) -> CheckResult:
    """A CDI spec names every GPU nvidia-smi lists (`nvidia.com/gpu=<index>`, what runtimes ask for)."""
    name = "cdi"
    devices, read, unreadable = read_cdi_specs(dirs)
    nvidia = sorted(d for d in devices if d.startswith(CDI_NVIDIA_GPU + "="))
    where = ", ".join(dirs)
    unread = (
        f"; could not read {', '.join(unreadable)} (not the block-style YAML or JSON nvidia-ctk writes)"
        if unreadable
        else ""
    )
    if not gpus:
        if nvidia:
            result = _warn(name, f"the CDI specs list {', '.join(nvidia)} but nvidia-smi reports no GPUs{unread}")
        else:
            result = _fail(name, f"no CDI spec in {where} lists {CDI_NVIDIA_GPU} devices{unread}", CDI_FIX)
    else:
        missing = [g.cdi_device for g in gpus if g.cdi_device not in devices]
        if not missing:
            result = _ok(name, f"{', '.join(g.cdi_device for g in gpus)} in {', '.join(read)}{unread}")
        elif not read and not unreadable:
            result = _fail(name, f"no CDI spec in {where}", CDI_FIX)
        else:
            result = _fail(name, f"no CDI spec in {where} lists {', '.join(missing)}{unread}", CDI_FIX)
    if (
        result.status is CheckStatus.FAIL
        and cfg.container.engine == "docker"
        and cfg.container.gpu_method == GPU_NVIDIA_RUNTIME
    ):
        # The NVIDIA runtime's device requests find the GPUs by themselves: CDI is only advice here.
        result = attrs.evolve(result, status=CheckStatus.WARN, detail=f"gpu_method nvidia-runtime: {result.detail}")
    return _gpu_result(cfg, result)


# --- disk ---------------------------------------------------------------------------------------


def _free_bytes(path: Path) -> tuple[Path, int] | str:
    """(the nearest existing directory, its filesystem's free bytes), or why it cannot be read."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        vfs = os.statvfs(probe)
    except OSError as exc:
        return exc.strerror or type(exc).__name__
    return probe, vfs.f_bavail * vfs.f_frsize


def check_cache_disk(cfg: NodeConfig, min_free_bytes: int) -> CheckResult:
    """The runtime caches' filesystem (`<state_dir>/runtime-cache`) has `min_free_bytes` free."""
    name = "cache_disk"
    cache = Path(cfg.state_dir) / RUNTIME_CACHE_DIR
    got = _free_bytes(cache)
    if isinstance(got, str):
        return _fail(name, f"cannot look at the filesystem of {cache}: {got}")
    _, free = got
    where = f"{_gib(free)} free for the runtime caches {cache}"
    if free < min_free_bytes:
        return _fail(
            name,
            f"{where}, less than the {_gib(min_free_bytes)} required (--min-cache-free-gib): runtimes rebuild "
            "their compile and kernel caches at every start without it",
            "free space on that filesystem, or move [node] state_dir to a larger one",
        )
    return _ok(name, where)


def check_disk(cfg: NodeConfig, min_free_bytes: int) -> CheckResult:
    """The artifact cache's filesystem has `min_free_bytes` free (and room for `cache_max_bytes`)."""
    name = "disk"
    cache = Path(cfg.artifacts.cache_dir) if cfg.artifacts.cache_dir else Path(cfg.state_dir) / "artifacts"
    probe = cache
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        vfs = os.statvfs(probe)
    except OSError as exc:
        return _fail(name, f"cannot look at the filesystem of {cache}: {exc.strerror}")
    free = vfs.f_bavail * vfs.f_frsize
    where = f"{_gib(free)} free for the artifact cache {cache}"
    if free < min_free_bytes:
        return _fail(
            name,
            f"{where}, less than the {_gib(min_free_bytes)} required (--min-free-gib)",
            "free space on that filesystem, or point [artifacts] cache_dir at a larger one",
        )
    if free < cfg.artifacts.cache_max_bytes:
        return _warn(
            name,
            f"{where}: less than [artifacts] cache_max_bytes ({_gib(cfg.artifacts.cache_max_bytes)}), "
            "so the disk can fill before the cache evicts",
            "lower [artifacts] cache_max_bytes to fit the disk",
        )
    return _ok(name, where)


async def check_firewall(cfg: NodeConfig) -> CheckResult:
    """nft answers, so a replica group member's port can be closed but on its fabric address."""
    name, fw = "firewall", cfg.firewall
    if not fw.enabled:
        return _ok(name, "off ([firewall] enabled = false): the host's firewall closes replica groups' ports")
    problem = await firewall.nft_problem(fw.nft)
    if problem is not None:
        return _warn(
            name,
            f"{problem}: a replica group's member (a runtime with fabric access) would not start here",
            f"install nftables (apt install nftables) and give the agent CAP_NET_ADMIN ({firewall.FABRIC_DROP_IN}), "
            "or set [firewall] enabled = false and close those ports in the host's firewall",
        )
    return _ok(name, f"nft answers; replica groups' ports are closed in table inet {fw.table}")


# --- the controller -----------------------------------------------------------------------------


async def check_controller(
    opts: DoctorOptions, record: identity.EnrollmentRecord | None, fetch: FetchVersion
) -> list[CheckResult]:
    """Three results: `controller` (it answers), `fingerprint` (its keys are the pinned ones), `clock`."""
    url = opts.controller_url or (record.controller_url if record is not None else "")
    if not url:
        detail = "no controller URL: pass --controller URL (enrollment records it from then on)"
        return [_warn("controller", detail), _warn("fingerprint", "not checked"), _warn("clock", "not checked")]
    try:
        with trio.fail_after(2 * NETWORK_TIMEOUT_S):
            answer = await fetch(url)
    except (Unavailable, CertificateNotTrusted, trio.TooSlowError) as exc:
        detail = (
            exc.message if isinstance(exc, NexaError) else f"{url} did not answer within {2 * NETWORK_TIMEOUT_S:g} s"
        )
        fix = (
            "check the URL and that `nexa control` runs and listens there ([http] listen); "
            "firewalls must let this node reach it"
        )
        if isinstance(exc, CertificateNotTrusted):
            detail, fix = f"the certificate of {url} is not trusted ({exc.reason})", CLIENT_FIX
        skipped = "not checked: the controller did not answer"
        return [_fail("controller", detail, fix), _warn("fingerprint", skipped), _warn("clock", skipped)]
    v = answer.version
    rtt_ms = (answer.received_at - answer.sent_at) * 1000
    results = [_ok("controller", f"nexa control {v.version} at {url} (store epoch {v.epoch}), {rtt_ms:.0f} ms")]
    results.append(_check_fingerprint(opts, record, v, url))
    results.append(_check_clock(answer))
    return results


def _check_fingerprint(
    opts: DoctorOptions, record: identity.EnrollmentRecord | None, v: VersionInfo, url: str
) -> CheckResult:
    name = "fingerprint"
    pinned: str | None = None
    if record is not None:
        try:
            pinned = security.controller_fingerprint(
                record.controller_signing_public_key, record.controller_curve_public_key
            )
        except ContractError as exc:
            return _fail(name, f"the pinned controller keys are damaged: {exc.message}")
        if opts.controller_fingerprint is not None and opts.controller_fingerprint != pinned:
            return _fail(
                name, f"--controller-fingerprint is not the pinned one ({pinned})", "check which fingerprint you meant"
            )
    expected = pinned or opts.controller_fingerprint
    if not v.controller_fingerprint:
        return _warn(name, f"the controller at {url} does not report its fingerprint (an older version)")
    if expected is None:
        return _warn(
            name,
            f"not enrolled: the controller reports {v.controller_fingerprint}",
            "compare it with the fingerprint `nexa tokens create` printed, or pass --controller-fingerprint",
        )
    if v.controller_fingerprint != expected:
        what = "this node pinned" if pinned is not None else "--controller-fingerprint says"
        return _fail(
            name,
            f"the controller at {url} has fingerprint {v.controller_fingerprint}, {what} {expected}",
            "this is not the controller the node trusts: check the URL; if the controller's keys were "
            "replaced, revoke the node and enroll it again",
        )
    how = "pinned at enrollment" if pinned is not None else "as --controller-fingerprint"
    return _ok(name, f"{expected} ({how})")


def _check_clock(answer: ControllerAnswer) -> CheckResult:
    name = "clock"
    v = answer.version
    if v.now > 0:
        theirs, resolution = v.now, 0.0
    elif answer.date is not None:
        theirs, resolution = answer.date + _DATE_RESOLUTION_S / 2, _DATE_RESOLUTION_S / 2
    else:
        return _warn(name, "the controller reports no time (no `now`, no Date header)")
    allowed = v.max_clock_skew_s or NodesConfig().max_clock_skew_s
    mine = (answer.sent_at + answer.received_at) / 2
    skew = mine - theirs
    uncertainty = (answer.received_at - answer.sent_at) / 2 + resolution
    direction = "ahead of" if skew > 0 else "behind"
    detail = f"{abs(skew):.2f} s {direction} the controller's (± {uncertainty:.2f} s; allowed {allowed:g} s)"
    if abs(skew) - uncertainty > allowed:
        return _fail(name, f"{detail}: its heartbeats are refused", NTP_FIX)
    if abs(skew) + uncertainty > allowed / 2:
        return _warn(name, f"{detail}: more than half the allowance", NTP_FIX)
    return _ok(name, detail)


# --- the node channel ---------------------------------------------------------------------------


async def check_channel(
    cfg: NodeConfig, record: identity.EnrollmentRecord | None, listed: str | None = None
) -> CheckResult:
    """After enrollment: a TCP connection to the channel endpoint (from `source_address`, if set)
    opens; to `listed` (one of `controllers`) where given, else to the enrolled one."""
    name = "channel"
    if record is None:
        return _warn(name, "not enrolled: the controller names its channel endpoint at enrollment")
    endpoint = listed or record.channel_endpoint
    fix = "[channel] listen/advertise on the controller must be reachable from this node over TCP; check firewalls"
    try:
        host, port = parse_host_port(endpoint.removeprefix("tcp://"))
    except ValueError:
        host, port = "", 0
    if not endpoint.startswith("tcp://") or not host:
        return _fail(name, f"the enrolled channel endpoint {endpoint[:200]!r} is not tcp://HOST:PORT", fix)
    with trio.move_on_after(NETWORK_TIMEOUT_S) as scope:
        try:
            stream = await trio.open_tcp_stream(host, port, local_address=cfg.source_address or None)
        except OSError as exc:
            return _fail(name, f"cannot connect to {endpoint}: {exc.strerror or type(exc).__name__}", fix)
        await stream.aclose()
    if scope.cancelled_caught:
        return _fail(name, f"{endpoint} did not accept a connection within {NETWORK_TIMEOUT_S:g} s", fix)
    return _ok(name, f"{endpoint} accepts connections")
