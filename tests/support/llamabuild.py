"""llama.cpp's build, which `.ci/dev` may still be running in the background beside the tests: the tests
that need it (`tests.realparts.llama_build`) wait for it, and run last (tests/conftest.py)."""

from __future__ import annotations

import importlib
import os
import time
from pathlib import Path
from typing import Final

#: Set by `.ci/dev` while it builds: the path prefix of the build's markers (`PREFIX.done` once its
#: wheel is installed, `PREFIX.failed` if the build or the install failed) and of its log (`PREFIX.log`).
LLAMA_BUILD_ENV: Final = "NEXA_LLAMA_BUILD"
#: How long a test waits for that build (about 15 minutes of two cores on a fresh machine).
WAIT_S: Final = 3600.0


def building() -> bool:
    """Whether `.ci/dev` runs the tests beside the build (the markers say whether it is done)."""
    return bool(os.environ.get(LLAMA_BUILD_ENV))


def wait_for_build() -> str | None:
    """Wait until the build is done (at once when none runs); why it cannot be used, or None."""
    prefix = os.environ.get(LLAMA_BUILD_ENV)
    if not prefix:
        return None
    deadline = time.monotonic() + WAIT_S
    while not Path(f"{prefix}.done").exists():
        if Path(f"{prefix}.failed").exists():
            try:
                log = Path(f"{prefix}.log").read_text(errors="replace")[-3000:]
            except OSError:
                log = ""
            return f"the llama.cpp build failed; its log ({prefix}.log) ends:\n{log}"
        if time.monotonic() > deadline:
            return f"the llama.cpp build ({prefix}.log) did not finish in {WAIT_S:g} s"
        time.sleep(2.0)
    importlib.invalidate_caches()  # llama_cpp was installed into site-packages after this process started
    return None
