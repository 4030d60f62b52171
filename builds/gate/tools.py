"""The release gate's checks that drive tools: the quality gates, the SBOM and the secret scan.

Each returns `(ok, detail, findings)`. Tools are taken from the interpreter's own environment (the
project's .venv, where `.ci/dev test` installs the `test` extra), then from PATH; a missing tool is
a failure that says how to install it, never a skip.
"""

from __future__ import annotations

import fnmatch
import json
import os
import shutil
import subprocess
import sys
import tempfile
import tomllib
from importlib import metadata
from pathlib import Path
from typing import Final

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

Result = tuple[bool, str, list[str]]

#: What the Python quality gates lint (those of these that exist under the root).
LINTED: Final = ("nexa", "tests", "perf", "builds/gate")
INSTALL_HINT: Final = "install the test extra: .venv/bin/pip install -e '.[test]' (bash .ci/dev test does)"
#: The known test fixtures the secret scanner may report, each with why it is no secret.
ALLOWLIST: Final = "builds/gate/secrets-allowed.json"


def tool(name: str) -> str | None:
    here = Path(sys.executable).parent / name
    return str(here) if here.is_file() and os.access(here, os.X_OK) else shutil.which(name)


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def _run(root: Path, argv: list[str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, cwd=root, capture_output=True, text=True, check=False)


def quality(root: Path, name: str) -> Result:
    """One quality gate by its check name: ruff-check, ruff-format, mypy, lint-imports."""
    paths = [p for p in LINTED if (root / p).exists()]
    argv = {
        "ruff-check": ["ruff", "check", "--no-cache", *paths],
        "ruff-format": ["ruff", "format", "--check", "--no-cache", *paths],
        "mypy": ["mypy"],
        "lint-imports": ["lint-imports", "--no-cache"],
    }[name]
    exe = tool(argv[0])
    if exe is None:
        return False, f"{argv[0]} not found: {INSTALL_HINT}", []
    done = _run(root, [exe, *argv[1:]])
    out = (done.stdout + done.stderr).strip()
    if done.returncode == 0:
        return True, f"{' '.join(argv)}: {_last_line(out)}", []
    lines = [line for line in out.splitlines() if line.strip()]
    return False, f"{' '.join(argv)} (exit {done.returncode}): {_last_line(out)}", lines[:40]


# --- SBOM ---------------------------------------------------------------------------------------


def runtime_requirements(root: Path) -> tuple[list[str], dict[str, str], list[str]]:
    """(the runtime dependencies pyproject.toml names, every distribution they pull in with its
    installed version, problems): the binary's Python dependencies as this environment has them."""
    try:
        project = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    except (OSError, KeyError, tomllib.TOMLDecodeError) as exc:
        return [], {}, [f"pyproject.toml: no [project] table ({exc})"]
    direct = [Requirement(text) for text in project.get("dependencies", [])]
    names = [canonicalize_name(r.name) for r in direct]
    versions: dict[str, str] = {}
    problems = []
    todo: list[tuple[Requirement, frozenset[str]]] = [(r, frozenset(r.extras)) for r in direct]
    while todo:
        req, extras = todo.pop()
        name = canonicalize_name(req.name)
        if name in versions:
            continue
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:
            problems.append(f"{req.name}: not installed in {sys.prefix} (bash .ci/dev test installs it)")
            continue
        versions[name] = dist.version
        for text in dist.requires or []:
            sub = Requirement(text)
            envs = [{"extra": e} for e in extras] or [{"extra": ""}]
            if sub.marker is None or any(sub.marker.evaluate(env) for env in envs):
                todo.append((sub, frozenset(sub.extras)))
    return names, versions, problems


def sbom(root: Path, out: Path) -> Result:
    """A CycloneDX JSON SBOM of the runtime dependencies, written to `out`, that lists each of them."""
    names, versions, problems = runtime_requirements(root)
    if problems:
        return False, problems[0], problems
    exe = tool("cyclonedx-py")
    if exe is None:
        return False, f"cyclonedx-py (cyclonedx-bom) not found: {INSTALL_HINT}", []
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="nexa-sbom-") as tmp:
        reqs = Path(tmp) / "requirements.txt"
        reqs.write_text("".join(f"{n}=={v}\n" for n, v in sorted(versions.items())))
        argv = [exe, "requirements", str(reqs), "--pyproject", "pyproject.toml", "--of", "JSON"]
        done = _run(root, [*argv, "--output-reproducible", "-o", str(out)])
    if done.returncode != 0:
        return False, f"cyclonedx-py failed (exit {done.returncode}): {_last_line(done.stderr)}", []
    try:
        bom = json.loads(out.read_text(encoding="utf-8"))
        listed = {canonicalize_name(c["name"]) for c in bom.get("components", [])}
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return False, f"{out}: not a CycloneDX JSON document ({exc})", []
    missing = [n for n in names if n not in listed]
    if missing or bom.get("bomFormat") != "CycloneDX":
        return False, f"{out} does not list {', '.join(missing) or 'a CycloneDX bomFormat'}", []
    rel = out.relative_to(root) if out.is_relative_to(root) else out
    return (
        True,
        f"{rel}: CycloneDX {bom.get('specVersion')}, {len(listed)} components, all {len(names)} runtime"
        " dependencies listed",
        [],
    )


# --- secrets ------------------------------------------------------------------------------------


def _allowlist(root: Path) -> tuple[list[dict[str, str]], list[str]]:
    path = root / ALLOWLIST
    if not path.is_file():
        return [], []
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except ValueError as exc:
        return [], [f"{ALLOWLIST}: not JSON ({exc})"]
    keys = ("path", "type", "hashed_secret", "why")
    problems = [
        f"{ALLOWLIST}[{i}]: needs non-empty {', '.join(keys)} (why: the reason it is no secret)"
        for i, e in enumerate(entries)
        if not isinstance(e, dict) or not all(isinstance(e.get(k), str) and e[k].strip() for k in keys)
    ]
    return ([] if problems else entries), problems


def secrets(root: Path, files: list[str]) -> Result:
    """detect-secrets over every file of the tree; a finding passes only when the allowlist names
    its file (a glob), its type and its hashed secret, with a reason."""
    exe = tool("detect-secrets")
    if exe is None:
        return False, f"detect-secrets not found: {INSTALL_HINT}", []
    allowed, problems = _allowlist(root)
    if problems:
        return False, problems[0], problems
    # The allowlist holds only the findings' hashes and reasons, which the scanner would report.
    done = _run(root, [exe, "scan", "--all-files", *(f for f in files if f != ALLOWLIST)])
    if done.returncode != 0:
        return False, f"detect-secrets failed (exit {done.returncode}): {_last_line(done.stderr)}", []
    results: dict[str, list[dict[str, object]]] = json.loads(done.stdout)["results"]
    findings = []
    excused = 0
    for path, hits in sorted(results.items()):
        for hit in hits:
            if any(
                fnmatch.fnmatchcase(path, e["path"])
                and hit["type"] == e["type"]
                and hit["hashed_secret"] == e["hashed_secret"]
                for e in allowed
            ):
                excused += 1
                continue
            findings.append(
                f"{path}:{hit['line_number']}: {hit['type']} (if it is a test value, add it to {ALLOWLIST})"
            )
    if findings:
        return False, f"{len(findings)} possible secret(s): {findings[0]}", findings
    return True, f"detect-secrets: {len(files)} files, no secret ({excused} known test values allowed)", []
