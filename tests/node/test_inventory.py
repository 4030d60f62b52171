"""Node inventory: nvidia-smi and meminfo parsing, inventory.json validation, merge, discovery, watcher.

Discovery runs real subprocesses (a fake `nvidia-smi` shell script) and the watcher reads real
files in worker threads, so those tests use real, short intervals under `trio.fail_after`
instead of the autojump clock (threads and autojump_clock do not mix: trio #456).
"""

from __future__ import annotations

import json
import logging
import os
import platform
import stat
from pathlib import Path

import attrs
import cattrs
import pytest
import trio

from nexa.contracts import codec
from nexa.contracts.node import (
    DEFAULT_DATA_CLASSES,
    DEFAULT_RUNTIMES,
    AcceleratorOverride,
    DiscoveredHost,
    Gpu,
    InventoryFile,
    NodeInventory,
    RuntimeKind,
    Taint,
    TaintEffect,
)
from nexa.errors import ConfigError, Unavailable
from nexa.node import inventory
from nexa.node.inventory import (
    InventoryWatcher,
    discover,
    load_inventory_file,
    merge,
    normalise_arch,
    parse_inventory_file,
    parse_meminfo,
    parse_nvidia_smi_csv,
    probe,
)

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures"
SMI = FIXTURES / "nvidia-smi"
MEMINFO = FIXTURES / "meminfo"
EXAMPLE = ROOT / "units" / "inventory.json"

GIB = 1024**3
MIB = 1024**2
SPARK_MEM_TOTAL = 125106396 * 1024
SPARK_MEM_AVAILABLE = 118950112 * 1024


def smi(name: str) -> str:
    return (SMI / name).read_text()


def host(gpus: list[Gpu], *, total: int = SPARK_MEM_TOTAL, available: int = SPARK_MEM_AVAILABLE) -> DiscoveredHost:
    return DiscoveredHost(
        hostname="spark-01",
        arch="arm64",
        cpu_count=20,
        memory_total_bytes=total,
        memory_available_bytes=available,
        gpus=tuple(gpus),
        discovered_at=1_700_000_000.0,
    )


def bad_file(data: object) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse_inventory_file(json.dumps(data), source="/etc/nexa/inventory.json")
    return info.value


# --- nvidia-smi ------------------------------------------------------------------------------


def test_gb10_reports_unknown_memory() -> None:
    [gpu] = parse_nvidia_smi_csv(smi("gb10_dgx_spark.csv"))
    assert gpu.index == 0
    assert gpu.name == "NVIDIA GB10"
    assert gpu.uuid == "GPU-a5b0c1e2-7f3d-4c9a-b8e6-2d1f0e9c7b54"
    assert gpu.memory_total_bytes is None
    assert gpu.memory_used_bytes is None
    assert gpu.memory_free_bytes is None
    assert gpu.unified_memory is False  # only merge decides that
    assert gpu.compute_cap == "12.1"
    assert gpu.pci_bus_id == "0000000F:01:00.0"
    assert gpu.temperature_c == 41.0
    assert gpu.cdi_device == "nvidia.com/gpu=0"


def test_h100_x8() -> None:
    gpus = parse_nvidia_smi_csv(smi("h100_80g_x8.csv"))
    assert [g.index for g in gpus] == list(range(8))
    assert [g.cdi_device for g in gpus] == [f"nvidia.com/gpu={i}" for i in range(8)]
    assert len({g.uuid for g in gpus}) == 8
    assert {g.name for g in gpus} == {"NVIDIA H100 80GB HBM3"}
    assert {g.memory_total_bytes for g in gpus} == {81559 * MIB}
    assert gpus[0].memory_used_bytes == 74512 * MIB
    assert gpus[0].memory_free_bytes == 6482 * MIB
    assert gpus[0].utilization_pct == 97.0
    assert gpus[0].power_draw_w == 612.48
    assert gpus[7].memory_free_bytes == 80994 * MIB
    assert {g.driver_version for g in gpus} == {"550.54.15"}
    assert {g.compute_cap for g in gpus} == {"9.0"}
    assert gpus[3].pci_bus_id == "00000000:5D:00.0"


def test_l40s_x2() -> None:
    gpus = parse_nvidia_smi_csv(smi("l40s_48g_x2.csv"))
    assert [(g.index, g.name, g.memory_total_bytes) for g in gpus] == [
        (0, "NVIDIA L40S", 46068 * MIB),
        (1, "NVIDIA L40S", 46068 * MIB),
    ]
    assert gpus[1].memory_used_bytes == 39222 * MIB
    assert gpus[1].compute_cap == "8.9"


def test_h200_captured_on_real_hardware() -> None:
    # Output of the exact query on an H200 host (driver 580.159.04), kept byte for byte.
    [gpu] = parse_nvidia_smi_csv(smi("h200_141g_x1.csv"))
    assert gpu.name == "NVIDIA H200"
    assert gpu.memory_total_bytes == 143771 * MIB
    assert gpu.memory_free_bytes == 143156 * MIB
    assert gpu.power_draw_w == 122.36
    assert gpu.driver_version == "580.159.04"
    assert gpu.compute_cap == "9.0"
    inv = merge(host([gpu], total=131981020 * 1024), InventoryFile())
    assert inv.gpus[0].unified_memory is False
    assert inv.accelerator_memory_bytes == 143771 * MIB


@pytest.mark.parametrize("unknown", ["[N/A]", "N/A", "[Not Supported]", "Not Supported", "[Unknown Error]"])
def test_unknown_spellings(unknown: str) -> None:
    u = unknown
    line = f"0, GPU-x, NVIDIA GB10, {u}, {u}, {u}, {u}, {u}, {u}, 580.95.05, {u}, 12.1\n"
    [gpu] = parse_nvidia_smi_csv(line)
    assert gpu.memory_total_bytes is None
    assert gpu.utilization_pct is None
    assert gpu.power_draw_w is None
    assert gpu.pci_bus_id is None
    assert gpu.driver_version == "580.95.05"


def test_no_gpus_is_empty_output() -> None:
    assert parse_nvidia_smi_csv("") == []
    assert parse_nvidia_smi_csv("\n\n") == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0, GPU-x, NVIDIA L40S, 46068\n", "line 1: expected 12 columns, got 4"),
        ("0, GPU-x, NVIDIA L40S, lots, 1, 2, 0, 28, 33.5, 550.90.07, 00000000:4A:00.0, 8.9\n", "memory.total"),
        ("[N/A], GPU-x, NVIDIA L40S, 1, 1, 1, 0, 28, 33.5, 550.90.07, 00000000:4A:00.0, 8.9\n", "index"),
    ],
)
def test_unexpected_nvidia_smi_output(text: str, expected: str) -> None:
    with pytest.raises(Unavailable, match="unexpected nvidia-smi output") as info:
        parse_nvidia_smi_csv(text)
    assert expected in info.value.message


# --- meminfo and arch ---------------------------------------------------------------------------


def test_meminfo_spark() -> None:
    mem = parse_meminfo((MEMINFO / "gb10_dgx_spark.meminfo").read_text())
    assert mem.total_bytes == SPARK_MEM_TOTAL
    assert mem.available_bytes == SPARK_MEM_AVAILABLE


def test_meminfo_h100_server() -> None:
    mem = parse_meminfo((MEMINFO / "h100_dgx_2t.meminfo").read_text())
    assert mem.total_bytes == 2113389016 * 1024
    assert mem.available_bytes == 2041977644 * 1024


def test_meminfo_without_memavailable_uses_free_buffers_cached() -> None:
    text = "MemTotal: 1000 kB\nMemFree: 100 kB\nBuffers: 20 kB\nCached: 300 kB\n"
    assert parse_meminfo(text) == inventory.HostMemory(total_bytes=1000 * 1024, available_bytes=420 * 1024)


def test_meminfo_without_total() -> None:
    with pytest.raises(Unavailable, match="MemTotal"):
        parse_meminfo("MemFree: 100 kB\n")


@pytest.mark.parametrize(
    ("machine", "arch"),
    [("x86_64", "amd64"), ("AMD64", "amd64"), ("aarch64", "arm64"), ("arm64", "arm64"), ("riscv64", "riscv64")],
)
def test_normalise_arch(machine: str, arch: str) -> None:
    assert normalise_arch(machine) == arch


# --- inventory.json ---------------------------------------------------------------------------


def test_example_file_is_valid() -> None:
    file = load_inventory_file(EXAMPLE)
    assert file.labels["rack"] == "r07"
    assert file.labels["zone"] == "lab-west"
    assert file.taints == (Taint(key="maintenance", value="firmware", effect=TaintEffect.PREFER_NO_SCHEDULE),)
    assert file.data_classes == ("public", "internal", "confidential")
    assert RuntimeKind.SIM not in file.runtimes
    assert file.accelerators == (AcceleratorOverride(index=0, memory_total_bytes=119 * GIB),)


def test_missing_file_is_the_defaults(tmp_path: Path) -> None:
    file = load_inventory_file(tmp_path / "absent.json")
    assert file == InventoryFile()
    assert file.data_classes == DEFAULT_DATA_CLASSES == ("public",)
    assert file.runtimes == DEFAULT_RUNTIMES
    assert file.labels == {}
    assert file.taints == ()


def test_empty_object_is_the_defaults() -> None:
    assert parse_inventory_file(b"{}", source="x") == InventoryFile()


def test_empty_lists_mean_nothing_allowed() -> None:
    file = parse_inventory_file('{"data_classes": [], "runtimes": []}', source="x")
    assert file.data_classes == ()
    assert file.runtimes == ()


def test_unknown_key_is_named() -> None:
    err = bad_file({"labels": {"rack": "r07"}, "lables": {}, "accelerators": [{"index": 0, "memroy": 1}]})
    assert "lables: unknown key" in err.problems
    assert "accelerators[0].memroy: unknown key" in err.problems
    assert "/etc/nexa/inventory.json" in err.message
    assert "lables" in err.message


def test_bad_runtime_kind_is_named() -> None:
    err = bad_file({"runtimes": ["vllm", "ollama"]})
    assert err.problems == ("runtimes[1]: must be one of vllm, sglang, trtllm, llamacpp, sim, whispercpp, sdcpp",)


def test_bad_taint_effect_is_named() -> None:
    err = bad_file({"taints": [{"key": "gpu", "effect": "NoSchedule"}, {"key": "gpu", "effect": "NoExecute"}]})
    assert err.problems == ("taints[1].effect: must be one of NoSchedule, PreferNoSchedule",)


def test_taint_needs_key_and_effect() -> None:
    err = bad_file({"taints": [{"value": "x"}]})
    assert set(err.problems) == {"taints[0].key: required key is missing", "taints[0].effect: required key is missing"}


def test_json_syntax_error_has_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "inventory.json"
    path.write_text('{\n  "labels": {"rack": "r07",}\n}\n')
    with pytest.raises(ConfigError) as info:
        load_inventory_file(path)
    assert info.value.problems == ("line 2, column 28: Expecting property name enclosed in double quotes",)
    assert str(path) in info.value.message


def test_every_bad_key_is_named_at_once() -> None:
    err = bad_file(
        {
            "labels": {"rack": "r 07", "bad key!": "x", "ok/": "y", "Example.COM/zone": "a"},
            "data_classes": ["public", "Top Secret", 3],
            "runtimes": "vllm",
            "accelerators": [{"index": -1}, {"index": 0, "uuid": "GPU-x"}, {"uuid": "GPU-y", "memory_total_bytes": 0}],
        }
    )
    by_path = {p.split(": ", 1)[0] for p in err.problems}
    assert by_path == {
        "labels['rack']",
        "labels['bad key!']",
        "labels['ok/']",
        "labels['Example.COM/zone']",
        "data_classes[1]",
        "data_classes[2]",
        "runtimes",
        "accelerators[0]",
        "accelerators[1]",
        "accelerators[2]",
    }


@pytest.mark.parametrize(
    ("data", "problem"),
    [
        ({"data_classes": "public"}, "data_classes: expected a list, got string"),
        ({"runtimes": None}, "runtimes: expected a list, got null"),
        ({"taints": {"key": "a", "effect": "NoSchedule"}}, "taints: expected a list, got object"),
        ({"taints": ["gpu=NoSchedule"]}, "taints[0]: expected an object, got string"),
        ({"accelerators": [0]}, "accelerators[0]: expected an object, got number"),
        ({"labels": ["rack"]}, "labels: expected a mapping"),
    ],
)
def test_wrong_json_shapes_are_named(data: object, problem: str) -> None:
    assert bad_file(data).problems == (problem,)


def test_good_label_keys() -> None:
    file = parse_inventory_file(
        json.dumps({"labels": {"rack": "r07", "nexa.example.com/zone": "west_2.a", "empty": ""}}), source="x"
    )
    assert file.labels == {"rack": "r07", "nexa.example.com/zone": "west_2.a", "empty": ""}


def test_duplicates_are_named() -> None:
    err = bad_file(
        {
            "data_classes": ["public", "internal", "public"],
            "runtimes": ["vllm", "vllm"],
            "taints": [{"key": "a", "effect": "NoSchedule"}, {"key": "a", "value": "b", "effect": "NoSchedule"}],
            "accelerators": [{"index": 0}, {"index": 0, "hidden": True}],
        }
    )
    assert err.problems == (
        "data_classes[2]: 'public' is already listed at data_classes[0]",
        "runtimes[1]: 'vllm' is already listed at runtimes[0]",
        "taints[1]: key 'a' with effect NoSchedule is already set at taints[0]",
        "accelerators[1]: GPU index 0 already has an override at accelerators[0]",
    )


def test_duplicate_json_keys_are_named() -> None:
    with pytest.raises(ConfigError) as info:
        parse_inventory_file('{"labels": {"rack": "a", "rack": "b"}}', source="x")
    assert info.value.problems == ("rack: key appears twice in one object",)


@pytest.mark.parametrize("text", ["[]", '"labels"', "null"])
def test_top_level_must_be_an_object(text: str) -> None:
    with pytest.raises(ConfigError, match="expected an object"):
        parse_inventory_file(text, source="x")


def test_strict_scalars() -> None:
    err = bad_file({"accelerators": [{"index": "0"}, {"index": 1, "hidden": "yes"}, {"index": 2.0}]})
    assert set(err.problems) == {
        "accelerators[0].index: expected an integer, got str",
        "accelerators[1].hidden: expected true or false, got str",
        "accelerators[2].index: expected an integer, got float",
    }


def test_not_utf8() -> None:
    with pytest.raises(ConfigError, match="not UTF-8"):
        parse_inventory_file(b'{"labels": {"rack": "\xff"}}', source="x")


# --- merge ------------------------------------------------------------------------------------


def test_gb10_unified_memory_is_the_host_pool() -> None:
    inv = merge(host(parse_nvidia_smi_csv(smi("gb10_dgx_spark.csv"))), InventoryFile())
    [gpu] = inv.gpus
    assert gpu.unified_memory is True
    assert gpu.memory_total_bytes == SPARK_MEM_TOTAL
    assert gpu.memory_free_bytes == SPARK_MEM_AVAILABLE
    assert gpu.memory_used_bytes is None
    assert inv.accelerator_memory_bytes == SPARK_MEM_TOTAL
    assert inv.problems == ()


def test_gb10_override_declares_its_share_of_the_pool() -> None:
    inv = merge(host(parse_nvidia_smi_csv(smi("gb10_dgx_spark.csv"))), load_inventory_file(EXAMPLE))
    [gpu] = inv.gpus
    assert gpu.unified_memory is True
    assert gpu.memory_total_bytes == 119 * GIB
    assert gpu.memory_free_bytes == SPARK_MEM_AVAILABLE  # less than 119 GiB is available right now
    assert inv.accelerator_memory_bytes == 119 * GIB
    assert inv.labels == {"rack": "r07", "zone": "lab-west", "nexa.example.com/board": "dgx-spark"}
    assert inv.data_classes == ("public", "internal", "confidential")
    assert inv.runtimes == (RuntimeKind.VLLM, RuntimeKind.SGLANG, RuntimeKind.TRTLLM, RuntimeKind.LLAMACPP)
    assert inv.hostname == "spark-01"
    assert inv.arch == "arm64"
    assert inv.problems == ()


def test_unified_override_is_capped_at_host_memory() -> None:
    file = InventoryFile(accelerators=(AcceleratorOverride(index=0, memory_total_bytes=200 * GIB),))
    inv = merge(host(parse_nvidia_smi_csv(smi("gb10_dgx_spark.csv"))), file)
    assert inv.gpus[0].memory_total_bytes == SPARK_MEM_TOTAL
    assert inv.problems == (
        f"accelerators[0]: memory_total_bytes {200 * GIB} is more than the host's {SPARK_MEM_TOTAL}; "
        f"using {SPARK_MEM_TOTAL}",
    )


def test_discrete_gpus_sum_and_keep_their_memory() -> None:
    inv = merge(host(parse_nvidia_smi_csv(smi("h100_80g_x8.csv")), total=2 * 1024 * GIB), InventoryFile())
    assert all(not g.unified_memory for g in inv.gpus)
    assert inv.accelerator_memory_bytes == 8 * 81559 * MIB
    assert inv.gpus[4].memory_free_bytes == 80994 * MIB


def test_hide_by_uuid_and_reserve_by_index() -> None:
    gpus = parse_nvidia_smi_csv(smi("l40s_48g_x2.csv"))
    file = InventoryFile(
        accelerators=(
            AcceleratorOverride(uuid=gpus[1].uuid, hidden=True),
            AcceleratorOverride(index=0, memory_total_bytes=40 * GIB),
        )
    )
    inv = merge(host(gpus, total=256 * GIB), file)
    [gpu] = inv.gpus
    assert gpu.index == 0
    assert gpu.cdi_device == "nvidia.com/gpu=0"
    assert gpu.memory_total_bytes == 40 * GIB
    assert gpu.memory_free_bytes == 40 * GIB - 1 * MIB  # what is in use counts against the declared size
    assert inv.accelerator_memory_bytes == 40 * GIB
    assert inv.problems == ()


def test_overrides_that_match_nothing_are_reported() -> None:
    file = InventoryFile(
        accelerators=(AcceleratorOverride(index=3, hidden=True), AcceleratorOverride(uuid="GPU-gone", hidden=True))
    )
    inv = merge(host(parse_nvidia_smi_csv(smi("l40s_48g_x2.csv"))), file)
    assert len(inv.gpus) == 2
    assert inv.problems == (
        "accelerators[0]: no GPU with index 3 on this host",
        "accelerators[1]: no GPU with uuid GPU-gone on this host",
    )


def test_two_overrides_for_one_gpu_are_reported() -> None:
    gpus = parse_nvidia_smi_csv(smi("l40s_48g_x2.csv"))
    file = InventoryFile(
        accelerators=(AcceleratorOverride(index=0, hidden=True), AcceleratorOverride(uuid=gpus[0].uuid))
    )
    inv = merge(host(gpus), file)
    assert [g.index for g in inv.gpus] == [0, 1]  # the uuid override wins, and it does not hide
    assert inv.problems == ("accelerators[1] and accelerators[0] both select GPU 0; using accelerators[1]",)


def test_no_gpus() -> None:
    inv = merge(host([]), InventoryFile())
    assert inv.gpus == ()
    assert inv.accelerator_memory_bytes == 0


@pytest.mark.parametrize("converter", [codec.wire, codec.store], ids=["wire", "store"])
def test_node_inventory_round_trips_through_the_codec(converter: cattrs.Converter) -> None:
    inv = merge(host(parse_nvidia_smi_csv(smi("gb10_dgx_spark.csv"))), load_inventory_file(EXAMPLE))
    text = codec.dumps(converter, inv)
    assert codec.loads(converter, text, NodeInventory) == inv
    assert '"cdi_device":"nvidia.com/gpu=0"' in text


# --- discovery through a real subprocess --------------------------------------------------------


def fake_nvidia_smi(tmp_path: Path, body: str) -> str:
    script = tmp_path / "nvidia-smi"
    script.write_text("#!/bin/sh\n" + body + "\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    return str(script)


def printing(tmp_path: Path, fixture: str) -> str:
    # Fails unless called with exactly the query nexa documents.
    args = " ".join(inventory.NVIDIA_SMI_ARGS)
    return fake_nvidia_smi(
        tmp_path,
        f'[ "$*" = "{args}" ] || {{ echo "unexpected arguments: $*" >&2; exit 2; }}\nexec cat "{SMI / fixture}"',
    )


async def test_discover_runs_nvidia_smi(tmp_path: Path) -> None:
    with trio.fail_after(10):
        found = await discover(printing(tmp_path, "h100_80g_x8.csv"), meminfo_path=str(MEMINFO / "h100_dgx_2t.meminfo"))
    assert len(found.gpus) == 8
    assert found.memory_total_bytes == 2113389016 * 1024
    assert found.problems == ()
    assert found.cpu_count >= 1
    assert found.arch == normalise_arch(platform.machine())
    assert found.hostname


async def test_discover_finds_nvidia_smi_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    printing(tmp_path, "gb10_dgx_spark.csv")
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    with trio.fail_after(10):
        found = await discover(None, meminfo_path=str(MEMINFO / "gb10_dgx_spark.meminfo"))
    assert [g.name for g in found.gpus] == ["NVIDIA GB10"]


async def test_probe_gb10_end_to_end(tmp_path: Path) -> None:
    with trio.fail_after(10):
        inv = await probe(
            EXAMPLE, printing(tmp_path, "gb10_dgx_spark.csv"), meminfo_path=str(MEMINFO / "gb10_dgx_spark.meminfo")
        )
    assert inv.problems == ()
    [gpu] = inv.gpus
    assert gpu.unified_memory is True
    assert gpu.memory_total_bytes == 119 * GIB
    assert inv.accelerator_memory_bytes == 119 * GIB
    assert inv.memory_total_bytes == SPARK_MEM_TOTAL


async def test_probe_rejects_an_invalid_file(tmp_path: Path) -> None:
    path = tmp_path / "inventory.json"
    path.write_text('{"runtimes": ["ollama"]}')
    with trio.fail_after(10), pytest.raises(ConfigError, match="runtimes"):
        await probe(path, None)


async def test_no_nvidia_smi_means_no_gpus(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))  # an empty directory: nothing to find
    with trio.fail_after(10):
        found = await discover(None, meminfo_path=str(MEMINFO / "gb10_dgx_spark.meminfo"))
    assert found.gpus == ()
    assert found.problems == ()


async def test_configured_nvidia_smi_missing_is_a_problem(tmp_path: Path) -> None:
    missing = str(tmp_path / "bin" / "nvidia-smi")
    with trio.fail_after(10):
        found = await discover(missing, meminfo_path=str(MEMINFO / "gb10_dgx_spark.meminfo"))
    assert found.gpus == ()
    [problem] = found.problems
    assert problem.startswith("gpus: cannot run nvidia-smi: ")
    assert str(tmp_path) not in problem  # problems reach the controller: no host paths


async def test_failing_nvidia_smi_is_a_problem(tmp_path: Path) -> None:
    exe = fake_nvidia_smi(
        tmp_path,
        'echo "NVIDIA-SMI has failed because it couldn\'t communicate with the NVIDIA driver."\nexit 9',
    )
    with trio.fail_after(10):
        found = await discover(exe, meminfo_path=str(MEMINFO / "gb10_dgx_spark.meminfo"))
    assert found.gpus == ()
    assert found.problems == (
        "gpus: nvidia-smi exited with status 9: NVIDIA-SMI has failed because it couldn't communicate "
        "with the NVIDIA driver.",
    )


async def test_hung_nvidia_smi_times_out(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(inventory, "NVIDIA_SMI_TIMEOUT_S", 0.3)
    exe = fake_nvidia_smi(tmp_path, "exec sleep 30")
    with trio.fail_after(10):
        found = await discover(exe, meminfo_path=str(MEMINFO / "gb10_dgx_spark.meminfo"))
    assert found.gpus == ()
    assert found.problems == ("gpus: nvidia-smi did not answer within 0.3 s",)


async def test_unreadable_meminfo_is_a_problem(tmp_path: Path) -> None:
    with trio.fail_after(10):
        found = await discover(str(tmp_path / "no-smi"), meminfo_path=str(tmp_path / "meminfo"))
    assert found.memory_total_bytes == 0
    assert found.memory_available_bytes == 0
    assert "memory: cannot read meminfo: No such file or directory" in found.problems


# --- watcher ----------------------------------------------------------------------------------

POLL_S = 0.01


def write(path: Path, data: object) -> None:
    """Replace the file the way editors and config management do: new inode, atomic rename."""
    tmp = path.with_suffix(".tmp")
    tmp.write_text(data if isinstance(data, str) else json.dumps(data))
    os.replace(tmp, path)


def spark_discovery(memory_available: list[int] | None = None):  # type: ignore[no-untyped-def]
    gpus = parse_nvidia_smi_csv(smi("gb10_dgx_spark.csv"))
    calls = []

    async def discover_fake() -> DiscoveredHost:
        calls.append(None)
        available = (
            memory_available[min(len(calls), len(memory_available)) - 1] if memory_available else SPARK_MEM_AVAILABLE
        )
        return host(gpus, available=min(available, SPARK_MEM_TOTAL))

    discover_fake.calls = calls  # type: ignore[attr-defined]
    return discover_fake


async def wait_until(predicate) -> None:  # type: ignore[no-untyped-def]
    # Rejections change no inventory, so there is no event to wait on: poll like the watcher does.
    while not predicate():  # noqa: ASYNC110
        await trio.sleep(POLL_S)


async def test_watcher_keeps_last_good_and_picks_up_valid_edit(
    tmp_path: Path, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="nexa.node.inventory")
    path = tmp_path / "inventory.json"
    write(path, {"labels": {"rack": "r07"}, "data_classes": ["public", "internal"]})
    watcher = InventoryWatcher(path, discover=spark_discovery(), poll_interval_s=POLL_S)
    with trio.fail_after(10):
        first = await nursery.start(watcher.run)
        assert first is watcher.current()
        assert first.labels == {"rack": "r07"}
        assert first.data_classes == ("public", "internal")
        assert first.gpus[0].unified_memory is True

        write(path, {"labels": {"rack": "r07"}, "runtimes": ["vllm", "ollama"], "taints": [{"key": "x"}]})
        await wait_until(watcher.rejected)
        assert watcher.current() is first
        assert set(watcher.rejected()) == {
            "runtimes[1]: must be one of vllm, sglang, trtllm, llamacpp, sim, whispercpp, sdcpp",
            "taints[0].effect: required key is missing",
        }
        await trio.sleep(POLL_S * 10)  # many polls of the same bad version
        warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warnings) == 1
        assert "keeping the last good inventory" in warnings[0].getMessage()
        assert "runtimes[1]" in warnings[0].getMessage()
        assert "taints[0].effect" in warnings[0].getMessage()
        assert "\n" not in warnings[0].getMessage()

        write(path, {"labels": {"rack": "r08"}, "taints": [{"key": "x", "effect": "NoSchedule"}]})
        second = await watcher.wait_changed(first)
        assert second.labels == {"rack": "r08"}
        assert second.taints == (Taint(key="x", effect=TaintEffect.NO_SCHEDULE),)
        assert second.data_classes == DEFAULT_DATA_CLASSES
        assert watcher.rejected() == ()
        assert watcher.current() is second


async def test_watcher_logs_each_bad_version_once(
    tmp_path: Path, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "inventory.json"
    write(path, {})
    watcher = InventoryWatcher(path, discover=spark_discovery(), poll_interval_s=POLL_S)
    with trio.fail_after(10):
        await nursery.start(watcher.run)
        write(path, "{")
        await wait_until(watcher.rejected)
        assert watcher.rejected() == ("line 1, column 2: Expecting property name enclosed in double quotes",)
        write(path, '{"lables": {}}')
        await wait_until(lambda: watcher.rejected() == ("lables: unknown key",))
        await trio.sleep(POLL_S * 10)
    rejected = [r for r in caplog.records if "rejected" in r.getMessage()]
    assert len(rejected) == 2


async def test_watcher_sees_in_place_edits(tmp_path: Path, nursery: trio.Nursery) -> None:
    path = tmp_path / "inventory.json"
    path.write_text('{"labels": {"rack": "r1"}}')
    watcher = InventoryWatcher(path, discover=spark_discovery(), poll_interval_s=POLL_S)
    with trio.fail_after(10):
        first = await nursery.start(watcher.run)
        path.write_text('{"labels": {"rack": "r22"}}')  # same inode, new size
        second = await watcher.wait_changed(first)
    assert second.labels == {"rack": "r22"}


async def test_watcher_missing_file_then_created_then_removed(
    tmp_path: Path, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="nexa.node.inventory")
    path = tmp_path / "inventory.json"
    watcher = InventoryWatcher(path, discover=spark_discovery(), poll_interval_s=POLL_S)
    with trio.fail_after(10):
        first = await nursery.start(watcher.run)
        assert first.labels == {}
        assert first.data_classes == DEFAULT_DATA_CLASSES
        assert first.gpus[0].memory_total_bytes == SPARK_MEM_TOTAL
        await trio.sleep(POLL_S * 5)
        infos = [r.getMessage() for r in caplog.records if "no inventory file" in r.getMessage()]
        assert len(infos) == 1
        assert caplog.records[0].levelno == logging.INFO

        write(path, {"accelerators": [{"index": 0, "memory_total_bytes": 119 * GIB}]})
        second = await watcher.wait_changed(first)
        assert second.gpus[0].memory_total_bytes == 119 * GIB

        path.unlink()
        third = await watcher.wait_changed(second)
        assert third.gpus[0].memory_total_bytes == SPARK_MEM_TOTAL
    assert any("was removed" in r.getMessage() and r.levelno == logging.WARNING for r in caplog.records)


async def test_watcher_refuses_to_start_on_an_invalid_file(tmp_path: Path) -> None:
    path = tmp_path / "inventory.json"
    write(path, {"taints": [{"key": "gpu", "effect": "NoExecute"}]})
    watcher = InventoryWatcher(path, discover=spark_discovery(), poll_interval_s=POLL_S)
    with trio.fail_after(10), pytest.RaisesGroup(pytest.RaisesExc(ConfigError, match=r"taints\[0\]\.effect")):
        async with trio.open_nursery() as nursery:
            await nursery.start(watcher.run)
    with pytest.raises(Unavailable):
        watcher.current()


async def test_watcher_reports_overrides_that_match_nothing_once(
    tmp_path: Path, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "inventory.json"
    write(path, {"accelerators": [{"index": 5, "hidden": True}]})
    watcher = InventoryWatcher(path, discover=spark_discovery(), poll_interval_s=POLL_S, rediscover_interval_s=POLL_S)
    with trio.fail_after(10):
        inv = await nursery.start(watcher.run)
        assert inv.problems == ("accelerators[0]: no GPU with index 5 on this host",)
        for _ in range(3):
            inv = await watcher.wait_changed(inv)  # rediscoveries publish the same problem again
    matching = [r for r in caplog.records if "no GPU with index 5" in r.getMessage()]
    assert len(matching) == 1
    assert matching[0].levelno == logging.WARNING


async def test_watcher_logs_a_broken_gpu_probe_once(
    tmp_path: Path, nursery: trio.Nursery, caplog: pytest.LogCaptureFixture
) -> None:
    exe = fake_nvidia_smi(tmp_path, 'echo "No devices were found"\nexit 6')

    async def discover_real() -> DiscoveredHost:
        return await discover(exe, meminfo_path=str(MEMINFO / "gb10_dgx_spark.meminfo"))

    watcher = InventoryWatcher(
        tmp_path / "inventory.json", discover=discover_real, poll_interval_s=POLL_S, rediscover_interval_s=POLL_S
    )
    with trio.fail_after(10):
        inv = await nursery.start(watcher.run)
        assert inv.gpus == ()
        assert inv.problems == ("gpus: nvidia-smi exited with status 6: No devices were found",)
        for _ in range(3):
            inv = await watcher.wait_changed(inv)
    matching = [r for r in caplog.records if "No devices were found" in r.getMessage()]
    assert len(matching) == 1


async def test_watcher_rediscovers(tmp_path: Path, nursery: trio.Nursery) -> None:
    discover_fake = spark_discovery([100 * GIB, 90 * GIB, 80 * GIB, 80 * GIB, 80 * GIB, 80 * GIB])
    watcher = InventoryWatcher(
        tmp_path / "inventory.json", discover=discover_fake, poll_interval_s=POLL_S, rediscover_interval_s=POLL_S
    )
    with trio.fail_after(10):
        first = await nursery.start(watcher.run)
        assert first.memory_available_bytes == 100 * GIB
        assert first.gpus[0].memory_free_bytes == 100 * GIB
        second = await watcher.wait_changed(first)
    assert second.memory_available_bytes == 90 * GIB
    assert second.gpus[0].memory_free_bytes == 90 * GIB


async def test_wait_changed_returns_at_once_when_caller_is_behind(tmp_path: Path, nursery: trio.Nursery) -> None:
    path = tmp_path / "inventory.json"
    write(path, {})
    watcher = InventoryWatcher(path, discover=spark_discovery(), poll_interval_s=POLL_S)
    with trio.fail_after(10):
        first = await nursery.start(watcher.run)
        assert await watcher.wait_changed() is first
        assert await watcher.wait_changed(attrs.evolve(first)) is first


async def test_watcher_keeps_stale_gpu_figures_when_nvidia_smi_hangs(
    tmp_path: Path, nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A hung nvidia-smi is killed at its timeout and counted; the last GPU figures stay, marked
    stale; inventory.json edits are still picked up meanwhile; a later answer clears the mark."""
    monkeypatch.setattr(inventory, "NVIDIA_SMI_TIMEOUT_S", 0.3)
    hang, pids = tmp_path / "hang", tmp_path / "pids"
    exe = fake_nvidia_smi(
        tmp_path,
        f'echo $$ >> "{pids}"\nif [ -e "{hang}" ]; then exec sleep 30; fi\nexec cat "{SMI / "h100_80g_x8.csv"}"',
    )
    path = tmp_path / "inventory.json"
    write(path, {})

    async def discover_real() -> DiscoveredHost:
        return await discover(exe, meminfo_path=str(MEMINFO / "h100_dgx_2t.meminfo"))

    watcher = InventoryWatcher(path, discover=discover_real, poll_interval_s=POLL_S, rediscover_interval_s=0.05)
    with trio.fail_after(20):
        first = await nursery.start(watcher.run)
        assert len(first.gpus) == 8 and not first.gpus_stale
        hang.touch()
        inv = first
        while not inv.gpus_stale:
            inv = await watcher.wait_changed(inv)
        assert inv.gpus == first.gpus  # the last good figures, kept
        assert inv.nvidia_smi_timeouts >= 1
        assert "gpus: nvidia-smi did not answer within 0.3 s" in inv.problems
        # The file is followed while a discovery hangs.
        write(path, {"labels": {"zone": "z1"}})
        await wait_until(lambda: watcher.current().labels == {"zone": "z1"})
        hang.unlink()
        inv = watcher.current()
        while inv.gpus_stale:
            inv = await watcher.wait_changed(inv)
    assert len(inv.gpus) == 8 and inv.problems == ()
    # Every hung nvidia-smi was killed (and reaped): none is left running.
    for pid in pids.read_text().split():
        with pytest.raises(ProcessLookupError):
            os.kill(int(pid), 0)
