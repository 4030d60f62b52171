"""The images of a real model runtime on CPU, built here: a Debian python root filesystem made by
debootstrap and cached, imported into a private podman service (`nexa.localparts.podman`) and pushed; and
llama-cpp-python (this interpreter's installed distribution and what it requires, with the host's
libgomp) copied on top of it. The tiny GGUF it serves is made by `nexa.tinymodel`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Final

from nexa.errors import ConfigError, Unavailable
from nexa.localparts.children import mounted_below, tail, unmount_below
from nexa.localparts.podman import PODMAN_STOP_TIMEOUT_S, LocalPodman
from nexa.tinymodel import has_gguf_writer

#: The python image's root filesystem: Debian bookworm minbase with python3, from Debian's mirror, its
#: signatures checked against the archive keyring.
DEBIAN_SUITE: Final = "bookworm"
DEBIAN_MIRROR: Final = "http://deb.debian.org/debian"
DEBIAN_KEYRING: Final = Path("/usr/share/keyrings/debian-archive-keyring.gpg")
DEBOOTSTRAP_ARGS: Final = (
    "--variant=minbase",
    "--include=python3-minimal,python3,curl,libgomp1",
    f"--keyring={DEBIAN_KEYRING}",
)
#: Removed from the root filesystem before it is packed: apt's downloaded packages and package lists.
ROOTFS_PRUNE: Final = ("var/cache/apt/archives/*.deb", "var/cache/apt/*.bin", "var/lib/apt/lists/*")
#: debootstrap takes 45-50 s on a 2-core machine; a slow mirror gets this long.
DEBOOTSTRAP_TIMEOUT_S: Final = 1200.0
#: podman import/build/push of the python and llama images (seconds each).
IMAGE_STEP_TIMEOUT_S: Final = 600.0
#: The llama-cpp-python distribution (with its `server` extra) copied into the runtime image.
LLAMA_DIST: Final = "llama_cpp_python"
#: Files of the copied distributions that the image never needs.
_IMAGE_SKIP: Final = ("pip", "setuptools", "wheel", "_distutils_hack")


def cache_dir() -> Path:
    """What is slow to make and safe to reuse (the python rootfs, the tiny GGUF), shared by the demo and
    the tests: `$NEXA_TEST_CACHE`, else `nexa-test` in the XDG cache folder."""
    explicit = os.environ.get("NEXA_TEST_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache") / "nexa-test"


def recipe_name(stem: str, recipe: dict[str, object]) -> str:
    """A cache file's name: `stem`, the machine's architecture and a hash of the whole `recipe` (the
    architecture in it too), so that a changed recipe is a cache miss."""
    key = hashlib.sha256(json.dumps({**recipe, "arch": platform.machine()}, sort_keys=True).encode()).hexdigest()
    return f"{stem}-{platform.machine()}-{key[:16]}.tar.gz"


def python_rootfs_name() -> str:
    """The cache file of the python root filesystem, named by its recipe (debootstrap arguments, suite,
    mirror, what is pruned)."""
    recipe: dict[str, object] = {
        "debootstrap": ["debootstrap", *DEBOOTSTRAP_ARGS, DEBIAN_SUITE, "<target>", DEBIAN_MIRROR],
        "suite": DEBIAN_SUITE,
        "prune": ROOTFS_PRUNE,
        "pack": "tar --numeric-owner --one-file-system -cz",
    }
    return recipe_name(f"debian-{DEBIAN_SUITE}-python3", recipe)


def find_debootstrap() -> str | None:
    return shutil.which("debootstrap", path=f"{os.environ.get('PATH', '')}:/usr/sbin:/sbin")


def _remove_build_dir(path: Path, *, strict: bool = True) -> None:
    """Remove a (possibly half-built) root filesystem: first whatever debootstrap left mounted in it (/proc,
    /sys), and never while anything is still mounted there (that would reach into the host's files).
    Not `strict`: leave what cannot be removed now (a later run tries again)."""
    if not path.exists():
        return
    unmount_below(path)
    if left := mounted_below(path):
        if strict:
            raise Unavailable(f"still mounted below {path}, not removing it: {left}")
        return
    shutil.rmtree(path, ignore_errors=not strict)


def _run_debootstrap(debootstrap: str, target: Path, log: Path) -> None:
    """debootstrap in its own process group, so a timeout or an interrupt ends it and every child it started."""
    argv = [debootstrap, *DEBOOTSTRAP_ARGS, DEBIAN_SUITE, str(target), DEBIAN_MIRROR]
    env = {**os.environ, "LC_ALL": "C", "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"}
    returncode = run_grouped(argv, log, DEBOOTSTRAP_TIMEOUT_S, env=env)
    if returncode != 0:
        details = tail(target / "debootstrap" / "debootstrap.log") if target.exists() else ""
        raise Unavailable(f"{' '.join(argv)} failed ({returncode}):\n{details or tail(log)}")


def _build_python_rootfs(dest: Path) -> None:
    """debootstrap the root filesystem next to `dest`, prune apt's caches and pack it into `dest` atomically
    (a temporary file, fsynced, then renamed): an interrupted build leaves no file under `dest`'s name."""
    debootstrap = find_debootstrap()
    if debootstrap is None:
        raise ConfigError("debootstrap is not installed (apt-get install debootstrap)")
    if os.geteuid() != 0:
        raise ConfigError("debootstrap needs root")
    if not DEBIAN_KEYRING.is_file():
        raise ConfigError(f"{DEBIAN_KEYRING} is missing: install debian-archive-keyring")
    # Built in the cache folder, not a temporary one: /tmp may be noexec, and the rename must not cross
    # file systems.
    work = dest.with_name(f".{dest.name}.build.{os.getpid()}")
    packed = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        work.mkdir()
        target = work / "rootfs"
        _run_debootstrap(debootstrap, target, work / "debootstrap.log")
        for pattern in ROOTFS_PRUNE:
            for path in target.glob(pattern):
                if path.is_dir() and not path.is_symlink():
                    shutil.rmtree(path)
                else:
                    path.unlink()
        subprocess.run(
            ["tar", "--numeric-owner", "--one-file-system", "-C", str(target), "-czf", str(packed), "."],
            capture_output=True,
            timeout=600,
            check=True,
        )
        with packed.open("rb") as f:
            os.fsync(f.fileno())
        packed.replace(dest)
        folder = os.open(dest.parent, os.O_RDONLY)
        try:
            os.fsync(folder)
        finally:
            os.close(folder)
    finally:
        packed.unlink(missing_ok=True)
        _remove_build_dir(work)


def run_grouped(argv: list[str], log: Path, timeout_s: float, *, env: dict[str, str] | None = None) -> int:
    """`argv` in its own process group, its output to `log`; its exit status. A timeout or an interrupt
    ends it and every child it started (SIGKILL to the group), then raises."""
    with log.open("wb") as out:
        proc = subprocess.Popen(
            argv, env=env, stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        return proc.wait(timeout=timeout_s)
    except BaseException:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=PODMAN_STOP_TIMEOUT_S)
        raise


def python_rootfs(cache: Path, *, rebuild: bool = False) -> tuple[Path, bool]:
    """The cached python root filesystem tarball, built first if it is missing (or `rebuild`; about a
    minute, needs root and Debian's mirror). Returns the path and whether it was built now."""
    # Best effort: a killed run's debootstrap may still be finishing its last step in its build
    # directory (it runs in its own session); a later run removes what is left.
    return cached_build(
        cache,
        python_rootfs_name(),
        _build_python_rootfs,
        rebuild=rebuild,
        clear=lambda leftover: _remove_build_dir(leftover, strict=False),
    )


def cached_build(
    cache: Path, name: str, build: Callable[[Path], None], *, rebuild: bool, clear: Callable[[Path], None]
) -> tuple[Path, bool]:
    """`cache/name`, made first by `build(dest)` if it is missing (or `rebuild`); the path and whether it
    was built now. Runs that share the cache wait for each other's build (a file lock, released by the
    kernel if its holder dies) and clear what a killed build left behind: its `.tmp` files, and its
    `.build.` directories with `clear`."""
    cache.mkdir(parents=True, exist_ok=True)
    dest = cache / name
    with (cache / f".{dest.name}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        for leftover in cache.glob(f".{dest.name}.*"):
            if leftover.name.endswith(".tmp"):
                leftover.unlink(missing_ok=True)
            elif ".build." in leftover.name:
                clear(leftover)
        if rebuild:
            dest.unlink(missing_ok=True)
        if dest.is_file():
            os.utime(dest)  # last used: lets whoever prunes the cache go by age
            return dest, False
        build(dest)
        return dest, True


def build_python_image(podman: LocalPodman, remote: str, work: Path, cache: Path) -> str:
    """A Debian bookworm image with python3 (`CMD ["/usr/bin/python3"]`) pushed to `remote` (`host/repo`,
    plain HTTP): `host/repo@sha256:…`. Its root filesystem comes from `python_rootfs(cache)`; a cached
    file that podman cannot import is built again once. The local image is removed after the push."""
    rootfs, built = python_rootfs(cache)
    local = f"localhost/nexa-local/python:{os.getpid()}"
    change = 'CMD ["/usr/bin/python3"]'
    timeout = IMAGE_STEP_TIMEOUT_S
    imported = podman.run("import", "--change", change, str(rootfs), local, check=False, timeout_s=timeout)
    if imported.returncode != 0 and not built:
        rootfs, built = python_rootfs(cache, rebuild=True)
        imported = podman.run("import", "--change", change, str(rootfs), local, check=False, timeout_s=timeout)
    if imported.returncode != 0:
        raise Unavailable(f"podman import {rootfs} failed ({imported.returncode}): {imported.stderr[-2000:]}")
    work.mkdir(parents=True, exist_ok=True)
    return podman.push(local, f"{remote}:latest", work)


def dist_closure(name: str, extras: tuple[str, ...] = ()) -> list[importlib.metadata.Distribution]:
    """`name` and every distribution it requires (with `extras`), as installed in this interpreter.
    ConfigError naming the first one that is not installed."""
    from packaging.requirements import Requirement

    seen: dict[str, importlib.metadata.Distribution] = {}
    todo: list[tuple[str, tuple[str, ...]]] = [(name, extras)]
    while todo:
        current, wanted = todo.pop()
        try:
            dist = importlib.metadata.distribution(current)
        except importlib.metadata.PackageNotFoundError:
            raise ConfigError(f"{current} is not installed in this Python ({sys.executable})") from None
        key = dist.metadata["Name"].lower().replace("-", "_")
        if key in seen and not wanted:
            continue
        seen[key] = dist
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in (*wanted, "")):
                continue
            if req.name.lower().replace("-", "_") not in seen:
                todo.append((req.name, tuple(req.extras)))
    return list(seen.values())


def find_libgomp() -> Path:
    """The host's GNU OpenMP runtime (llama.cpp's CPU backend links it; the python rootfs lacks it)."""
    for folder in (f"/usr/lib/{platform.machine()}-linux-gnu", f"/lib/{platform.machine()}-linux-gnu"):
        path = Path(folder) / "libgomp.so.1"
        if path.exists():
            return path.resolve()
    raise ConfigError("libgomp.so.1 is not installed (apt-get install libgomp1)")


def build_llama_image(podman: LocalPodman, python_image: str, remote: str, work: Path) -> str:
    """`python_image` plus this interpreter's llama-cpp-python (with its server) and what it requires, and
    the host's libgomp, pushed to `remote` (`host/repo`): `host/repo@sha256:…`. `python3 -m
    llama_cpp.server` runs it. The local image and the local copy of `python_image` are removed."""
    dists = dist_closure(LLAMA_DIST, ("server",))
    site = work / "site"
    for dist in dists:
        root = Path(str(dist.locate_file("")))
        for file in dist.files or []:
            if file.parts[0].split(".")[0] in _IMAGE_SKIP or file.parts[0] == ".." or "__pycache__" in file.parts:
                continue
            source = root / file
            if source.is_file():
                target = site / file
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, target)
    shutil.copy2(find_libgomp(), work / "libgomp.so.1")
    (work / "Containerfile").write_text(
        f"FROM {python_image}\n"
        "COPY site /opt/llama-site\n"
        f"COPY libgomp.so.1 /usr/lib/{platform.machine()}-linux-gnu/libgomp.so.1\n"
        "ENV PYTHONPATH=/opt/llama-site PYTHONDONTWRITEBYTECODE=1\n"
        'CMD ["python3", "-m", "llama_cpp.server", "--help"]\n'
    )
    pushed = build_image(podman, work, remote)
    podman.run("rmi", "--ignore", python_image, check=False)
    return pushed


def build_image(podman: LocalPodman, context: Path, remote: str) -> str:
    """`podman build` of `context`/Containerfile (its FROM image pulled over plain HTTP), in Docker's
    format (it keeps HEALTHCHECK), pushed to `remote` (`host/repo`): `host/repo@sha256:…`. The local
    image is removed."""
    local = f"localhost/nexa-local/{remote.rpartition('/')[2]}:{os.getpid()}"
    containerfile = str(context / "Containerfile")
    build = ("build", "--tls-verify=false", "--format", "docker", "-t", local, "-f", containerfile, str(context))
    podman.run(*build, timeout_s=IMAGE_STEP_TIMEOUT_S)
    return podman.push(local, f"{remote}:latest", context)


def llama_version() -> str:
    """The installed llama-cpp-python's version (what the runtime image carries)."""
    try:
        return importlib.metadata.version(LLAMA_DIST)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(f"llama-cpp-python is not installed in this Python ({sys.executable})") from None


def llama_parts_missing(cache: Path) -> str | None:
    """What a real llama-cpp-python runtime built here lacks, in one line; None if nothing."""
    missing = []
    if shutil.which("podman") is None:
        missing.append("podman")
    if os.geteuid() != 0:
        missing.append("root (a private rootful podman service)")
    if not (cache / python_rootfs_name()).is_file() and find_debootstrap() is None:
        missing.append("debootstrap (the python root filesystem is not cached yet)")
    if importlib.util.find_spec("llama_cpp") is None:
        missing.append(f"llama-cpp-python in {sys.executable}")
    if not has_gguf_writer():
        missing.append(f"gguf and numpy in {sys.executable}")
    return ", ".join(missing) or None
