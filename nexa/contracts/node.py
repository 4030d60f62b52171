"""Node inventory records: what discovery finds, what people write in inventory.json, the merge.

Pure data and validation; no I/O. `structure_inventory_file` is the one way a parsed
inventory.json becomes an `InventoryFile`, and it names every bad key in a ConfigError.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable
from typing import Any, Final, NewType, TypeVar

import attrs
import cattrs

from nexa.contracts import codec
from nexa.contracts.bounds import MAX_BYTES, MAX_UNIX_S, finite, whole
from nexa.contracts.domain import NAME_RE
from nexa.contracts.fabric import Fabric
from nexa.errors import ConfigError, ContractError

T = TypeVar("T")

#: A label or taint key: `name` or `prefix/name`, as in Kubernetes.
LabelKey = NewType("LabelKey", str)
#: A label or taint value: empty, or 1-63 of letters, digits, `-`, `_`, `.`.
LabelValue = NewType("LabelValue", str)
#: A data classification the node may process (`public`, `internal`, `confidential`, ...).
DataClassName = NewType("DataClassName", str)

_LABEL_NAME_RE: Final = re.compile(r"^[A-Za-z0-9](?:[-A-Za-z0-9_.]{0,61}[A-Za-z0-9])?$")
_DNS_SUBDOMAIN_RE: Final = re.compile(r"^[a-z0-9](?:[-a-z0-9]*[a-z0-9])?(?:\.[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)*$")
_DNS_SUBDOMAIN_MAX: Final = 253

#: The CDI device name podman is given for an NVIDIA GPU (nvidia-container-toolkit's spec).
CDI_NVIDIA_GPU: Final = "nvidia.com/gpu"

#: The ranges GPU figures must lie in; discovery reports a figure outside its range as unknown.
GPU_INDEX_MAX: Final = 4095
UTILIZATION_PCT: Final = (0.0, 100.0)
TEMPERATURE_C: Final = (-100.0, 300.0)
POWER_DRAW_W: Final = (0.0, 100_000.0)
#: The most CPUs one node reports.
CPU_COUNT_MAX: Final = 1 << 20


class RuntimeKind(enum.StrEnum):
    """The runtime adapters a host may allow."""

    VLLM = "vllm"
    SGLANG = "sglang"
    TRTLLM = "trtllm"
    LLAMACPP = "llamacpp"
    SIM = "sim"
    #: whisper.cpp's `whisper-server`: speech to text (a media runtime).
    WHISPERCPP = "whispercpp"
    #: stable-diffusion.cpp's `sd-server`: text to image (a media runtime).
    SDCPP = "sdcpp"


class TaintEffect(enum.StrEnum):
    NO_SCHEDULE = "NoSchedule"
    PREFER_NO_SCHEDULE = "PreferNoSchedule"


#: What a host processes when inventory.json does not say: public data only.
DEFAULT_DATA_CLASSES: Final = (DataClassName("public"),)
#: Which runtimes a host allows when inventory.json does not say: every real one (not `sim`).
DEFAULT_RUNTIMES: Final = (RuntimeKind.VLLM, RuntimeKind.SGLANG, RuntimeKind.TRTLLM, RuntimeKind.LLAMACPP)


def _cdi_name(gpu: Gpu) -> str:
    return f"{CDI_NVIDIA_GPU}={gpu.index}"


@attrs.frozen(kw_only=True)
class Gpu:
    """One GPU as nvidia-smi reports it (None: the driver reports the value as unknown).

    After `merge`, a GPU whose memory nvidia-smi cannot report (GB10: CPU and GPU share one
    LPDDR5x pool) has `unified_memory=True` and its memory figures describe the shared pool.
    """

    index: int = attrs.field(validator=whole(0, GPU_INDEX_MAX))
    uuid: str
    name: str
    memory_total_bytes: int | None = attrs.field(validator=whole(0, MAX_BYTES, optional=True))
    memory_used_bytes: int | None = attrs.field(validator=whole(0, MAX_BYTES, optional=True))
    memory_free_bytes: int | None = attrs.field(validator=whole(0, MAX_BYTES, optional=True))
    utilization_pct: float | None = attrs.field(validator=finite(*UTILIZATION_PCT, optional=True))
    temperature_c: float | None = attrs.field(validator=finite(*TEMPERATURE_C, optional=True))
    power_draw_w: float | None = attrs.field(validator=finite(*POWER_DRAW_W, optional=True))
    driver_version: str | None
    pci_bus_id: str | None
    compute_cap: str | None
    unified_memory: bool = False
    #: What a container spec asks podman for, e.g. `nvidia.com/gpu=0`.
    cdi_device: str = attrs.field(default=attrs.Factory(_cdi_name, takes_self=True))


@attrs.frozen(kw_only=True)
class Taint:
    """Keeps work off a node unless the deployment tolerates it."""

    key: LabelKey
    value: LabelValue = LabelValue("")
    effect: TaintEffect


@attrs.frozen(kw_only=True)
class AcceleratorOverride:
    """A person's correction to one discovered GPU, chosen by `index` or by `uuid` (exactly one)."""

    index: int | None = None
    uuid: str | None = None
    #: Memory to schedule against. For a unified-memory GPU this is its share of the host pool.
    memory_total_bytes: int | None = None
    #: Leave this GPU out of the inventory (kept for something else, or faulty).
    hidden: bool = False

    def __attrs_post_init__(self) -> None:
        if (self.index is None) == (self.uuid is None):
            raise ValueError("set exactly one of index or uuid")
        if self.index is not None and self.index < 0:
            raise ValueError("index must be 0 or more")
        if self.uuid is not None and not self.uuid.strip():
            raise ValueError("uuid must not be empty")
        if self.memory_total_bytes is not None and not 0 < self.memory_total_bytes <= MAX_BYTES:
            raise ValueError(f"memory_total_bytes must be a positive number of bytes, at most {MAX_BYTES}")

    def selector(self) -> str:
        return f"uuid {self.uuid}" if self.uuid is not None else f"index {self.index}"


@attrs.frozen(kw_only=True)
class InventoryFile:
    """What people write in the host-owned inventory.json. Every key is optional."""

    labels: dict[LabelKey, LabelValue] = attrs.Factory(dict)
    taints: tuple[Taint, ...] = ()
    data_classes: tuple[DataClassName, ...] = DEFAULT_DATA_CLASSES
    runtimes: tuple[RuntimeKind, ...] = DEFAULT_RUNTIMES
    accelerators: tuple[AcceleratorOverride, ...] = ()


@attrs.frozen(kw_only=True)
class DiscoveredHost:
    """What the agent finds on the host by itself, before inventory.json is applied."""

    hostname: str
    #: `amd64` or `arm64` (other machines keep their lower-cased `platform.machine()`).
    arch: str
    cpu_count: int
    memory_total_bytes: int
    memory_available_bytes: int
    gpus: tuple[Gpu, ...]
    discovered_at: float
    #: Why part of the discovery failed (nvidia-smi missing at a configured path, timed out, ...).
    problems: tuple[str, ...] = ()
    #: nvidia-smi did not answer in time (it was killed): `gpus` is empty, not "no GPUs".
    gpu_probe_timed_out: bool = False
    #: The GPU figures are the last good ones, kept because nvidia-smi stopped answering.
    gpus_stale: bool = False
    #: RDMA devices, their ports and interfaces (`nexa.node.fabric`); empty without any.
    fabric: Fabric = attrs.Factory(Fabric)


#: Longest engine name, version or GPU method a node may report.
ENGINE_FIELD_MAX: Final = 64


@attrs.frozen(kw_only=True)
class NodeInventory:
    """Discovery merged with inventory.json: what a node reports to the controller."""

    hostname: str
    arch: str
    cpu_count: int = attrs.field(validator=whole(0, CPU_COUNT_MAX))
    memory_total_bytes: int = attrs.field(validator=whole(0, MAX_BYTES))
    memory_available_bytes: int = attrs.field(validator=whole(0, MAX_BYTES))
    gpus: tuple[Gpu, ...]
    labels: dict[LabelKey, LabelValue]
    taints: tuple[Taint, ...]
    data_classes: tuple[DataClassName, ...]
    runtimes: tuple[RuntimeKind, ...]
    #: The accelerator memory to place against: the sum over discrete GPUs, plus the unified pool once.
    accelerator_memory_bytes: int = attrs.field(validator=whole(0, MAX_BYTES))
    discovered_at: float = attrs.field(validator=finite(0.0, MAX_UNIX_S))
    #: Discovery failures and overrides that did not apply, for the operator to see.
    problems: tuple[str, ...] = ()
    #: The container engine runtimes run in ("podman" or "docker"), its version ("" while it does
    #: not answer) and how GPUs reach them ("cdi" or "nvidia-runtime"). "" in records from before.
    container_engine: str = attrs.field(default="", validator=attrs.validators.max_len(ENGINE_FIELD_MAX))
    container_engine_version: str = attrs.field(default="", validator=attrs.validators.max_len(ENGINE_FIELD_MAX))
    gpu_method: str = attrs.field(default="", validator=attrs.validators.max_len(ENGINE_FIELD_MAX))
    #: The GPU figures are the last good ones: nvidia-smi stopped answering (it is killed at its
    #: timeout and tried again at the next rediscovery).
    gpus_stale: bool = False
    #: How many times nvidia-smi hung and was killed since the agent started.
    nvidia_smi_timeouts: int = attrs.field(default=0, validator=whole(0, MAX_BYTES))
    #: The RDMA devices, their ports, the interfaces they sit on and the fabric's identity
    #: (`contracts.fabric`); empty on a node without RDMA devices and from agents before it.
    fabric: Fabric = attrs.Factory(Fabric)


def steady_inventory(inventory: NodeInventory) -> NodeInventory:
    """`inventory` without what moves by itself between two reads: free memory, the clock of
    discovery and the GPUs' telemetry (used and free memory, utilisation, temperature, power). What
    is left changes only when the node does (placement's view; whether a node's state changed)."""
    gpus = tuple(
        attrs.evolve(
            g,
            memory_used_bytes=None,
            memory_free_bytes=None,
            utilization_pct=None,
            temperature_c=None,
            power_draw_w=None,
        )
        for g in inventory.gpus
    )
    return attrs.evolve(inventory, memory_available_bytes=0, discovered_at=0.0, gpus=gpus)


def label_key_problem(key: str) -> str | None:
    """Why `key` is not a valid label or taint key, or None when it is."""
    prefix, slash, name = key.rpartition("/")
    if not _LABEL_NAME_RE.match(name):
        return (
            "a label key is NAME or PREFIX/NAME, where NAME is 1-63 letters, digits, '-', '_' or '.' "
            "starting and ending with a letter or digit"
        )
    if slash and (len(prefix) > _DNS_SUBDOMAIN_MAX or not _DNS_SUBDOMAIN_RE.match(prefix)):
        return "a label key PREFIX must be a lower-case DNS name (example.com)"
    return None


def label_value_problem(value: str) -> str | None:
    """Why `value` is not a valid label or taint value, or None when it is."""
    if value and not _LABEL_NAME_RE.match(value):
        return (
            "a label value is empty or 1-63 letters, digits, '-', '_' or '.' starting and ending with a letter or digit"
        )
    return None


def data_class_problem(name: str) -> str | None:
    """Why `name` is not a valid data class name, or None when it is."""
    if not NAME_RE.match(name):
        return "a data class is a lower-case name of 1-64 letters, digits, '.', '_' or '-'"
    return None


def _checked(problem_of: Callable[[str], str | None], new_type: Callable[[str], T]) -> Callable[[object, type], T]:
    def hook(value: object, _: type) -> T:
        if not isinstance(value, str):
            raise ValueError(f"expected a string, got {type(value).__name__}")
        problem = problem_of(value)
        if problem is not None:
            raise ValueError(f"{value!r} is not valid: {problem}")
        return new_type(value)

    return hook


def _file_converter() -> cattrs.Converter:
    # A copy of the store converter (strict scalars, unknown keys rejected) plus the lexical
    # rules for the names people type; other converters keep treating these NewTypes as str.
    conv = codec.store.copy()
    conv.register_structure_hook(LabelKey, _checked(label_key_problem, LabelKey))
    conv.register_structure_hook(LabelValue, _checked(label_value_problem, LabelValue))
    conv.register_structure_hook(DataClassName, _checked(data_class_problem, DataClassName))
    # cattrs would iterate a string into characters ("public" -> p, u, b, ...) and fail on a
    # string where an object belongs with "unknown error": insist on the JSON shape first.
    for cls in (Taint, AcceleratorOverride):
        conv.register_structure_hook(cls, _only(dict, "an object", conv.get_structure_hook(cls)))
    for seq in (tuple[Taint, ...], tuple[DataClassName, ...], tuple[RuntimeKind, ...], tuple[AcceleratorOverride, ...]):
        conv.register_structure_hook_func(_is(seq), _only(list, "a list", conv.get_structure_hook(seq)))
    return conv


def _is(expected: Any) -> Callable[[Any], bool]:
    return lambda type_: bool(type_ == expected)


def _only(shape: type, name: str, hook: Callable[[Any, Any], T]) -> Callable[[object, Any], T]:
    def checked(value: object, type_: Any) -> T:
        if not isinstance(value, shape):
            raise ValueError(f"expected {name}, got {_json_type(value)}")
        return hook(value, type_)

    return checked


def _json_type(value: object) -> str:
    if value is None:
        return "null"
    return {dict: "object", list: "list", str: "string", bool: "true/false"}.get(type(value), "number")


_FILE_CONV: Final = _file_converter()


def structure_inventory_file(data: Any, *, source: str) -> InventoryFile:
    """Turn parsed inventory.json into an InventoryFile, or raise ConfigError naming every bad key.

    `source` names the file in the message (a path on this host; never sent to API clients).
    """
    try:
        parsed = codec.structure(_FILE_CONV, data, InventoryFile)
    except ContractError as exc:
        problems = exc.problems or (exc.message,)
        raise _invalid(source, problems) from None
    duplicates = _duplicates(parsed)
    if duplicates:
        raise _invalid(source, duplicates)
    return parsed


def _invalid(source: str, problems: tuple[str, ...]) -> ConfigError:
    return ConfigError(f"invalid inventory file {source}:\n  " + "\n  ".join(problems), problems=problems)


def _duplicates(file: InventoryFile) -> tuple[str, ...]:
    out: list[str] = []
    for field, items in (("data_classes", file.data_classes), ("runtimes", file.runtimes)):
        first: dict[str, int] = {}
        for i, item in enumerate(items):
            if item in first:
                out.append(f"{field}[{i}]: {str(item)!r} is already listed at {field}[{first[item]}]")
            first.setdefault(item, i)
    seen_taints: dict[tuple[str, str], int] = {}
    for i, taint in enumerate(file.taints):
        taint_id = (taint.key, taint.effect.value)
        if taint_id in seen_taints:
            out.append(
                f"taints[{i}]: key {taint.key!r} with effect {taint.effect} "
                f"is already set at taints[{seen_taints[taint_id]}]"
            )
        seen_taints.setdefault(taint_id, i)
    seen_gpus: dict[str, int] = {}
    for i, override in enumerate(file.accelerators):
        selector = override.selector()
        if selector in seen_gpus:
            out.append(
                f"accelerators[{i}]: GPU {selector} already has an override at accelerators[{seen_gpus[selector]}]"
            )
        seen_gpus.setdefault(selector, i)
    return tuple(out)
