"""A model artifact as a manifest: the files of a model directory and the runtime's entry point. Pure.

A model version's artifact is a set of files in the S3-compatible store (a Hugging Face directory
of `config.json`, tokenizer files and `*.safetensors` shards; a split GGUF; a TensorRT-LLM engine
directory) and an entry point: the file or directory inside it that the runtime is pointed at
(`.` is the directory itself). Each file is named by its path relative to the directory, its size
and its sha256. The manifest is identified by the sha256 of its canonical bytes
(`Manifest.canonical_bytes`): the same files and entry always give the same digest, wherever the
objects live, so the digest names the assembled directory on a node and is what a signature signs.

Where the objects live is the artifact's `uri`. With `files`, it is the prefix the paths are
under (`s3://bucket/models/llama/v1/` holds `…/v1/config.json`). Without `files` (records and
requests from before manifests), `uri` is one object, identified by its own sha256: a manifest of
one file named `model` (`LEGACY_FILE`), which is what nodes have mounted since the first release.

The canonical bytes, exactly (UTF-8 JSON, keys sorted, no insignificant whitespace, files
sorted by path, non-ASCII kept as is):

    {"entry":".","files":[{"path":"config.json","sha256":"<64 hex>","size_bytes":651},…],
     "schema":"nexa.manifest/v1"}
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Sequence
from typing import Final

import attrs

from nexa.contracts.codec import canonical_json

MANIFEST_SCHEMA: Final = "nexa.manifest/v1"
#: The entry point meaning "the directory itself" (vLLM, SGLang and TensorRT-LLM take a directory).
ROOT_ENTRY: Final = "."
#: The one file of an artifact registered as a single object (before manifests).
LEGACY_FILE: Final = "model"
#: A Hugging Face repository of the largest open models has about 200 files; an assignment
#: carries the manifest, and must stay far below a wire frame's limits.
MAX_FILES: Final = 1024
MAX_PATH_CHARS: Final = 512
#: A path segment becomes a file or directory name on a node: Linux file systems take 255 bytes.
MAX_SEGMENT_BYTES: Final = 255
MAX_FILE_BYTES: Final = 2**53
_SHA256_RE: Final = re.compile(r"^[0-9a-f]{64}$")
#: A split GGUF's shards: `<name>-00001-of-00003.gguf` (llama.cpp's `gguf-split` naming).
SPLIT_GGUF_RE: Final = re.compile(r"^(?P<stem>.+)-(?P<index>\d{5})-of-(?P<count>\d{5})\.gguf$")


@attrs.frozen(kw_only=True)
class ArtifactFile:
    """One file of a model directory: its relative POSIX path, size and sha256."""

    path: str
    size_bytes: int
    sha256: str


def _by_path(files: Iterable[ArtifactFile]) -> tuple[ArtifactFile, ...]:
    return tuple(sorted(files, key=lambda f: f.path))


@attrs.frozen(kw_only=True)
class Manifest:
    """The files of one model version and its entry point; `digest` identifies it."""

    files: tuple[ArtifactFile, ...] = attrs.field(converter=_by_path)
    entry: str

    def canonical_bytes(self) -> bytes:
        body = {
            "entry": self.entry,
            "files": [{"path": f.path, "sha256": f.sha256, "size_bytes": f.size_bytes} for f in self.files],
            "schema": MANIFEST_SCHEMA,
        }
        return canonical_json(body).encode("utf-8")

    @property
    def digest(self) -> str:
        """The hex sha256 of the canonical bytes."""
        return hashlib.sha256(self.canonical_bytes()).hexdigest()

    @property
    def size_bytes(self) -> int:
        return sum(f.size_bytes for f in self.files)

    def blobs(self) -> dict[str, int]:
        """sha256 → size of the distinct contents (two paths with the same bytes are one blob)."""
        return {f.sha256: f.size_bytes for f in self.files}


@attrs.frozen(kw_only=True)
class ArtifactLocation:
    """Where a model version's bytes are in the S3-compatible store, and what they must be.

    `sha256` identifies the artifact: the manifest's digest, or for a single object (no `files`)
    the object's own sha256. `size_bytes` is the total.
    """

    uri: str
    sha256: str = ""
    size_bytes: int = 0
    #: The files under the `uri` prefix; empty: `uri` is one object (a manifest of one).
    files: list[ArtifactFile] = attrs.Factory(list)
    #: The file or directory (relative, `.` for the root) the runtime is given; set with `files`.
    entry: str = ""

    def manifest(self) -> Manifest:
        """The manifest, a single object's being `{model}` with entry `model`."""
        if self.files:
            return Manifest(files=self.files, entry=self.entry or ROOT_ENTRY)
        one = ArtifactFile(path=LEGACY_FILE, size_bytes=self.size_bytes, sha256=self.sha256)
        return Manifest(files=(one,), entry=LEGACY_FILE)

    def object_uri(self, path: str) -> str:
        """The `s3://` URI of one file of the manifest."""
        if not self.files:
            return self.uri
        return self.uri.rstrip("/") + "/" + path


def entry_path(mount_path: str, entry: str) -> str:
    """What the runtime is pointed at, inside the container: the mount, or a path below it."""
    return mount_path if entry in ("", ROOT_ENTRY) else f"{mount_path.rstrip('/')}/{entry}"


# --- checks ------------------------------------------------------------------------------------


def path_problem(path: str) -> str | None:
    """Why `path` is not a safe relative POSIX path inside a model directory, or None."""
    checks = (
        (not path, "must not be empty"),
        (len(path) > MAX_PATH_CHARS, f"at most {MAX_PATH_CHARS} characters"),
        (not path.isprintable(), "no control characters or line breaks"),
        (path.startswith("/"), "must be relative (no leading '/')"),
        ("\\" in path, "separate directories with '/', not '\\'"),
        (
            any(p in ("", ".", "..") for p in path.split("/")),
            "no empty, '.' or '..' segments (the file must stay inside the directory)",
        ),
        (
            any(len(p.encode("utf-8", "surrogatepass")) > MAX_SEGMENT_BYTES for p in path.split("/")),
            f"each segment at most {MAX_SEGMENT_BYTES} bytes of UTF-8 (a file name on the node)",
        ),
    )
    return next((problem for failed, problem in checks if failed), None)


def manifest_problems(files: Sequence[ArtifactFile], entry: str, field: str = "artifact") -> list[str]:
    """Everything wrong with a manifest's files and entry, each `field.files[i].x: problem`."""
    problems: list[str] = []
    if not files:
        return [f"{field}.files: at least one file"]
    if len(files) > MAX_FILES:
        return [f"{field}.files: at most {MAX_FILES} files"]
    seen: dict[str, int] = {}
    for i, f in enumerate(files):
        at = f"{field}.files[{i}]"
        if problem := path_problem(f.path):
            problems.append(f"{at}.path: {problem}")
        elif f.path in seen:
            problems.append(f"{at}.path: {f.path!r} is listed twice (also files[{seen[f.path]}])")
        else:
            seen[f.path] = i
        if isinstance(f.size_bytes, bool) or not 0 <= f.size_bytes <= MAX_FILE_BYTES:
            problems.append(f"{at}.size_bytes: 0 or more bytes, up to 2^53")
        if not _SHA256_RE.match(f.sha256):
            problems.append(f"{at}.sha256: 64 lower-case hex digits")
    directories = {"/".join(p.split("/")[:n]) for p in seen for n in range(1, p.count("/") + 1)}
    for path in sorted(directories & seen.keys()):
        problems.append(f"{field}.files[{seen[path]}].path: {path!r} is a file and also a directory of other files")
    if sum(f.size_bytes for f in files) <= 0:
        problems.append(f"{field}.files: the files hold no bytes")
    if not entry:
        problems.append(f"{field}.entry: required with files: a file's path, a directory of them, or '.'")
    elif entry != ROOT_ENTRY and entry not in seen and entry.rstrip("/") not in directories:
        problems.append(f"{field}.entry: {entry[:80]!r} is neither a file nor a directory of the manifest, nor '.'")
    return problems


def default_entry(paths: Sequence[str]) -> str:
    """The entry point a directory suggests: its one file; else its one GGUF (a split GGUF's
    first shard); else the directory itself."""
    if len(paths) == 1:
        return paths[0]
    ggufs = sorted(p for p in paths if p.endswith(".gguf"))
    firsts = [p for p in ggufs if (m := SPLIT_GGUF_RE.match(p.rsplit("/", 1)[-1])) and int(m["index"]) == 1]
    if len(firsts) == 1:
        return firsts[0]
    if len(ggufs) == 1:
        return ggufs[0]
    return ROOT_ENTRY
