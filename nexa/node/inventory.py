"""Host, GPU and fabric inventory: discovery (nvidia-smi, /proc/meminfo, sysfs: `nexa.node.fabric`)
merged with the host-owned inventory.json.

Parsing and merging are pure functions; the async functions do the I/O with trio. A failed GPU
probe never raises: it becomes a `problems` line in the inventory and the node reports no GPUs.
`InventoryWatcher` re-reads inventory.json when it changes and keeps the last good version, and
looks at the host again every rediscovery interval (the agent's `[node] discovery_interval_s`).
"""

from __future__ import annotations

import csv
import io
import json
import logging
import math
import os
import platform
import shutil
import socket
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any, Final, NoReturn, TypeVar

import attrs
import trio

from nexa.contracts.bounds import MAX_BYTES, in_range
from nexa.contracts.node import (
    GPU_INDEX_MAX,
    POWER_DRAW_W,
    TEMPERATURE_C,
    UTILIZATION_PCT,
    AcceleratorOverride,
    DiscoveredHost,
    Gpu,
    InventoryFile,
    NodeInventory,
    structure_inventory_file,
)
from nexa.errors import ConfigError, Unavailable
from nexa.node.fabric import DEFAULT_SYSFS_PATH, discover_fabric

log = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_INVENTORY_PATH: Final = "/etc/nexa/inventory.json"
DEFAULT_MEMINFO_PATH: Final = "/proc/meminfo"

#: The columns asked of nvidia-smi, in the order `parse_nvidia_smi_csv` reads them.
NVIDIA_SMI_FIELDS: Final = (
    "index",
    "uuid",
    "name",
    "memory.total",
    "memory.used",
    "memory.free",
    "utilization.gpu",
    "temperature.gpu",
    "power.draw",
    "driver_version",
    "pci.bus_id",
    "compute_cap",
)
NVIDIA_SMI_ARGS: Final = ("--query-gpu=" + ",".join(NVIDIA_SMI_FIELDS), "--format=csv,noheader,nounits")
#: A healthy nvidia-smi answers in well under a second; a hung driver must not stall the agent.
NVIDIA_SMI_TIMEOUT_S: Final = 10.0

_MIB: Final = 1024 * 1024
_KIB: Final = 1024
# How nvidia-smi spells "no value" (bracketed forms such as "[GPU is lost]" are caught generically).
_UNKNOWN: Final = frozenset({"", "n/a", "not supported", "unknown error"})
_ARCH: Final = {"x86_64": "amd64", "amd64": "amd64", "aarch64": "arm64", "arm64": "arm64", "armv8l": "arm64"}
_MAX_DETAIL: Final = 200

# A version of the inventory file: (mtime_ns, size, inode); editors that replace the file
# change the inode, in-place writes change mtime or size.
_Signature = tuple[int, int, int]
_MISSING: Final[_Signature] = (-1, -1, -1)


@attrs.frozen(kw_only=True)
class HostMemory:
    total_bytes: int
    available_bytes: int


# ---------------------------------------------------------------------------------------------
# Pure parsing


def normalise_arch(machine: str) -> str:
    """`platform.machine()` as container images name it: `amd64`, `arm64`, else lower-cased."""
    machine = machine.strip().lower()
    return _ARCH.get(machine, machine)


def _value(raw: str) -> str | None:
    value = raw.strip()
    if value.lower() in _UNKNOWN or (value.startswith("[") and value.endswith("]")):
        return None
    return value


def _mib(value: str | None) -> int | None:
    # A figure nvidia-smi prints that no GPU can have (negative, inf, nan, absurd) is unknown.
    number = _number(value)
    return int(number * _MIB) if number is not None and in_range(number * _MIB, 0, MAX_BYTES) else None


def _number(value: str | None) -> float | None:
    if value is None:
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _figure(value: float | None, bounds: tuple[float, float]) -> float | None:
    """A GPU figure, or None (unknown) when it lies outside the range the contract allows."""
    return value if value is not None and in_range(value, *bounds) else None


def parse_nvidia_smi_csv(text: str) -> list[Gpu]:
    """Parse `nvidia-smi --query-gpu=<NVIDIA_SMI_FIELDS> --format=csv,noheader,nounits` output.

    Memory columns are MiB. "[N/A]", "[Not Supported]" and the like become None. Raises
    Unavailable naming the line and column when the output is not what was asked for.
    """
    gpus: list[Gpu] = []
    problems: list[str] = []
    for lineno, row in enumerate(csv.reader(io.StringIO(text), skipinitialspace=True), start=1):
        if not any(cell.strip() for cell in row):
            continue
        if len(row) != len(NVIDIA_SMI_FIELDS):
            problems.append(f"line {lineno}: expected {len(NVIDIA_SMI_FIELDS)} columns, got {len(row)}")
            continue
        cells = dict(zip(NVIDIA_SMI_FIELDS, (_value(cell) for cell in row), strict=True))
        missing = [name for name in ("index", "uuid", "name") if cells[name] is None]
        if missing:
            problems.append(f"line {lineno}: no value for {', '.join(missing)}")
            continue
        try:
            gpus.append(_gpu(cells))
        except ValueError as exc:
            problems.append(f"line {lineno}: {exc}")
    if problems:
        raise Unavailable("unexpected nvidia-smi output: " + "; ".join(problems))
    return gpus


def _convert(cells: dict[str, str | None], name: str, convert: Callable[[str | None], T]) -> T:
    try:
        return convert(cells[name])
    except ValueError:
        raise ValueError(f"{name} is not a number: {cells[name]!r}") from None


def _gpu(cells: dict[str, str | None]) -> Gpu:
    index = _convert(cells, "index", _number)
    if index is None or index != int(index) or not 0 <= index <= GPU_INDEX_MAX:
        raise ValueError(f"index is not a GPU index: {cells['index']!r}")
    return Gpu(
        index=int(index),
        uuid=cells["uuid"] or "",
        name=cells["name"] or "",
        memory_total_bytes=_convert(cells, "memory.total", _mib),
        memory_used_bytes=_convert(cells, "memory.used", _mib),
        memory_free_bytes=_convert(cells, "memory.free", _mib),
        utilization_pct=_figure(_convert(cells, "utilization.gpu", _number), UTILIZATION_PCT),
        temperature_c=_figure(_convert(cells, "temperature.gpu", _number), TEMPERATURE_C),
        power_draw_w=_figure(_convert(cells, "power.draw", _number), POWER_DRAW_W),
        driver_version=cells["driver_version"],
        pci_bus_id=cells["pci.bus_id"],
        compute_cap=cells["compute_cap"],
    )


def parse_meminfo(text: str) -> HostMemory:
    """Total and available memory from /proc/meminfo text (kB there means KiB).

    Kernels older than 3.14 have no MemAvailable; then MemFree + Buffers + Cached stands in.
    """
    fields: dict[str, int] = {}
    for line in text.splitlines():
        name, sep, rest = line.partition(":")
        parts = rest.split()
        if not sep or not parts or not parts[0].isdigit():
            continue
        scale = _KIB if parts[1:] == ["kB"] else 1
        fields[name.strip()] = int(parts[0]) * scale
    if "MemTotal" not in fields:
        raise Unavailable("unexpected meminfo: no MemTotal line")
    available = fields.get("MemAvailable")
    if available is None:
        if "MemFree" not in fields:
            raise Unavailable("unexpected meminfo: neither MemAvailable nor MemFree")
        available = fields["MemFree"] + fields.get("Buffers", 0) + fields.get("Cached", 0)
    return HostMemory(total_bytes=fields["MemTotal"], available_bytes=min(available, fields["MemTotal"]))


def parse_inventory_file(raw: str | bytes, *, source: str) -> InventoryFile:
    """Parse inventory.json text. Raises ConfigError naming every bad key, or where the JSON breaks."""
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            problem = f"byte {exc.start}: not UTF-8"
            raise ConfigError(f"{source} is not valid JSON: {problem}", problems=(problem,)) from None
    duplicates: list[str] = []

    def pairs(items: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in items:
            if key in out:
                duplicates.append(f"{key}: key appears twice in one object")
            out[key] = value
        return out

    try:
        data = json.loads(raw, object_pairs_hook=pairs)
    except json.JSONDecodeError as exc:
        problem = f"line {exc.lineno}, column {exc.colno}: {exc.msg}"
        raise ConfigError(f"{source} is not valid JSON: {problem}", problems=(problem,)) from None
    if duplicates:
        problems = tuple(duplicates)
        raise ConfigError(f"invalid inventory file {source}:\n  " + "\n  ".join(problems), problems=problems)
    return structure_inventory_file(data, source=source)


def load_inventory_file(path: str | os.PathLike[str]) -> InventoryFile:
    """Read inventory.json. A missing file means no overrides (the defaults of InventoryFile)."""
    try:
        raw = Path(path).read_bytes()
    except FileNotFoundError:
        return InventoryFile()
    except OSError as exc:
        problem = f"cannot read: {exc.strerror}"
        raise ConfigError(f"cannot read inventory file {path}: {exc.strerror}", problems=(problem,)) from None
    return parse_inventory_file(raw, source=os.fspath(path))


def merge(discovered: DiscoveredHost, file: InventoryFile) -> NodeInventory:
    """Apply inventory.json to what discovery found. Pure.

    A GPU whose total memory the driver cannot report shares the host's memory (GB10 / DGX
    Spark): it is marked `unified_memory`, its total is the host's MemTotal (or the override,
    capped at MemTotal) and its free memory is the host's MemAvailable capped at that total.
    The unified pool counts once in `accelerator_memory_bytes`, however many GPUs share it.
    """
    problems = list(discovered.problems)
    by_uuid = {o.uuid: (i, o) for i, o in enumerate(file.accelerators) if o.uuid is not None}
    by_index = {o.index: (i, o) for i, o in enumerate(file.accelerators) if o.index is not None}
    used: set[int] = set()
    gpus: list[Gpu] = []
    for gpu in discovered.gpus:
        matches = [m for m in (by_uuid.get(gpu.uuid), by_index.get(gpu.index)) if m is not None]
        if len(matches) > 1:
            problems.append(
                f"accelerators[{matches[0][0]}] and accelerators[{matches[1][0]}] both select GPU "
                f"{gpu.index}; using accelerators[{matches[0][0]}]"
            )
        override = matches[0] if matches else None
        if override is not None:
            used.update(i for i, _ in matches)
            if override[1].hidden:
                continue
        gpus.append(_apply(gpu, override, discovered, problems))
    for i, o in enumerate(file.accelerators):
        if i not in used:
            problems.append(f"accelerators[{i}]: no GPU with {o.selector()} on this host")
    discrete = sum(g.memory_total_bytes or 0 for g in gpus if not g.unified_memory)
    unified = max((g.memory_total_bytes or 0 for g in gpus if g.unified_memory), default=0)
    return NodeInventory(
        hostname=discovered.hostname,
        arch=discovered.arch,
        cpu_count=discovered.cpu_count,
        memory_total_bytes=discovered.memory_total_bytes,
        memory_available_bytes=discovered.memory_available_bytes,
        gpus=tuple(gpus),
        labels=dict(file.labels),
        taints=file.taints,
        data_classes=file.data_classes,
        runtimes=file.runtimes,
        accelerator_memory_bytes=discrete + unified,
        discovered_at=discovered.discovered_at,
        problems=tuple(problems),
        gpus_stale=discovered.gpus_stale,
        fabric=discovered.fabric,
    )


def _apply(
    gpu: Gpu, override: tuple[int, AcceleratorOverride] | None, host: DiscoveredHost, problems: list[str]
) -> Gpu:
    at, declared = (override[0], override[1].memory_total_bytes) if override is not None else (-1, None)
    if gpu.memory_total_bytes is None:
        total = host.memory_total_bytes if declared is None else declared
        if declared is not None and 0 < host.memory_total_bytes < declared:
            problems.append(
                f"accelerators[{at}]: memory_total_bytes {declared} is more than the host's "
                f"{host.memory_total_bytes}; using {host.memory_total_bytes}"
            )
            total = host.memory_total_bytes
        return attrs.evolve(
            gpu,
            unified_memory=True,
            memory_total_bytes=total,
            memory_free_bytes=min(host.memory_available_bytes, total),
        )
    if declared is None:
        return gpu
    free = gpu.memory_free_bytes
    if free is not None:
        # Declaring less than the card has reserves the rest: what is in use counts against it.
        free = max(0, min(free, declared - (gpu.memory_used_bytes or 0)))
    return attrs.evolve(gpu, memory_total_bytes=declared, memory_free_bytes=free)


# ---------------------------------------------------------------------------------------------
# I/O


async def query_gpus(nvidia_smi: str) -> list[Gpu]:
    """Run nvidia-smi once. Raises Unavailable when it cannot run, fails or prints nonsense.

    No deadline here: callers put one around the call (`discover` uses NVIDIA_SMI_TIMEOUT_S).
    """
    return parse_nvidia_smi_csv(await run_nvidia_smi(nvidia_smi, NVIDIA_SMI_ARGS))


async def run_nvidia_smi(nvidia_smi: str, args: Sequence[str]) -> str:
    """nvidia-smi's output for `args`; Unavailable, with its first line, when it cannot run or fails.
    A cancelled run (the caller's deadline) is killed at once."""
    try:
        proc = await trio.run_process(
            [nvidia_smi, *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            deliver_cancel=_kill,
        )
    except OSError as exc:
        # Problems travel to the controller: name the tool, never the path it was found at.
        raise Unavailable(f"cannot run nvidia-smi: {exc.strerror or type(exc).__name__}") from None
    if proc.returncode != 0:
        # nvidia-smi prints its failures ("couldn't communicate with the NVIDIA driver") on stdout.
        said = (proc.stderr or b"").decode(errors="replace").strip() or proc.stdout.decode(errors="replace").strip()
        detail = said.splitlines()[0][:_MAX_DETAIL] if said else "no output"
        raise Unavailable(f"nvidia-smi exited with status {proc.returncode}: {detail}")
    return str(proc.stdout.decode(errors="replace"))


async def _kill(proc: trio.Process) -> None:
    # A hung nvidia-smi (a wedged driver) is not asked twice: SIGKILL at once, never SIGTERM first.
    proc.kill()


async def read_host_memory(meminfo_path: str = DEFAULT_MEMINFO_PATH) -> HostMemory:
    """Total and available memory now. Raises Unavailable naming why meminfo could not be read."""
    try:
        return parse_meminfo(await trio.Path(meminfo_path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise Unavailable(f"cannot read meminfo: {exc.strerror}") from None
    except Unavailable as exc:
        raise Unavailable(f"cannot read meminfo: {exc.message}") from None


async def discover(
    nvidia_smi: str | None, *, meminfo_path: str = DEFAULT_MEMINFO_PATH, sysfs_path: str = DEFAULT_SYSFS_PATH
) -> DiscoveredHost:
    """Look at this host: CPUs, memory, architecture, hostname, NVIDIA GPUs and the RDMA fabric.

    `nvidia_smi` None means whichever nvidia-smi is on PATH; none there means a host without
    NVIDIA GPUs. A configured path that does not work is reported in `problems`.
    """
    problems: list[str] = []
    try:
        memory = await read_host_memory(meminfo_path)
    except Unavailable as exc:
        problems.append(f"memory: {exc.message}")
        memory = HostMemory(total_bytes=0, available_bytes=0)
    gpus: list[Gpu] = []
    timed_out = False
    executable = nvidia_smi if nvidia_smi is not None else shutil.which("nvidia-smi")
    if executable is not None:
        with trio.move_on_after(NVIDIA_SMI_TIMEOUT_S) as scope:
            try:
                gpus = await query_gpus(executable)
            except Unavailable as exc:
                problems.append(f"gpus: {exc.message}")
        timed_out = scope.cancelled_caught
        if timed_out:
            problems.append(f"gpus: nvidia-smi did not answer within {NVIDIA_SMI_TIMEOUT_S:g} s")
    fabric, fabric_problems = await trio.to_thread.run_sync(discover_fabric, sysfs_path)
    problems += fabric_problems
    for problem in problems:
        # Callers decide how loudly to report (the watcher logs each new problem once).
        log.debug("inventory discovery: %s", problem)
    return DiscoveredHost(
        hostname=socket.gethostname(),
        arch=normalise_arch(platform.machine()),
        cpu_count=os.cpu_count() or 1,
        memory_total_bytes=memory.total_bytes,
        memory_available_bytes=memory.available_bytes,
        gpus=tuple(gpus),
        discovered_at=time.time(),
        problems=tuple(problems),
        gpu_probe_timed_out=timed_out,
        fabric=fabric,
    )


async def probe(
    inventory_path: str | os.PathLike[str],
    nvidia_smi: str | None,
    *,
    meminfo_path: str = DEFAULT_MEMINFO_PATH,
    sysfs_path: str = DEFAULT_SYSFS_PATH,
) -> NodeInventory:
    """One look at the host plus inventory.json (for `nexa node inventory`). Raises ConfigError."""
    file = await trio.to_thread.run_sync(load_inventory_file, inventory_path)
    return merge(await discover(nvidia_smi, meminfo_path=meminfo_path, sysfs_path=sysfs_path), file)


def _stat_signature(path: str) -> _Signature:
    try:
        st = os.stat(path)
    except (FileNotFoundError, NotADirectoryError):
        return _MISSING
    except OSError as exc:
        # Unreadable is a version of its own, so it is reported once and retried on change.
        return (-2, exc.errno or 0, 0)
    return (st.st_mtime_ns, st.st_size, st.st_ino)


def _read_with_signature(path: str) -> tuple[_Signature, bytes] | None:
    # fstat on the open file: the signature belongs to exactly the bytes read.
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            return (st.st_mtime_ns, st.st_size, st.st_ino), f.read()
    except (FileNotFoundError, NotADirectoryError):
        return None


class InventoryWatcher:
    """Keeps a current NodeInventory: polls inventory.json and re-reads it when it changes.

    An invalid edit is rejected with one WARNING line per bad version of the file and the last
    good inventory stays current. A missing file means the defaults. An invalid file at start
    is an error: `run` raises ConfigError before it reports started.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        discover: Callable[[], Awaitable[DiscoveredHost]],
        poll_interval_s: float = 2.0,
        rediscover_interval_s: float | None = None,
    ) -> None:
        self._path = os.fspath(path)
        self._discover = discover
        self._poll_interval_s = poll_interval_s
        self._rediscover_interval_s = rediscover_interval_s
        self._signature: _Signature | None = None
        self._host: DiscoveredHost | None = None
        self._file = InventoryFile()
        self._rejected: tuple[str, ...] = ()
        self._inventory: NodeInventory | None = None
        self._changed = trio.Event()
        self._nvidia_smi_timeouts = 0

    def current(self) -> NodeInventory:
        """The inventory now in force. Raises Unavailable before `run` has started."""
        if self._inventory is None:
            raise Unavailable("the node inventory has not been read yet")
        return self._inventory

    def rejected(self) -> tuple[str, ...]:
        """Why the file as it is now was rejected; empty when the file in force is the file on disk."""
        return self._rejected

    async def wait_changed(self, seen: NodeInventory | None = None) -> NodeInventory:
        """Return the current inventory as soon as it is not `seen` (the one the caller has)."""
        while self._inventory is None or self._inventory is seen:
            await self._changed.wait()
        return self._inventory

    async def run(self, *, task_status: trio.TaskStatus[NodeInventory] = trio.TASK_STATUS_IGNORED) -> NoReturn:
        """Read, report started with the first inventory, then follow the file (and, with a
        rediscovery interval, the host) until cancelled. Rediscovery is a task of its own: a
        discovery that takes long (nvidia-smi up to its timeout) never holds up the file's edits."""
        self._host = self._stale_kept(await self._discover())
        signature = await trio.to_thread.run_sync(_stat_signature, self._path)
        await self._reload(signature, initial=True)
        task_status.started(self.current())
        async with trio.open_nursery() as nursery:
            if self._rediscover_interval_s is not None:
                nursery.start_soon(self._rediscover, self._rediscover_interval_s)
            while True:
                await trio.sleep(self._poll_interval_s)
                signature = await trio.to_thread.run_sync(_stat_signature, self._path)
                if signature != self._signature:
                    await self._reload(signature, initial=False)
        raise AssertionError("unreachable")  # pragma: no cover

    async def _rediscover(self, interval_s: float) -> NoReturn:
        next_at = trio.current_time() + interval_s
        while True:
            await trio.sleep_until(next_at)
            self._host = self._stale_kept(await self._discover())
            self._publish(merge(self._host, self._file))
            # The next look is an interval after this one began, or at once after a long one.
            next_at = max(next_at + interval_s, trio.current_time())

    def _stale_kept(self, host: DiscoveredHost) -> DiscoveredHost:
        """A look whose nvidia-smi hung keeps the last GPU figures, marked stale (and is counted)."""
        if not host.gpu_probe_timed_out:
            return host
        self._nvidia_smi_timeouts += 1
        last = self._host
        if last is None or not last.gpus:
            return host
        return attrs.evolve(host, gpus=last.gpus, gpus_stale=True)

    async def _reload(self, polled: _Signature, *, initial: bool) -> None:
        assert self._host is not None
        try:
            got = await trio.to_thread.run_sync(_read_with_signature, self._path)
        except OSError as exc:
            self._signature = polled
            self._reject((f"cannot read: {exc.strerror}",), initial=initial)
            return
        if got is None:
            self._signature = _MISSING
            if initial:
                log.info("no inventory file at %s; using the defaults", self._path)
            else:
                log.warning("inventory file %s was removed; using the defaults", self._path)
            file = InventoryFile()
        else:
            self._signature, raw = got
            try:
                file = parse_inventory_file(raw, source=self._path)
            except ConfigError as exc:
                self._reject(exc.problems or (exc.message,), initial=initial)
                return
            log.info(
                "inventory file %s %s: %d labels, %d taints, data classes %s, runtimes %s, %d GPU overrides",
                self._path,
                "read" if initial else "reloaded",
                len(file.labels),
                len(file.taints),
                ",".join(file.data_classes) or "(none)",
                ",".join(file.runtimes) or "(none)",
                len(file.accelerators),
            )
        self._file = file
        self._rejected = ()
        self._publish(merge(self._host, file))

    def _reject(self, problems: tuple[str, ...], *, initial: bool) -> None:
        if initial:
            raise ConfigError(f"invalid inventory file {self._path}:\n  " + "\n  ".join(problems), problems=problems)
        self._rejected = problems
        log.warning("inventory file %s rejected, keeping the last good inventory: %s", self._path, "; ".join(problems))

    def _publish(self, inventory: NodeInventory) -> None:
        # Each problem (a failed GPU probe, an override that matches no GPU) is logged when it
        # appears, not on every rediscovery that finds it again.
        already = set(self._inventory.problems if self._inventory is not None else ())
        for problem in inventory.problems:
            if problem not in already:
                log.warning("node inventory: %s", problem)
        if self._nvidia_smi_timeouts:
            inventory = attrs.evolve(inventory, nvidia_smi_timeouts=self._nvidia_smi_timeouts)
        self._inventory = inventory
        self._changed.set()
        self._changed = trio.Event()
