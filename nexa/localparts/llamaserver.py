"""llama.cpp's own C++ `llama-server`, built here from source and cached, and its runtime image laid out
as llama.cpp's published server image (`ghcr.io/ggml-org/llama.cpp:server`, `.devops/cpu.Dockerfile` in
llama.cpp's source): the binary and its shared libraries in /app, `WORKDIR /app`,
`ENTRYPOINT ["/app/llama-server"]`, a HEALTHCHECK that asks `/health` with curl.

The source is the llama.cpp that the llama-cpp-python sdist on PyPI vendors (`vendor/llama.cpp`, with
`tools/server`), fetched with pip (PyPI is the one package index the build machines reach). It is built
with cmake for the CPU (no native tuning, no TLS, no curl, no web UI download, the RPC backend on),
`llama-server` and the RPC backend's worker (`ggml-rpc-server`, as this llama.cpp names `rpc-server`) only, and
packed into `cache_dir()` under a name keyed by the recipe: the first run builds it (about 7 minutes
on a quiet 2-core machine), later runs unpack it. The image is built on the cached Debian python image
(`images.build_python_image`), which carries curl and libgomp.

The same build also gives llama-cpp-python its shared libraries (`llama_cpp_python_wheel`): the sdist's
Python package is made into a wheel without compiling anything, and the libraries this build made from the
very same source go into its `llama_cpp/lib`, so a machine compiles llama.cpp once, not twice.
"""

from __future__ import annotations

import fnmatch
import os
import platform
import shutil
import sys
import tarfile
from pathlib import Path
from typing import Final

from nexa.errors import ConfigError
from nexa.localparts.cmake import (
    DOWNLOAD_TIMEOUT_S,
    GGML_PROJECT_FLAGS,
    cmake_build,
    pack,
    parts_missing,
    run_logged,
    unpack,
)
from nexa.localparts.images import build_image, cached_build, recipe_name
from nexa.localparts.podman import LocalPodman

#: The sdist whose `vendor/llama.cpp` is built (the version the llama-cpp-python runtime image carries).
LLAMA_SERVER_SDIST: Final = ("llama-cpp-python", "0.3.36")
#: cmake's cache arguments: a portable CPU build of the server and the RPC worker, nothing fetched while building.
#: `GGML_RPC`: the RPC backend (`llama-server --rpc HOST:PORT,…` on a group's head, `ggml-rpc-server` on its
#: workers), as llama.cpp's tools/rpc/README.md builds it; the published CPU image leaves it off.
#: `CMAKE_BUILD_RPATH_USE_ORIGIN`: the binary finds its libraries beside it ($ORIGIN), wherever it lies.
CMAKE_ARGS: Final = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DGGML_NATIVE=OFF",
    "-DLLAMA_CURL=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",
    "-DGGML_RPC=ON",
    # The server's, common's, mtmd's and libllama's C++ (JSON, templates, HTTP: about nine tenths of
    # the compile) at -O1, which compiles in about 60 % of -O3's CPU time (-O3 for clip.cpp: 34 s,
    # -O1: 13 s); ggml, where the tensor kernels are, keeps -O3 (`GGML_PROJECT_FLAGS`).
    "-DCMAKE_C_FLAGS_RELEASE=-O1 -DNDEBUG",
    "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG",
)
BUILD_TARGET: Final = "llama-server"
#: The RPC backend's worker program, built beside the server (tools/rpc: target `ggml-rpc-server`).
RPC_TARGET: Final = "ggml-rpc-server"
#: The built shared libraries llama-cpp-python loads (its CMakeLists installs `llama`, the `ggml` family and
#: `mtmd` into `llama_cpp/lib`); the server's own (`llama-common`, `llama-server-impl`) are left out.
PYTHON_LIBS: Final = ("libllama.so*", "libggml*.so*", "libmtmd.so*")
#: Where the published image has the server, and where the adapter's bare `llama-server` is found.
APP_DIR: Final = "/app"


def llama_server_name() -> str:
    """The cache file of the built server, named by its recipe (the sdist, cmake's arguments and target)."""
    recipe: dict[str, object] = {
        "sdist": LLAMA_SERVER_SDIST,
        "source": "vendor/llama.cpp",
        "cmake": CMAKE_ARGS,
        "ggml": GGML_PROJECT_FLAGS,
        "target": [BUILD_TARGET, RPC_TARGET],
        "pack": "bin/llama-server bin/ggml-rpc-server bin/lib*.so*",
    }
    return recipe_name(f"llama-server-{LLAMA_SERVER_SDIST[1]}", recipe)


def llama_server_parts_missing() -> str | None:
    """What building the server here lacks, in one line; None if nothing."""
    return parts_missing()


def llama_server_build(cache: Path, *, rebuild: bool = False) -> tuple[Path, bool]:
    """The cached tarball of the built server (`llama-server` and its shared libraries), built first if
    it is missing (or `rebuild`). Returns the path and whether it was built now."""
    return cached_build(
        cache, llama_server_name(), _build, rebuild=rebuild, clear=lambda d: shutil.rmtree(d, ignore_errors=True)
    )


def _build(dest: Path) -> None:
    """About 7 minutes of a quiet 2-core machine (830 s of CPU)."""
    if problem := llama_server_parts_missing():
        raise ConfigError(f"building llama-server needs {problem}")
    work = dest.with_name(f".{dest.name}.build.{os.getpid()}")
    try:
        work.mkdir()
        name, version = LLAMA_SERVER_SDIST
        pip = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:", "--no-deps", "--dest", str(work)]
        run_logged(
            [*pip, "--disable-pip-version-check", f"{name}=={version}"], work / "download.log", DOWNLOAD_TIMEOUT_S
        )
        (sdist,) = work.glob("*.tar.gz")
        with tarfile.open(sdist) as archive:
            unpack(archive, work / "src")
        (source,) = (work / "src").glob("*/vendor/llama.cpp")
        binaries = cmake_build(source, work, CMAKE_ARGS, [BUILD_TARGET, RPC_TARGET]) / "bin"
        files = sorted([binaries / BUILD_TARGET, binaries / RPC_TARGET, *binaries.glob("lib*.so*")])
        pack(dest, [(path, path.name) for path in files])
    finally:
        shutil.rmtree(work, ignore_errors=True)


def llama_cpp_python_wheel(cache: Path) -> Path:
    """llama-cpp-python's wheel for this machine (`LLAMA_SERVER_SDIST`), cached: its Python package from
    the sdist, packed with `LLAMA_BUILD=OFF` (nothing compiled), and in its `llama_cpp/lib` the shared
    libraries of the cached server build (`llama_server_build`, built first if need be), which is the
    same llama.cpp source. Install it with `pip install "WHEEL[server]"`."""
    name, version = LLAMA_SERVER_SDIST
    folder = cache / recipe_name(f"{name}-{version}-wheel", {"server": llama_server_name(), "libs": PYTHON_LIBS})
    folder = folder.with_name(folder.name.removesuffix(".tar.gz"))
    wheel = f"{name.replace('-', '_')}-{version}-py3-none-linux_{platform.machine()}.whl"

    def build(dest: Path) -> None:
        tarball, _ = llama_server_build(cache)
        work = dest.with_name(f".{dest.name}.build.{os.getpid()}")
        try:
            work.mkdir()
            env = {**os.environ, "CMAKE_ARGS": "-DLLAMA_BUILD=OFF"}
            pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
            # No pip cache: a wheel without libraries must never be handed to another install.
            run_logged(
                [
                    *pip,
                    "wheel",
                    "--no-deps",
                    "--no-cache-dir",
                    "--no-binary",
                    name,
                    "--wheel-dir",
                    str(work / "bare"),
                    f"{name}=={version}",
                ],
                work / "wheel.log",
                DOWNLOAD_TIMEOUT_S,
                env=env,
            )
            (bare,) = (work / "bare").glob("*.whl")
            run_logged(
                [sys.executable, "-m", "wheel", "unpack", "-d", str(work / "tree"), str(bare)], work / "unpack.log", 120
            )
            (tree,) = (work / "tree").iterdir()
            libs = tree / "llama_cpp" / "lib"
            libs.mkdir(parents=True, exist_ok=True)
            with tarfile.open(tarball) as archive:
                members = [m for m in archive.getmembers() if any(fnmatch.fnmatch(m.name, p) for p in PYTHON_LIBS)]
                unpack(archive, work / "libs", members)
            for lib in sorted((work / "libs").iterdir()):
                shutil.copyfile(lib, libs / lib.name)  # a wheel holds no links: each name is a copy, as upstream's
            (work / "out").mkdir()
            run_logged(
                [sys.executable, "-m", "wheel", "pack", "-d", str(work / "out"), str(tree)], work / "pack.log", 120
            )
            (work / "out" / wheel).replace(dest)
        finally:
            shutil.rmtree(work, ignore_errors=True)

    path, _ = cached_build(folder, wheel, build, rebuild=False, clear=lambda d: shutil.rmtree(d, ignore_errors=True))
    return path


def build_llama_server_image(podman: LocalPodman, python_image: str, remote: str, work: Path, cache: Path) -> str:
    """`python_image` with the cached `llama-server` (built first if need be) laid out as llama.cpp's
    published server image, pushed to `remote` (`host/repo`): `host/repo@sha256:…`. `/app` also holds the
    RPC worker `ggml-rpc-server`, as the published `full` image holds every program its build made
    (`cp build/bin/* /app`). The local image and the local copy of `python_image` are removed."""
    tarball, _ = llama_server_build(cache)
    app = work / "app"
    app.mkdir(parents=True, exist_ok=True)
    with tarfile.open(tarball) as archive:
        unpack(archive, app)
    (work / "Containerfile").write_text(
        f"FROM {python_image}\n"
        f"COPY app {APP_DIR}\n"
        "ENV LLAMA_ARG_HOST=0.0.0.0\n"
        f"WORKDIR {APP_DIR}\n"
        'HEALTHCHECK CMD ["curl", "-f", "http://localhost:8080/health"]\n'
        f'ENTRYPOINT ["{APP_DIR}/llama-server"]\n'
    )
    pushed = build_image(podman, work, remote)
    podman.run("rmi", "--ignore", python_image, check=False)
    return pushed
