"""`python -m nexa.localparts llama-python-wheel`: build (or find) the cached llama-cpp-python wheel whose
libraries come from the cached llama-server build (`llamaserver.llama_cpp_python_wheel`) and print its path.
`.ci/dev` installs it when no prebuilt wheel is at hand."""

from __future__ import annotations

import sys

from nexa.localparts.images import cache_dir
from nexa.localparts.llamaserver import llama_cpp_python_wheel

if sys.argv[1:] != ["llama-python-wheel"]:
    sys.exit("usage: python -m nexa.localparts llama-python-wheel")
print(llama_cpp_python_wheel(cache_dir()))
