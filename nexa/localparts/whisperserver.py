"""whisper.cpp's own C++ `whisper-server` (examples/server), built here from source and cached, and its
runtime image laid out as whisper.cpp's published image (`.devops/main.Dockerfile` in whisper.cpp's
source, `ghcr.io/ggml-org/whisper.cpp:main`): the build tree in `/app/build` (the server in
`/app/build/bin`, which is put in front of PATH, its libraries where its RUNPATH looks), `WORKDIR
/app`, `ENTRYPOINT ["bash", "-c"]`, run as root (no USER). The published image also carries ffmpeg (for
the server's `--convert`); this one does not, so its replicas take 16 kHz WAV as whisper.cpp itself
reads it.

The source is the whisper.cpp that the pywhispercpp sdist on PyPI vendors (`whisper.cpp/`, v1.8 with
`examples/server`), fetched with pip (PyPI is the one package index the build machines reach) and kept
in `cache_dir()`: the tests also read its `samples/jfk.wav` and the vocabulary of its
`models/for-tests-ggml-tiny.bin` (`nexa.localparts.tinywhisper`). It is built with cmake for the CPU
(no native tuning, no SDL, no ffmpeg, no curl, no tests), the `whisper-server` target only, and packed
into `cache_dir()` under a name keyed by the recipe: the first run builds it (41 steps, about 110 s of
CPU: 2.5 to 5 minutes on a 2-core machine shared with other work), later runs unpack it. The image is
built on the cached Debian python image (`images.build_python_image`), which carries bash,
curl and libgomp.
"""

from __future__ import annotations

import os
import shutil
import sys
import tarfile
from pathlib import Path
from typing import Final

from nexa.errors import ConfigError
from nexa.localparts.cmake import GGML_PROJECT_FLAGS, cmake_build, pack, parts_missing, run_logged, unpack
from nexa.localparts.images import build_image, cached_build, recipe_name
from nexa.localparts.podman import LocalPodman

#: The sdist whose `whisper.cpp/` is built (and whose sample and test model the tests read).
WHISPER_SERVER_SDIST: Final = ("pywhispercpp", "1.5.1")
#: cmake's cache arguments: a portable CPU build of the server, nothing fetched or found on the host.
#: `WHISPER_BUILD_EXAMPLES`: the server is one of the examples (examples/CMakeLists.txt adds it).
#: `CMAKE_BUILD_RPATH_USE_ORIGIN`: the binary finds its libraries beside it ($ORIGIN), wherever it lies.
CMAKE_ARGS: Final = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    "-DWHISPER_BUILD_TESTS=OFF",
    "-DWHISPER_BUILD_EXAMPLES=ON",
    "-DWHISPER_BUILD_SERVER=ON",
    "-DWHISPER_SDL2=OFF",
    "-DWHISPER_FFMPEG=OFF",
    "-DWHISPER_CURL=OFF",
    "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",
    # The server's and common's C++ (HTTP, JSON: most of the compile) at -O1; ggml, where the tensor
    # kernels are, keeps -O3 (`GGML_PROJECT_FLAGS`), as llamaserver.py builds llama.cpp.
    "-DCMAKE_C_FLAGS_RELEASE=-O1 -DNDEBUG",
    "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG",
)
BUILD_TARGET: Final = "whisper-server"
#: Where the published image has its programs (`/app/build/bin`, on PATH) and its working directory.
APP_DIR: Final = "/app"
BIN_DIR: Final = "/app/build/bin"
#: What the tests read from the sdist (paths under its `whisper.cpp/`).
SAMPLE_WAV: Final = "samples/jfk.wav"
TEST_MODEL: Final = "models/for-tests-ggml-tiny.bin"


def whisper_server_name() -> str:
    """The cache file of the built server, named by its recipe (the sdist, cmake's arguments and target)."""
    recipe: dict[str, object] = {
        "sdist": WHISPER_SERVER_SDIST,
        "source": "whisper.cpp",
        "cmake": CMAKE_ARGS,
        "ggml": GGML_PROJECT_FLAGS,
        "target": [BUILD_TARGET],
        "pack": "bin/whisper-server, lib*.so* where the build put them",
    }
    return recipe_name(f"whisper-server-{WHISPER_SERVER_SDIST[1]}", recipe)


def whisper_server_parts_missing() -> str | None:
    """What building the server here lacks, in one line; None if nothing."""
    return parts_missing()


def whisper_sdist(cache: Path) -> Path:
    """The pywhispercpp sdist, unpacked once into `cache` (keyed by its version): its `whisper.cpp/`
    folder. `--no-binary` names the one package: `:all:` would also build its build requirements
    (cmake among them) from source just to read its metadata."""
    name, version = WHISPER_SERVER_SDIST
    folder = cache / recipe_name(f"{name}-{version}-sdist", {"sdist": WHISPER_SERVER_SDIST})
    folder = folder.with_name(folder.name.removesuffix(".tar.gz"))

    def fetch(dest: Path) -> None:
        work = dest.with_name(f".{dest.name}.build.{os.getpid()}")
        try:
            work.mkdir()
            pip = [sys.executable, "-m", "pip", "download", "--no-binary", name, "--no-deps"]
            run_logged(
                [*pip, "--dest", str(work), "--disable-pip-version-check", f"{name}=={version}"], work / "log", 900
            )
            (sdist,) = work.glob("*.tar.gz")
            sdist.replace(dest)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    tarball, _ = cached_build(
        folder, f"{name}-{version}.tar.gz", fetch, rebuild=False, clear=lambda d: shutil.rmtree(d, ignore_errors=True)
    )
    source = folder / f"{name}-{version}" / "whisper.cpp"
    if not (source / "CMakeLists.txt").is_file():
        unpacked = folder / f".unpack.{os.getpid()}"
        try:
            with tarfile.open(tarball) as archive:
                unpack(archive, unpacked)
            try:
                (unpacked / f"{name}-{version}").rename(folder / f"{name}-{version}")
            except OSError:
                if not (source / "CMakeLists.txt").is_file():  # another run's unpacking won the race
                    raise
        finally:
            shutil.rmtree(unpacked, ignore_errors=True)
    return source


def whisper_server_build(cache: Path, *, rebuild: bool = False) -> tuple[Path, bool]:
    """The cached tarball of the built server (`whisper-server` and its shared libraries), built first
    if it is missing (or `rebuild`). Returns the path and whether it was built now."""

    def build(dest: Path) -> None:
        _build(whisper_sdist(cache), dest)

    return cached_build(
        cache, whisper_server_name(), build, rebuild=rebuild, clear=lambda d: shutil.rmtree(d, ignore_errors=True)
    )


def _build(source: Path, dest: Path) -> None:
    """About 110 s of CPU."""
    if problem := whisper_server_parts_missing():
        raise ConfigError(f"building whisper-server needs {problem}")
    work = dest.with_name(f".{dest.name}.build.{os.getpid()}")
    try:
        work.mkdir()
        build = cmake_build(source, work, CMAKE_ARGS, [BUILD_TARGET])
        # Packed where the build tree has them: the server finds its libraries by its RUNPATH,
        # `$ORIGIN/../src:$ORIGIN/../ggml/src` (libwhisper, libggml*), as in the published image,
        # which holds the whole build tree.
        libraries = sorted(p for p in build.rglob("lib*.so*") if "CMakeFiles" not in p.parts)
        pack(dest, [(path, str(path.relative_to(build))) for path in [build / "bin" / BUILD_TARGET, *libraries]])
    finally:
        shutil.rmtree(work, ignore_errors=True)


def build_whisper_server_image(podman: LocalPodman, python_image: str, remote: str, work: Path, cache: Path) -> str:
    """`python_image` with the cached `whisper-server` (built first if need be) laid out as whisper.cpp's
    published image, pushed to `remote` (`host/repo`): `host/repo@sha256:…`. A replica's process is
    `whisper-server …`, found on PATH (`/app/build/bin`), since nexa sets the program over an image
    entrypoint that is not an exec wrapper (`bash -c` takes one string). The local image and the
    local copy of `python_image` are removed."""
    tarball, _ = whisper_server_build(cache)
    tree = work / "app" / "build"
    tree.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tarball) as archive:
        unpack(archive, tree)
    (work / "Containerfile").write_text(
        f"FROM {python_image}\n"
        f"COPY app {APP_DIR}\n"
        f"WORKDIR {APP_DIR}\n"
        f"ENV PATH={BIN_DIR}:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin\n"
        'ENTRYPOINT ["bash", "-c"]\n'
    )
    pushed = build_image(podman, work, remote)
    podman.run("rmi", "--ignore", python_image, check=False)
    return pushed
