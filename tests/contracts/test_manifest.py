"""The manifest vocabulary: canonical bytes and digest, path rules, entry points, and records made
before manifests (a single object) loading as manifests of one. Pure logic."""

from __future__ import annotations

import hashlib
import json

import pytest

from nexa.contracts import codec
from nexa.contracts.manifest import (
    LEGACY_FILE,
    ArtifactFile,
    Manifest,
    default_entry,
    entry_path,
    manifest_problems,
    path_problem,
)
from nexa.contracts.models import ModelRecord
from nexa.contracts.runtime import ArtifactRef

A, B = "a" * 64, "b" * 64


def test_the_canonical_bytes_are_exactly_the_documented_encoding() -> None:
    manifest = Manifest(
        files=[
            ArtifactFile(path="z.json", size_bytes=2, sha256=B),
            ArtifactFile(path="é/w.bin", size_bytes=1, sha256=A),
        ],
        entry=".",
    )
    expected = (
        '{"entry":".","files":[{"path":"z.json","sha256":"' + B + '","size_bytes":2},'
        '{"path":"é/w.bin","sha256":"' + A + '","size_bytes":1}],"schema":"nexa.manifest/v1"}'
    ).encode()
    assert manifest.canonical_bytes() == expected
    assert manifest.digest == hashlib.sha256(expected).hexdigest()
    assert manifest.size_bytes == 3
    # The same files in another order are the same manifest; another entry is another one.
    reordered = Manifest(files=list(reversed(manifest.files)), entry=".")
    assert reordered.digest == manifest.digest
    assert Manifest(files=manifest.files, entry="z.json").digest != manifest.digest


@pytest.mark.parametrize(
    ("path", "problem"),
    [
        ("", "must not be empty"),
        ("/etc/passwd", "relative"),
        ("a/../b", "'..'"),
        ("..", "'..'"),
        ("a//b", "empty"),
        ("./a", "'.'"),
        ("a\\b", "'/'"),
        ("a\nb", "control"),
        ("x" * 513, "at most"),
        ("weights/" + "w" * 256, "255 bytes"),
        ("ü" * 128 + "/config.json", "255 bytes"),  # 256 bytes of UTF-8 in 128 characters
    ],
)
def test_unsafe_paths_are_refused_with_the_reason(path: str, problem: str) -> None:
    found = path_problem(path)
    assert found is not None and problem in found


def test_good_paths_pass() -> None:
    for path in ("config.json", "weights/model-00001-of-00002.safetensors", ".gitattributes", "a b/ü.txt", "x" * 255):
        assert path_problem(path) is None


def test_manifest_problems_name_every_bad_field() -> None:
    files = [
        ArtifactFile(path="a", size_bytes=1, sha256=A),
        ArtifactFile(path="a/b", size_bytes=1, sha256=A),
        ArtifactFile(path="c", size_bytes=-1, sha256="nothex"),
        ArtifactFile(path="c", size_bytes=1, sha256=A),
    ]
    problems = manifest_problems(files, "missing.bin")
    assert any(p.startswith("artifact.files[0].path:") and "also a directory" in p for p in problems)
    assert any(p.startswith("artifact.files[2].size_bytes:") for p in problems)
    assert any(p.startswith("artifact.files[2].sha256:") for p in problems)
    assert any(p.startswith("artifact.files[3].path:") and "twice" in p for p in problems)
    assert any(p.startswith("artifact.entry:") for p in problems)
    assert manifest_problems([], ".") == ["artifact.files: at least one file"]
    assert manifest_problems([ArtifactFile(path="empty", size_bytes=0, sha256=A)], ".") == [
        "artifact.files: the files hold no bytes"
    ]
    ok = [ArtifactFile(path="engine/rank0.engine", size_bytes=5, sha256=A)]
    assert manifest_problems(ok, "engine") == manifest_problems(ok, ".") == []


def test_the_default_entry_is_the_one_file_the_first_shard_or_the_directory() -> None:
    assert default_entry(["model.gguf"]) == "model.gguf"
    split = ["m-00002-of-00003.gguf", "m-00001-of-00003.gguf", "m-00003-of-00003.gguf", "README.md"]
    assert default_entry(split) == "m-00001-of-00003.gguf"
    assert default_entry(["README.md", "q4.gguf"]) == "q4.gguf"
    assert default_entry(["config.json", "model.safetensors", "tokenizer.json"]) == "."
    assert entry_path("/models/llama", ".") == "/models/llama"
    assert entry_path("/models/llama", "w/m-00001-of-00002.gguf") == "/models/llama/w/m-00001-of-00002.gguf"


def test_a_record_made_before_manifests_loads_as_a_manifest_of_one() -> None:
    old = {
        "name": "tiny",
        "version": "v1",
        "artifact": {"uri": "s3://models/tiny.gguf", "sha256": A, "size_bytes": 9},
        "format": "gguf",
        "memory_bytes": 2**30,
        "provenance": {"source": "x", "signer": ""},
        "license": None,
        "signature": None,
        "state": "Approved",
        "registered_at": 1.0,
        "registered_by": None,
        "state_changed_at": 1.0,
        "state_changed_by": None,
        "verification": None,
        "last_evaluation": None,
    }
    record = codec.loads(codec.store, json.dumps(old), ModelRecord)
    manifest = record.artifact.manifest()
    assert [(f.path, f.sha256, f.size_bytes) for f in manifest.files] == [(LEGACY_FILE, A, 9)]
    assert record.artifact.object_uri(LEGACY_FILE) == "s3://models/tiny.gguf"
    ref = ArtifactRef(uri=record.artifact.uri, sha256=A, size_bytes=9)
    assert ref.model_path == "/models/model"  # the mounted file itself, as before


def test_an_artifact_ref_with_files_points_the_runtime_at_its_entry() -> None:
    files = [ArtifactFile(path="w/m-00001-of-00002.gguf", size_bytes=5, sha256=A)]
    ref = ArtifactRef(
        uri="s3://models/tiny/v1/", sha256=B, size_bytes=5, files=files, entry=files[0].path, mount_path="/models/tiny"
    )
    assert ref.model_path == "/models/tiny/w/m-00001-of-00002.gguf"
    assert ref.object_uri(files[0].path) == "s3://models/tiny/v1/w/m-00001-of-00002.gguf"
    with pytest.raises(ValueError, match="mount_path"):
        ArtifactRef(uri="s3://models/tiny/v1/", sha256=B, size_bytes=5, files=files, entry=".", mount_path="/etc")
    with pytest.raises(ValueError, match="entry"):
        ArtifactRef(
            uri="s3://models/tiny/v1/", sha256=B, size_bytes=5, files=files, entry="nope", mount_path="/models/t"
        )
