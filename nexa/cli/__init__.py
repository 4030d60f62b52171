"""The `nexa` command: the process entry and roles (`entry`, `roles`), and the operator CLI, one
module per resource (`keys`, `nodes`, `audit`, `registry`, `models`, `deployments`, `gateway`) over
the shared table of list and show commands (`tables`) and output helpers (`output`, `common`).
"""

from __future__ import annotations

from nexa.cli.entry import main as main

__all__ = ["main"]
