"""What building a ggml project's C++ server from source shares, for llama.cpp's (`llamaserver`) and
whisper.cpp's (`whisperserver`): the tools it needs, each step in its own process group with its
log, one cmake configure and build with ggml at -O3, and the built files packed into a cache file
that appears whole or not at all."""

from __future__ import annotations

import os
import shutil
import tarfile
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Final

from nexa.errors import Unavailable
from nexa.localparts.children import tail
from nexa.localparts.images import run_grouped

#: Included by cmake where the ggml project starts (`CMAKE_PROJECT_ggml_INCLUDE`): ggml's sources
#: (its CPU backend's kernels among them) are built at -O3 as a Release build has them, whatever the
#: project's own flags.
GGML_PROJECT_FLAGS: Final = 'set(CMAKE_C_FLAGS_RELEASE "-O3 -DNDEBUG")\nset(CMAKE_CXX_FLAGS_RELEASE "-O3 -DNDEBUG")\n'
BUILD_JOBS: Final = 2
#: A build's bound: minutes on a quiet 2-core machine; a slower or busier one gets this long.
BUILD_TIMEOUT_S: Final = 3600.0
DOWNLOAD_TIMEOUT_S: Final = 900.0
_CONFIGURE_TIMEOUT_S: Final = 600.0


def parts_missing() -> str | None:
    """What building here lacks, in one line; None if nothing."""
    missing = [tool for tool in ("cmake", "c++") if shutil.which(tool) is None]
    return f"{' and '.join(missing)} (apt-get install cmake g++)" if missing else None


def run_logged(argv: list[str], log: Path, timeout_s: float, env: dict[str, str] | None = None) -> None:
    """`argv` in its own process group (a timeout or an interrupt ends it and its children), output to `log`."""
    returncode = run_grouped(argv, log, timeout_s, env=env)
    if returncode != 0:
        raise Unavailable(f"{' '.join(argv[:4])} … failed ({returncode}):\n{tail(log)}")


def cmake_build(source: Path, work: Path, cmake_args: Sequence[str], targets: Sequence[str]) -> Path:
    """Configure `source` with `cmake_args` (ggml at -O3: `GGML_PROJECT_FLAGS`; Ninja where there is
    one) and build `targets` in `work/build`, logs beside it; the build folder."""
    build = work / "build"
    generator = ["-G", "Ninja"] if shutil.which("ninja") else []
    ggml_flags = work / "ggml-flags.cmake"
    ggml_flags.write_text(GGML_PROJECT_FLAGS)
    configure = [*generator, *cmake_args, f"-DCMAKE_PROJECT_ggml_INCLUDE={ggml_flags}"]
    run_logged(["cmake", "-S", str(source), "-B", str(build), *configure], work / "cmake.log", _CONFIGURE_TIMEOUT_S)
    run_logged(
        ["cmake", "--build", str(build), "--target", *targets, f"-j{BUILD_JOBS}"], work / "build.log", BUILD_TIMEOUT_S
    )
    return build


def pack(dest: Path, files: Iterable[tuple[Path, str]]) -> None:
    """A gzipped tarball of `files` (each a path and its name in the archive; links stay links) at
    `dest`, written beside it, synced and renamed into place: a cache file is whole or absent."""
    packed = dest.with_name(f".{dest.name}.{os.getpid()}.tmp")
    try:
        with tarfile.open(packed, "w:gz") as archive:
            for path, arcname in files:
                archive.add(path, arcname=arcname)
        with packed.open("rb") as f:
            os.fsync(f.fileno())
        packed.replace(dest)
    finally:
        packed.unlink(missing_ok=True)


def unpack(archive: tarfile.TarFile, dest: Path, members: Iterable[tarfile.TarInfo] | None = None) -> None:
    """`archive.extractall(dest, filter="data")` (PEP 706), also on a Python 3.11 older than 3.11.4
    (Debian 12's python3 is 3.11.2), which has no extraction filters: there every member is first
    checked as the data filter would check it (a plain file, directory or link, whose path and link
    target stay under `dest`) and any other refuses the whole archive."""
    if hasattr(tarfile, "data_filter"):
        archive.extractall(dest, members=members, filter="data")
        return
    chosen = list(members) if members is not None else archive.getmembers()
    root = dest.resolve()
    for member in chosen:
        target = (root / member.name).resolve()
        if member.issym():
            linked = (target.parent / member.linkname).resolve()
        elif member.islnk():
            linked = (root / member.linkname).resolve()
        else:
            linked = target
        if not (member.isfile() or member.isdir() or member.issym() or member.islnk()):
            raise tarfile.ExtractError(f"{member.name!r} is not a file, directory or link")
        if os.path.isabs(member.name) or not target.is_relative_to(root) or not linked.is_relative_to(root):
            raise tarfile.ExtractError(f"{member.name!r} leaves the destination")
    archive.extractall(dest, members=chosen)  # noqa: S202 - every member checked above
