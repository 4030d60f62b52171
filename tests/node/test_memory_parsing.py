"""The meter's parsing: nvidia-smi's compute-apps answer, /proc/<pid>/cgroup, memory.stat, and finding a
container's cgroup on a cgroup v2 host as seen from inside a cgroup namespace (a file tree made here)."""

from __future__ import annotations

from pathlib import Path

from nexa.node.memory import cgroup_bytes, cgroup_pids, memory_cgroup, parse_compute_apps, resident_bytes

MIB = 1024 * 1024


def test_compute_apps_sums_a_process_over_gpus_and_skips_unknown_figures() -> None:
    # The shape `nvidia-smi --query-compute-apps=pid,used_memory --format=csv,noheader,nounits` prints.
    text = "4242, 30210\n4242, 1024\n5151, [N/A]\n\n6161, 512\n"
    assert parse_compute_apps(text) == {4242: 31234 * MIB, 6161: 512 * MIB}
    assert parse_compute_apps("No running processes found\n") == {}


def test_memory_cgroup_prefers_the_v1_memory_hierarchy_on_a_hybrid_host() -> None:
    hybrid = "9:name=systemd:/\n4:memory:/libpod_parent/libpod-abc\n3:cpuset:/\n0::/\n"
    assert memory_cgroup(hybrid) == (1, "/libpod_parent/libpod-abc")
    assert memory_cgroup("0::/machine.slice/libpod-abc.scope/container\n") == (
        2,
        "/machine.slice/libpod-abc.scope/container",
    )
    assert memory_cgroup("garbage") is None


def test_resident_bytes() -> None:
    assert resident_bytes("Name:\tpython3\nVmRSS:\t  123456 kB\n") == 123456 * 1024
    assert resident_bytes("Name:\tkthreadd\n") is None


def test_a_v2_container_cgroup_is_found_from_inside_a_cgroup_namespace(tmp_path: Path) -> None:
    """/proc names the cgroup from the host's root; the mount shows only the agent's namespace, so the
    path's leading parts are dropped until the directory exists. Inactive file cache is not counted."""
    root, proc = tmp_path / "cgroup", tmp_path / "proc"
    (root / "cgroup.controllers").parent.mkdir(parents=True)
    (root / "cgroup.controllers").write_text("cpu memory pids\n")
    container = root / "machine.slice" / "libpod-abc.scope"
    container.mkdir(parents=True)
    (container / "memory.current").write_text(f"{300 * MIB}\n")
    (container / "memory.stat").write_text(f"anon {250 * MIB}\ninactive_file {40 * MIB}\nactive_file 0\n")
    (container / "cgroup.procs").write_text("77\n78\n")
    (proc / "77").mkdir(parents=True)
    (proc / "self").mkdir()
    (proc / "77" / "cgroup").write_text("0::/kubepods/node-42/machine.slice/libpod-abc.scope\n")
    (proc / "self" / "cgroup").write_text("0::/nexa-node.service\n")
    assert cgroup_bytes(77, root=root, proc=proc) == 260 * MIB
    assert cgroup_pids(77, root=root, proc=proc) == {77, 78}
    # A process in the agent's own cgroup (a simulated runtime) is measured by its resident set.
    (proc / "77" / "cgroup").write_text("0::/nexa-node.service\n")
    (proc / "77" / "status").write_text("VmRSS:\t2048 kB\n")
    assert cgroup_bytes(77, root=root, proc=proc) == 2 * MIB
    assert cgroup_bytes(99, root=root, proc=proc) is None
