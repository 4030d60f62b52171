"""The `nexa` command: the process entry and roles (`entry`, `roles`), and the operator CLI, one
module per resource (`keys`, `nodes`, `audit`, `registry`, `models`, `deployments`, `gateway`) over
the shared table of list and show commands (`tables`) and output helpers (`output`, `common`).
"""

from __future__ import annotations

import sys

# httpx imports its own command line (`httpx._main`: click, rich, pygments) whenever those happen to
# be installed, and nexa never runs it. `None` in sys.modules is the import system's "absent" mark:
# httpx then takes its not-installed path, and no nexa process (a node agent above all) holds them.
if "httpx._main" not in sys.modules:
    sys.modules["httpx._main"] = None  # type: ignore[assignment]

from nexa.cli.entry import main as main

__all__ = ["main"]
