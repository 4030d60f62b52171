"""Source trees side by side: a benchmark runs a child process of itself per `--tree LABEL=DIR`,
each importing nexa from that tree, so a before tree (`git worktree add /tmp/before HEAD`) and this
one are measured in turns in one run (`perf/runtime_reads.py`, `perf/channel_sends.py`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def parse_trees(specs: Sequence[str]) -> dict[str, str]:
    """`LABEL=DIR` arguments as {label: dir}, in order; none: this checkout, as "this"."""
    return dict(spec.split("=", 1) for spec in specs) or {"this": "."}


def run_child(tree: str, argv: Sequence[str], timeout_s: float) -> dict[str, Any]:
    """Run this Python with `argv`, `tree` on its PYTHONPATH; the last line it printed, read as JSON."""
    env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
    done = subprocess.run(
        [sys.executable, *argv], capture_output=True, text=True, env=env, timeout=timeout_s, check=True
    )
    got: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return got
