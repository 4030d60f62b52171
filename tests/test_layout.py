"""The tests' own layout: a test module imports its helpers from `tests.support` (or `tests.realparts`,
`tests.conftest`), never from another test module, so no test file is another's library."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
#: The modules of `tests` that others may import: the helper package, the real servers, the root conftest.
ALLOWED = ("tests.support", "tests.realparts", "tests.conftest")


def _imports(path: Path, root: Path) -> list[tuple[int, str, list[str]]]:
    """(line, module, names imported from it) of every import in `path`, a module under `root`."""
    tree = ast.parse(path.read_text(), filename=str(path))
    package = [root.name, *path.relative_to(root).parts[:-1]]
    found: list[tuple[int, str, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            found.append((node.lineno, module, [alias.name for alias in node.names]))
    return found


def offences(path: Path, root: Path = TESTS) -> list[str]:
    """What `path` imports from `root`'s package that is a test module or not a helper module."""
    out = []
    where = path.relative_to(root.parent)
    for line, module, names in _imports(path, root):
        parts = module.split(".")
        if parts[0] != root.name:
            continue
        if any(p.startswith("test_") for p in parts[1:]):
            out.append(f"{where}:{line} imports the test module {module}")
        elif tests := [n for n in names if n.startswith("test_")]:
            out += [f"{where}:{line} imports the test module {module}.{n}" for n in tests]
        elif len(parts) > 1 and not any(module == a or module.startswith(a + ".") for a in ALLOWED):
            out.append(f"{where}:{line} imports {module}, which is not a helper module")
    return out


def test_no_test_module_imports_another_and_helpers_live_in_support() -> None:
    files = sorted(p for p in TESTS.rglob("*.py") if "fixtures" not in p.relative_to(TESTS).parts)
    assert len(files) > 50
    assert [o for path in files for o in offences(path)] == []


@pytest.mark.parametrize(
    ("source", "wanted"),
    [
        ("from tests.control.test_api import make_key\n", "imports the test module tests.control.test_api"),
        ("from tests.node import test_supervisor as s\n", "imports the test module tests.node.test_supervisor"),
        ("import tests.test_messaging\n", "imports the test module tests.test_messaging"),
        ("from .test_agent import aset\n", "imports the test module tests.node.test_agent"),
        ("from . import test_agent\n", "imports the test module tests.node.test_agent"),
        ("from tests.e2e.simcluster import SimCluster\n", "imports tests.e2e.simcluster, which is not a helper"),
        ("from tests.node.conftest import node\n", "imports tests.node.conftest, which is not a helper"),
    ],
)
def test_the_check_catches_each_way_of_importing_a_test_module(tmp_path: Path, source: str, wanted: str) -> None:
    root = tmp_path / "tests"
    (root / "node").mkdir(parents=True)
    module = root / "node" / "test_x.py"
    module.write_text(source)
    [offence] = offences(module, root)
    assert wanted in offence


def test_the_check_lets_helpers_the_root_conftest_and_libraries_through(tmp_path: Path) -> None:
    root = tmp_path / "tests"
    root.mkdir()
    module = root / "test_x.py"
    module.write_text(
        "import trio\nfrom nexa.contracts import wire\nfrom tests.conftest import Controller\n"
        "from tests.realparts import S3Store\nfrom tests.support.api import ok\nfrom tests.support import supervisor\n"
    )
    assert offences(module, root) == []
