"""The release gate's own scans: image pinning, the node's isolation boundary, public-answer leaks.

Each scan takes the tree's root (or the files it reads) and returns its findings, one string each
(`path:line: what`); no finding means the check passes. `gate.py` runs them and prints the lines.

Image references (`image_findings`). How the product and its docs name images: `--image REF`
(`nexa runtimes register`), `image = "REF"` / `image: REF` / `"image": "REF"` (TOML, YAML, JSON),
`FROM REF` (Containerfiles), `docker|podman|skopeo pull REF`. Scanned in README.md and every other
Markdown file, units/, tests/fixtures/ and builds/. A reference is pinned when it carries
`@sha256:` and 64 hex digits. Not references: placeholders (`$VAR`, `<image>`, `{image}`, an
all-caps word) and, in Markdown only, a digest written elided (`@sha256:…`, `@sha256:...`,
`@sha256:<digest>`): prose showing the shape, which nothing pulls.

The node's boundary (`isolation_findings`). What a node runs or stores may name only:
- the product's own paths: /etc/nexa/ (node.toml, inventory.json), /var/lib/nexa/ (state: keys,
  enrollment, fence, the artifact cache), the binary /usr/local/bin/nexa;
- the container engine's socket: /run/podman/podman.sock, /var/run/docker.sock, /run/docker.sock;
- the GPUs: /dev/nvidia*; and /dev/null; the host's memory figures, /proc/meminfo (read only);
- the kernel's device descriptions, /sys/ (read only: the fabric's RDMA devices and interfaces);
- inside a runtime container: /models/ (the verified artifact, mounted read-only) and
  /var/cache/nexa-runtime/ (the replica's own writable cache, a directory under the node's state
  directory mounted there), and nothing else of the host.
Checked: every string value of units/node.toml (the node's config example); every directive (not
comments) of units/nexa-node.service and units/nexa-node.service.d/*.conf; and each runtime
adapter's command line (but its program, a path of its digest-pinned image), environment and health
probe (but bash's `/dev/tcp/` socket on the runtime's own address and the readiness route it asks
for) as `nexa.adapters` builds them. A finding is
an absolute path outside the list above, a home directory (`~`), an application repository (a git
URL, github.com, gitlab.com, bitbucket.org, a `.git` path) or a credential (a value of a key named
like a password, token, secret or private key; an environment variable named like one).

Public answers (`leak_findings`). Every line of the `nexa sim --public-answers` file (JSON lines:
status, headers, body of answers a client saw) must hold no node address (127.0.0.11-127.0.0.15 or
any IPv4 address outside 127.0.0.0/8 and 0.0.0.0), no file path (the sim's state directory, a home
directory, the temporary directory, /var/lib/nexa), no container id (64 hex digits not named as a digest: `sha256:` in
front, or a key naming a sha256, digest, hash or signature), no key material (a PEM header, or any
key from a `*.key` file of the sim's state directory) and no stack trace (`Traceback`, `File "`).
"""

from __future__ import annotations

import ipaddress
import json
import re
import subprocess
import tomllib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Final

#: Directories never scanned when the root is not a git checkout (what .gitignore leaves out).
SKIPPED_DIRS: Final = frozenset(
    {
        ".git",
        ".venv",
        "node_modules",
        "build",
        "dist",
        "__pycache__",
        ".pytest_cache",
        ".mypy_cache",
        ".ruff_cache",
        ".import_linter_cache",
        ".nexa",
        "vendor",
    }
)


def tree_files(root: Path) -> list[str]:
    """The tree's files, relative to `root`: git's tracked and untracked-but-not-ignored files in a
    checkout, else every file outside `SKIPPED_DIRS`."""
    if (root / ".git").exists():
        out = subprocess.run(
            ["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            check=True,
            capture_output=True,
        ).stdout.decode()
        return sorted({p for p in out.split("\0") if p and (root / p).is_file()})
    found = []
    for path in root.rglob("*"):
        rel = path.relative_to(root)
        if path.is_file() and not any(part in SKIPPED_DIRS or part.endswith(".egg-info") for part in rel.parts):
            found.append(rel.as_posix())
    return sorted(found)


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return
    yield from enumerate(text.splitlines(), start=1)


# --- image references ---------------------------------------------------------------------------

_REF: Final = r"""["'`]?(?P<ref>[^\s"'`,;)\]]+)"""
_IMAGE_PATTERNS: Final = (
    re.compile(r"--image(?:=|\s+)" + _REF),
    re.compile(r"""(?<![\w-])["']?image["']?\s*[=:]\s*""" + _REF),
    re.compile(r"^\s*FROM\s+(?:--platform=\S+\s+)?" + _REF),
    re.compile(r"\b(?:docker|podman|skopeo)\s+pull\s+(?:-\S+\s+)*" + _REF),
)
_PINNED: Final = re.compile(r"@sha256:[0-9a-f]{64}(?![0-9a-fA-F])")
_ELIDED: Final = re.compile(r"@sha256:(?:…|\.\.\.|<[^>]*>)")
_PLACEHOLDER: Final = re.compile(r"^(?:\$.*|<.*|\{.*|[A-Z][A-Z0-9_]*|…|\.\.\.)$")


def image_scope(path: str) -> bool:
    """README, the docs, units/, tests/fixtures/ and builds/: where image references are examples."""
    return path.endswith(".md") or path.startswith(("units/", "tests/fixtures/", "builds/"))


def image_findings(root: Path, files: Iterable[str] | None = None) -> list[str]:
    findings = []
    for rel in files if files is not None else tree_files(root):
        if not image_scope(rel):
            continue
        markdown = rel.endswith(".md")
        for number, line in _lines(root / rel):
            for pattern in _IMAGE_PATTERNS:
                for match in pattern.finditer(line):
                    ref = match.group("ref")
                    if _PLACEHOLDER.match(ref) or _PINNED.search(ref):
                        continue
                    if markdown and _ELIDED.search(line[match.start("ref") :]):
                        continue
                    findings.append(f"{rel}:{number}: image {ref!r} is not pinned by digest (@sha256: + 64 hex)")
    return findings


# --- the node's isolation boundary --------------------------------------------------------------

#: Absolute paths a node may name (see the module docstring): a directory ends in `/`, a prefix in `*`.
ALLOWED_PATHS: Final = (
    "/etc/nexa/",
    "/var/lib/nexa/",
    "/usr/local/bin/nexa",
    "/run/podman/podman.sock",
    "/var/run/docker.sock",
    "/run/docker.sock",
    "/dev/nvidia*",
    "/dev/null",
    "/proc/meminfo",
    "/sys/",
    "/models/",
    "/var/cache/nexa-runtime/",
)
_ABS_PATH: Final = re.compile(r"(?<![\w.:/~-])(/[\w.@%+-]+(?:/[\w.@%*+-]*)*)")
_HOME: Final = re.compile(r"(?<![\w/])~[\w.-]*/")
_REPO: Final = re.compile(r"git@[\w.-]+:|(?:github\.com|gitlab\.com|bitbucket\.org)\b|\.git(?:/|\b(?!hub|lab)|$)")
_CREDENTIAL_NAME: Final = re.compile(r"pass(?:word|wd)?|token|secret|private[_-]?key|api[_-]?key|credential", re.I)


def _allowed(path: str, allowed: str) -> bool:
    if allowed.endswith("/"):
        return path == allowed[:-1] or path.startswith(allowed)
    if allowed.endswith("*"):
        return path.startswith(allowed[:-1])
    return path == allowed


def _outside(path: str) -> bool:
    clean = path.rstrip(".,:")
    return not any(_allowed(clean, allowed) for allowed in ALLOWED_PATHS)


def _value_findings(where: str, value: str) -> list[str]:
    out = [f"{where}: {p!r} is outside the node's boundary" for p in _ABS_PATH.findall(value) if _outside(p)]
    if _HOME.search(value):
        out.append(f"{where}: names a home directory ({value!r})")
    if _REPO.search(value):
        out.append(f"{where}: names an application repository ({value!r})")
    return out


def _toml_values(data: object, key: str = "") -> Iterator[tuple[str, str]]:
    if isinstance(data, dict):
        for k, v in data.items():
            yield from _toml_values(v, f"{key}.{k}" if key else str(k))
    elif isinstance(data, list):
        for i, v in enumerate(data):
            yield from _toml_values(v, f"{key}[{i}]")
    elif isinstance(data, str):
        yield key, data


def _node_config_findings(root: Path) -> list[str]:
    path = root / "units" / "node.toml"
    if not path.is_file():
        return ["units/node.toml: missing (the node's config example)"]
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        return [f"units/node.toml: not TOML ({exc})"]
    out = []
    for key, value in _toml_values(data):
        where = f"units/node.toml: {key}"
        out += _value_findings(where, value)
        # A credential file's path is fine (it is the operator's, read at run time); its content is not.
        leaf = key.rsplit(".", 1)[-1]
        if value and _CREDENTIAL_NAME.search(leaf) and not leaf.endswith(("_file", "_path")):
            out.append(f"{where}: holds a credential (use a *_file setting that names a 0600 file)")
    return out


def _unit_findings(root: Path) -> list[str]:
    units = [root / "units" / "nexa-node.service", *sorted((root / "units" / "nexa-node.service.d").glob("*.conf"))]
    out = []
    for unit in units:
        rel = unit.relative_to(root).as_posix()
        if not unit.is_file():
            out.append(f"{rel}: missing (the node's systemd unit)")
            continue
        for number, line in _lines(unit):
            stripped = line.strip()
            if not stripped or stripped.startswith(("#", ";", "[")) or "=" not in stripped:
                continue
            name, _, value = stripped.partition("=")
            where = f"{rel}:{number}: {name}"
            out += _value_findings(where, value)
            if name in ("Environment", "EnvironmentFile") and _CREDENTIAL_NAME.search(value):
                out.append(f"{where}: passes a credential to the agent")
    return out


def _adapter_findings() -> list[str]:
    from nexa import adapters
    from nexa.adapters.base import MODEL_PATH
    from nexa.adapters.llamacpp import LLAMACPP_VARIANTS
    from nexa.contracts.gateway import Capability
    from nexa.contracts.runtime import RUNTIME_HOST

    # An HTTP route the runtime is told to serve (whisper.cpp's `--inference-path`) is no file.
    routes = {c.path for c in Capability}
    out = []
    variants = {**{str(k): a for k, a in adapters.ADAPTERS.items()}, **LLAMACPP_VARIANTS}
    port = 18000
    for name, adapter in sorted(variants.items()):
        launch = adapter.launch("model", {}, ["nvidia.com/gpu=0"], port, model_path=MODEL_PATH)
        where = f"adapter {name}"
        # The program (first) is a path of the digest-pinned image (stable-diffusion.cpp's `/sd-server`).
        args = launch.command[len(adapter.program) :]
        # bash's `/dev/tcp/HOST/PORT` is a socket on the runtime's own address, not a file, and the probe's
        # request target is the readiness route (`base.bash_probe`).
        probe = [
            arg.replace(f"/dev/tcp/{RUNTIME_HOST}/{port}", " ").replace(f"GET {adapter.readiness_path} ", "GET ")
            for arg in launch.health.command
        ]
        for arg in [*args, *probe]:
            if arg not in routes:
                out += _value_findings(f"{where}: command", arg)
        for key, value in launch.env.items():
            out += _value_findings(f"{where}: env {key}", value)
            if _CREDENTIAL_NAME.search(key):
                out.append(f"{where}: env {key} looks like a credential")
    return out


def isolation_findings(root: Path) -> list[str]:
    return _node_config_findings(root) + _unit_findings(root) + _adapter_findings()


# --- public-answer leaks ------------------------------------------------------------------------

_NODE_ADDRESS: Final = re.compile(r"(?<![\d.])127\.0\.0\.1[1-5](?![\d])")
_IPV4: Final = re.compile(r"(?<![\w.])(\d{1,3}(?:\.\d{1,3}){3})(?!\d|\.\d)")
_PATHS: Final = re.compile(r"(?<![\w.])/(?:home|root|tmp)/|/var/lib/nexa\b")
_HEX64: Final = re.compile(r"(?<![0-9a-fA-F])([0-9a-f]{64})(?![0-9a-fA-F])")
_DIGEST_KEY: Final = re.compile(r"sha256|digest|hash|signature|etag", re.I)
_PEM: Final = re.compile(r"-----BEGIN [A-Z ]*(?:KEY|CERTIFICATE)-----")
_TRACE: Final = re.compile(r"Traceback|File \"")
#: Shorter runs from a key file are too likely to turn up by chance.
_MIN_KEY_CHARS: Final = 16


def state_secrets(state_dir: Path | None) -> list[str]:
    """Every key the sim's state directory holds in a `*.key` file (secret keys and API keys): the
    whole text, and each PEM body line, at least 16 characters each."""
    if state_dir is None or not state_dir.is_dir():
        return []
    out = set()
    for path in state_dir.rglob("*.key"):
        try:
            text = path.read_text(encoding="ascii").strip()
        except (UnicodeDecodeError, OSError):
            continue
        lines = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("-----")]
        out.update(x for x in [*lines, "".join(lines)] if len(x) >= _MIN_KEY_CHARS)
    return sorted(out)


def _strings(data: object, key: str = "") -> Iterator[tuple[str, str]]:
    """Every string of a decoded JSON value with the key it is under; a string that is itself JSON
    (a body kept as text) is opened too."""
    if isinstance(data, dict):
        for k, v in data.items():
            yield str(k), str(k)
            yield from _strings(v, str(k))
    elif isinstance(data, list):
        for v in data:
            yield from _strings(v, key)
    elif isinstance(data, str):
        yield key, data
        if data[:1] in "{[":
            try:
                inner = json.loads(data)
            except ValueError:
                return
            yield from _strings(inner, key)


def _text_findings(where: str, key: str, text: str, state_dir: str | None, secrets: list[str]) -> list[str]:
    out = []
    if m := _NODE_ADDRESS.search(text):
        out.append(f"{where}: a node address ({m.group(0)})")
    for ip in _IPV4.findall(text):
        try:
            address = ipaddress.IPv4Address(ip)
        except ValueError:
            continue
        if not address.is_loopback and not address.is_unspecified:
            out.append(f"{where}: a non-loopback address ({ip})")
    if (state_dir and state_dir in text) or _PATHS.search(text):
        out.append(f"{where}: a file path")
    if not _DIGEST_KEY.search(key):
        for m in _HEX64.finditer(text):
            if not text[: m.start()].endswith("sha256:"):
                out.append(f"{where}: a container id ({m.group(1)[:12]}…)")
                break
    if _PEM.search(text) or any(s in text for s in secrets):
        out.append(f"{where}: key material")
    if _TRACE.search(text):
        out.append(f"{where}: a stack trace")
    return out


def leak_findings(answers: Path, state_dir: Path | None) -> list[str]:
    secrets = state_secrets(state_dir)
    state_text = str(state_dir.resolve()) if state_dir is not None else None
    out: list[str] = []
    for number, line in _lines(answers):
        if not line.strip():
            continue
        where = f"{answers.name}:{number}"
        try:
            pieces = list(_strings(json.loads(line)))
        except ValueError:
            pieces = [("", line)]
        found: list[str] = []
        for key, text in pieces:
            found += [f for f in _text_findings(where, key, text, state_text, secrets) if f not in found]
        out += found
    return out
