"""`nexa node` never loads the controller's libraries: what the agent imports stays in its memory (issue 16)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

#: Libraries only the controller uses (its store and its HTTP server).
CONTROLLER_ONLY = ("apsw", "quart", "quart_trio", "werkzeug", "hypercorn")

#: Runs `nexa node` as `python -m nexa node` does, up to the point where the role would start under
#: trio (`_run_role`), then prints the top-level packages loaded.
_PROBE = """
import json, sys
import nexa.cli.roles as roles

def report(serve, announce):
    print(json.dumps(sorted({name.split(".")[0] for name in sys.modules})))
    return 0

roles._run_role = report
from nexa.cli import main
sys.exit(main(["node", "--state-dir", sys.argv[1]]))
"""


def test_nexa_node_never_imports_the_controller_libraries(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, str(tmp_path / "node")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    loaded = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert "nexa" in loaded and "trio" in loaded  # the probe reached the agent's imports
    assert loaded.isdisjoint(CONTROLLER_ONLY), sorted(loaded & set(CONTROLLER_ONLY))
