"""llama-cpp-python's wheel made from the llama-server build (`nexa.localparts.llamaserver.
llama_cpp_python_wheel`): what `.ci/dev` installs on a machine without a prebuilt wheel, so that llama.cpp is
compiled once for both the C++ server and the Python bindings.

It uses the cached server build (`cache_dir()`, built first if it is missing, as the `llama_server_image`
tests do), so it is `slow`.
"""

from __future__ import annotations

import fnmatch
import json
import platform
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

from nexa.localparts.images import cache_dir
from nexa.localparts.llamaserver import PYTHON_LIBS, llama_cpp_python_wheel, llama_server_build
from tests.support.realmodel import cosine, reference_embedding

pytestmark = pytest.mark.slow

TEXT = "the same source, built once"


def test_the_wheel_carries_the_server_builds_libraries_and_embeds_as_the_reference(
    llama_build: None, tiny_embedding_gguf: Path, tmp_path: Path
) -> None:
    wheel = llama_cpp_python_wheel(cache_dir())
    assert wheel.name == f"llama_cpp_python-0.3.36-py3-none-linux_{platform.machine()}.whl"

    # Its llama_cpp/lib is exactly the Python bindings' share of the server build, byte for byte.
    tarball, built = llama_server_build(cache_dir())
    assert not built, "the wheel was made from the cached server build"
    with tarfile.open(tarball) as archive:
        expected = {}
        for member in archive.getmembers():
            if any(fnmatch.fnmatch(member.name, pattern) for pattern in PYTHON_LIBS):
                target = archive.getmember(member.name)
                while target.issym():  # a link in the tarball is a copy in the wheel
                    target = archive.getmember(target.linkname)
                data = archive.extractfile(target)
                assert data is not None
                expected[f"llama_cpp/lib/{member.name}"] = data.read()
    assert {"llama_cpp/lib/libllama.so", "llama_cpp/lib/libggml.so", "llama_cpp/lib/libmtmd.so"} <= set(expected)
    with zipfile.ZipFile(wheel) as packed:
        libs = {name: packed.read(name) for name in packed.namelist() if name.startswith("llama_cpp/lib/")}
        record = packed.read(next(n for n in packed.namelist() if n.endswith(".dist-info/RECORD"))).decode()
    assert libs == expected
    assert all(name in record for name in libs), "pip must know the libraries it installs"

    # Installed on its own, its bindings load those libraries and embed as this environment's llama-cpp-python.
    target = tmp_path / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(target), str(wheel)],
        check=True,
        timeout=300,
    )
    probe = (
        "import json, sys, llama_cpp\n"
        "m = llama_cpp.Llama(sys.argv[1], embedding=True, verbose=False)\n"
        "v = m.create_embedding(sys.argv[2])['data'][0]['embedding']\n"
        "print(json.dumps({'module': llama_cpp.__file__, 'vector': v}))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe, str(tiny_embedding_gguf), TEXT],
        env={"PYTHONPATH": str(target), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
    )
    answer = json.loads(out.stdout.strip().splitlines()[-1])
    assert answer["module"].startswith(str(target))
    assert cosine(answer["vector"], reference_embedding(tiny_embedding_gguf, TEXT)) > 0.9999

    # A second call finds it in the cache.
    assert llama_cpp_python_wheel(cache_dir()) == wheel
