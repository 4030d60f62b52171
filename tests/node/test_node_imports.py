"""`nexa node` loads only what the agent uses: what it imports stays in its memory (issues 16 and 32,
`perf/node_memory.py`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

#: Libraries only the controller uses (its store, its HTTP server, the console's markdown).
CONTROLLER_ONLY = ("apsw", "psycopg", "quart", "quart_trio", "werkzeug", "hypercorn", "markdown_it")

#: Optional parts of libraries the agent does use, which it never needs: httpx's command line (click,
#: rich, pygments), httpcore's HTTP/2 and SOCKS support and its asyncio backend (anyio), and asyncio
#: itself (pyzmq's socket monitor imports it; only the controller's side of the channel watches one).
NEVER_USED = ("click", "rich", "pygments", "h2", "hpack", "hyperframe", "socksio", "anyio", "asyncio")

#: The agent signs and verifies with Ed25519 from PyNaCl (`nexa.security`) and seals nothing: no part
#: of cryptography (its Rust extension alone is about 7 MiB of a process's memory).
CRYPTOGRAPHY = ("cryptography",)

#: nexa's own modules the agent never uses: the controller, the operator CLI and its API client, and
#: the contracts only the controller, the operator commands and the release tools read.
NEXA_NOT_ON_A_NODE = (
    "nexa.control",
    "nexa.client",
    "nexa.cli.tables",
    "nexa.cli.nodes",
    "nexa.cli.deployments",
    "nexa.cli.evidence",
    "nexa.cli.models",
    "nexa.contracts.api",
    "nexa.contracts.gateway",
    "nexa.contracts.retention",
    "nexa.contracts.placement",
    "nexa.config.control",
    "nexa.contracts.evidence",
    "nexa.contracts.qualification",
    "nexa.contracts.deployments",
    "nexa.contracts.backup",
    "nexa.contracts.recovery",
)

#: Runs `nexa node` as `python -m nexa node` does, up to the point where the role would start under
#: trio (`_run_role`), then prints the modules loaded (a `None` entry marks a module absent: not loaded).
_PROBE = """
import json, sys
import nexa.cli.roles as roles

def report(serve, announce):
    print(json.dumps(sorted(name for name, module in sys.modules.items() if module is not None)))
    return 0

roles._run_role = report
from nexa.cli import main
sys.exit(main(["node", "--state-dir", sys.argv[1]]))
"""


def _loaded_by_nexa_node(tmp_path: Path) -> set[str]:
    done = subprocess.run(
        [sys.executable, "-c", _PROBE, str(tmp_path / "node")],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    loaded = set(json.loads(done.stdout.strip().splitlines()[-1]))
    assert {"nexa.node.agent", "nexa.channel.links", "trio", "httpx", "zmq"} <= loaded  # it reached the agent
    assert "nacl.signing" in loaded  # the agent's Ed25519
    return loaded


def _under(loaded: set[str], packages: tuple[str, ...]) -> list[str]:
    """The loaded modules that are one of `packages` or inside one."""
    return sorted(m for m in loaded if any(m == p or m.startswith(p + ".") for p in packages))


def test_nexa_node_never_imports_the_controller_libraries(tmp_path: Path) -> None:
    loaded = _loaded_by_nexa_node(tmp_path)
    assert _under(loaded, CONTROLLER_ONLY) == []


def test_nexa_node_leaves_out_what_the_agent_never_uses(tmp_path: Path) -> None:
    loaded = _loaded_by_nexa_node(tmp_path)
    assert _under(loaded, NEVER_USED) == []
    assert _under(loaded, CRYPTOGRAPHY) == []
    assert _under(loaded, NEXA_NOT_ON_A_NODE) == []
