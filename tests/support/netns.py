"""Probes run in a network namespace of the test's own (`unshare --net`): only its loopback, and
what the probe's own nft rules do there, nothing of this host's network is touched."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from tests.realparts import need, need_root

REPO = Path(__file__).resolve().parents[2]


def probe_in_own_netns(module: str, timeout_s: float = 60) -> dict[str, Any]:
    """Run `python -m module` (a probe under tests/support) in a new network namespace, with the real
    nft; the JSON object it printed. Needs root, unshare and nft (bash .ci/dev installs them)."""
    need("nft")
    need("unshare")
    need_root("a network namespace and its nftables")
    done = subprocess.run(
        ["unshare", "--net", sys.executable, "-m", module],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert done.returncode == 0, done.stderr
    got: dict[str, Any] = json.loads(done.stdout)
    return got
