"""`nexa models push`, `nexa models manifest`, `register --manifest` and the one S3 client, against a real
S3 store (SeaweedFS) and a controller running as its own process: the directory walk and its refusals,
multipart uploads (the object really went up in parts), re-runs that upload only what changed, progress on
stderr, and the client's typed errors and aborts.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import secrets
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final

import attrs
import pytest
import trio

from nexa.contracts.manifest import ROOT_ENTRY
from nexa.errors import ArtifactInvalid, ArtifactRefused, ArtifactSizeMismatch
from nexa.push import MANIFEST_SUFFIX, LocalFile, Progress, PushOptions, build_manifest, options_problems, walk
from nexa.s3.client import S3Client
from nexa.sigv4 import S3Credentials
from tests.conftest import ControllerProcess, free_port
from tests.realparts import S3Store

MiB: Final = 1024**2
#: A file above the test's 8 MiB multipart threshold: three 5 MiB parts (5 + 5 + 1).
BIG: Final = 11 * MiB


def write_model(root: Path) -> dict[str, bytes]:
    """A Hugging Face-like directory of 7 files: one in a sub-directory, one empty, one above 8 MiB."""
    files = {
        "config.json": b'{"architectures": ["LlamaForCausalLM"], "hidden_size": 64}',
        "generation_config.json": b'{"do_sample": false}',
        "tokenizer.json": b'{"version": "1.0"}',
        "model-00001-of-00002.safetensors": secrets.token_bytes(BIG),
        "model-00002-of-00002.safetensors": secrets.token_bytes(300_000),
        "original/params.json": b'{"dim": 64}',
        "added_tokens.json": b"",
    }
    for path, data in files.items():
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_bytes(data)
    return files


# --- the walk -------------------------------------------------------------------------------------


def test_the_walk_is_sorted_and_follows_symlinks_to_files_inside(tmp_path: Path) -> None:
    write_model(tmp_path)
    (tmp_path / "empty-dir").mkdir()
    (tmp_path / "alias.json").symlink_to("config.json")
    files = walk(tmp_path)
    paths = [f.path for f in files]
    assert paths == sorted(paths)
    assert "original/params.json" in paths and "empty-dir" not in paths
    alias = next(f for f in files if f.path == "alias.json")
    assert alias.size_bytes == (tmp_path / "config.json").stat().st_size


def test_git_metadata_and_the_hub_download_cache_are_left_out_with_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    write_model(tmp_path)
    (tmp_path / ".git" / "objects").mkdir(parents=True)
    (tmp_path / ".git" / "objects" / "pack").write_bytes(b"a second copy of every file")
    (tmp_path / ".cache" / "huggingface").mkdir(parents=True)
    (tmp_path / ".cache" / "huggingface" / "download.lock").write_text("")
    (tmp_path / ".cache" / "keep.txt").write_text("another cache's file is the model's")
    with caplog.at_level("WARNING", logger="nexa.push"):
        paths = [f.path for f in walk(tmp_path)]
    assert not any(p.startswith((".git/", ".cache/huggingface/")) for p in paths)
    assert ".cache/keep.txt" in paths
    assert "leaving out .git/" in caplog.text and "leaving out .cache/huggingface/" in caplog.text


def test_a_single_file_is_a_manifest_of_one(tmp_path: Path) -> None:
    (tmp_path / "tiny.gguf").write_bytes(b"GGUF" + bytes(100))
    manifest, files = trio.run(build_manifest, tmp_path / "tiny.gguf")
    assert [f.path for f in manifest.files] == ["tiny.gguf"] and manifest.entry == "tiny.gguf"
    assert files == [LocalFile(path="tiny.gguf", source=tmp_path / "tiny.gguf", size_bytes=104)]
    assert manifest.files[0].sha256 == hashlib.sha256(b"GGUF" + bytes(100)).hexdigest()


def test_the_entry_defaults_to_a_split_ggufs_first_shard(tmp_path: Path) -> None:
    for i in (1, 2):
        (tmp_path / f"tiny-0000{i}-of-00002.gguf").write_bytes(secrets.token_bytes(1000))
    manifest, _ = trio.run(build_manifest, tmp_path)
    assert manifest.entry == "tiny-00001-of-00002.gguf"
    write_model(tmp_path / "hf")
    assert trio.run(build_manifest, tmp_path / "hf")[0].entry == ROOT_ENTRY


def _fifo(d: Path) -> str:
    os.mkfifo(d / "weights.pipe")
    return "weights.pipe"


def _socket(d: Path) -> str:
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(d / "agent.sock"))
    return "agent.sock"


def _symlink_out(d: Path) -> str:
    (d / "sub").mkdir()
    (d / "sub" / "leak").symlink_to("/etc/hostname")
    return "sub/leak"


def _symlink_up(d: Path) -> str:
    (d.parent / f"{d.name}-outside.bin").write_bytes(b"x" * 10)
    (d / "up.bin").symlink_to(f"../{d.name}-outside.bin")
    return "up.bin"


def _symlink_dir(d: Path) -> str:
    (d / "loop").symlink_to(".")
    return "loop"


def _dangling(d: Path) -> str:
    (d / "gone.bin").symlink_to("nowhere.bin")
    return "gone.bin"


def _backslash(d: Path) -> str:
    (d / "a\\b.json").write_bytes(b"{}")
    return "a\\\\b.json"


REFUSALS: Final = {
    "fifo": (_fifo, "a fifo"),
    "socket": (_socket, "a socket"),
    "symlink out": (_symlink_out, "leaves the directory"),
    "symlink up": (_symlink_up, "leaves the directory"),
    "symlink to a directory": (_symlink_dir, "symlink to a directory"),
    "dangling symlink": (_dangling, "symlink to nothing"),
    "bad path": (_backslash, "cannot be in a manifest"),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_a_file_that_cannot_be_pushed_is_refused_by_name(tmp_path: Path, case: str) -> None:
    make, why = REFUSALS[case]
    model = tmp_path / "model"
    model.mkdir()
    write_model(model)
    name = make(model)
    with pytest.raises(ArtifactInvalid, match=f"cannot push '?{re.escape(name)}'?: .*{why}.*nothing was uploaded"):
        walk(model)


def test_an_empty_directory_and_one_of_empty_files_are_refused(tmp_path: Path) -> None:
    (tmp_path / "empty" / "sub").mkdir(parents=True)
    with pytest.raises(ArtifactInvalid, match="holds no files"):
        walk(tmp_path / "empty")
    (tmp_path / "hollow").mkdir()
    (tmp_path / "hollow" / "a.json").write_bytes(b"")
    (tmp_path / "hollow" / "b.json").write_bytes(b"")
    with pytest.raises(ArtifactInvalid, match="every file in it is empty"):
        walk(tmp_path / "hollow")


def test_an_entry_not_in_the_directory_is_refused(tmp_path: Path) -> None:
    write_model(tmp_path)
    with pytest.raises(ArtifactInvalid, match=r"manifest\.entry: 'nope\.gguf' is neither"):
        trio.run(lambda: build_manifest(tmp_path, entry="nope.gguf"))


def test_parts_below_s3s_minimum_are_refused() -> None:
    assert options_problems(PushOptions(part_size=5 * MiB)) == []
    assert options_problems(PushOptions(part_size=5 * MiB - 1)) == [
        "--part-size: at least 5MiB (5242880 bytes): S3 refuses smaller parts but the last"
    ]
    assert options_problems(PushOptions(parallel=0)) == ["--parallel: 1 to 64"]


# --- progress -------------------------------------------------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_progress_shows_bytes_rate_and_eta() -> None:
    clock, out = FakeClock(), io.StringIO()
    progress = Progress(100 * MiB, stream=out, tty=False, clock=clock)
    assert progress.interval_s == 5.0
    clock.now += 2
    progress.add(25 * MiB)
    progress.show()
    progress.note("uploaded config.json, 0.0 MiB")
    clock.now += 6
    progress.add(75 * MiB)
    progress.finish()
    lines = out.getvalue().splitlines()
    assert lines[0] == "uploaded 25.0 MiB of 100.0 MiB (25%), 13.1 MB/s, ETA 6 s"
    assert lines[1] == "uploaded config.json, 0.0 MiB"
    assert lines[2] == "uploaded 100.0 MiB of 100.0 MiB (100%), 13.1 MB/s in 8.0 s"
    assert "\r" not in out.getvalue()


def test_progress_on_a_terminal_rewrites_one_line() -> None:
    clock, out = FakeClock(), io.StringIO()
    progress = Progress(10 * MiB, stream=out, tty=True, clock=clock)
    assert progress.interval_s == 0.25
    clock.now += 1
    progress.add(MiB)
    progress.show()
    progress.add(MiB)
    progress.show()
    progress.note("skipped a.json (the store holds it with the same sha256)")
    text = out.getvalue()
    assert text.count("\r") == 3 and text.count("\n") == 1
    assert text.endswith("\r\x1b[Kskipped a.json (the store holds it with the same sha256)\n")


# --- the S3 client against SeaweedFS --------------------------------------------------------------


def client(s3: S3Store, **over: Any) -> S3Client:
    return S3Client(s3.endpoint, region=s3.region, credentials=over.get("credentials", s3.credentials))


async def pending_uploads(s3: S3Store, key: str) -> list[str]:
    """The unfinished multipart uploads of `key` (`GET /bucket?uploads&prefix=key`)."""
    async with client(s3) as c:
        url = c._url(s3.bucket, "", f"uploads&prefix={key}")  # the bucket itself
        response = await c._request("GET", url, what="list uploads")
    return re.findall(r"<UploadId>([^<]+)</UploadId>", response.text)


async def test_the_client_puts_heads_and_uploads_in_parts(tmp_path: Path, s3_store: S3Store) -> None:
    data = secrets.token_bytes(BIG)
    path = tmp_path / "big.bin"
    path.write_bytes(data)
    sha = hashlib.sha256(data).hexdigest()
    prefix = f"{secrets.token_hex(4)}/"
    seen: list[int] = []
    with trio.fail_after(60):
        async with client(s3_store) as c:
            assert await c.head(s3_store.bucket, prefix + "absent") is None
            await c.put_file(s3_store.bucket, prefix + "one.bin", path, size_bytes=BIG, sha256=sha)
            one = await c.head(s3_store.bucket, prefix + "one.bin")
            _, parts = await c.put_file_multipart(
                s3_store.bucket, prefix + "parts.bin", path, size_bytes=BIG, sha256=sha,
                part_size=5 * MiB, on_bytes=seen.append,
            )  # fmt: skip
            multi = await c.head(s3_store.bucket, prefix + "parts.bin")
    assert one is not None and one.size_bytes == BIG and one.metadata["sha256"] == sha
    assert not one.etag.rstrip('"').endswith("-1")
    assert parts == 3 and multi is not None
    assert multi.size_bytes == BIG and multi.metadata["sha256"] == sha
    assert re.fullmatch(r'"?[0-9a-f]{32}-3"?', multi.etag), multi.etag
    assert sum(seen) == BIG and max(seen) <= MiB  # streamed in 1 MiB chunks, never whole


async def test_a_failed_multipart_upload_is_aborted(tmp_path: Path, s3_store: S3Store) -> None:
    path = tmp_path / "short.bin"
    path.write_bytes(secrets.token_bytes(7 * MiB))
    key = f"{secrets.token_hex(4)}/short.bin"
    with trio.fail_after(60):
        async with client(s3_store) as c:
            # It claims 12 MiB: the last part finds the file too short, and the upload is dropped.
            with pytest.RaisesGroup(pytest.RaisesExc(ArtifactSizeMismatch, match="shrank"), flatten_subgroups=True):
                await c.put_file_multipart(
                    s3_store.bucket, key, path, size_bytes=12 * MiB, sha256=None, part_size=5 * MiB,
                    limiter=trio.CapacityLimiter(1),
                )  # fmt: skip
            assert await c.head(s3_store.bucket, key) is None
        assert await pending_uploads(s3_store, key) == []


async def test_store_refusals_are_typed_and_name_the_s3_code(tmp_path: Path, s3_store: S3Store) -> None:
    path = tmp_path / "f.bin"
    path.write_bytes(b"abc")
    wrong = S3Credentials(s3_store.credentials.access_key_id, "not-the-secret-at-all")
    with trio.fail_after(30):
        async with client(s3_store, credentials=wrong) as c:
            with pytest.raises(ArtifactRefused, match="403 SignatureDoesNotMatch") as caught:
                await c.put_file(s3_store.bucket, "x/f.bin", path, size_bytes=3, sha256=None)
            assert "not-the-secret" not in str(caught.value)
        unknown = S3Credentials("nexa-no-such-key", s3_store.credentials.secret_access_key)
        async with client(s3_store, credentials=unknown) as c:
            with pytest.raises(ArtifactRefused, match="403 InvalidAccessKeyId"):
                await c.create_multipart(s3_store.bucket, "x/f.bin")
            with pytest.raises(ArtifactRefused, match=r"HEAD .*x/f\.bin: 403"):
                await c.head(s3_store.bucket, "x/f.bin")


# --- the CLI against a controller process ---------------------------------------------------------


@attrs.frozen
class Cluster:
    cp: ControllerProcess
    s3: S3Store
    creds_file: Path

    def push(self, model: Path, version: str, *extra: str, name: str = "llama") -> Any:
        return self.cp.cli(
            "models", "push", name, version, str(model), "--format", "safetensors", "--memory", "40GiB",
            "--source", "https://huggingface.co/org/llama@abc123", "--spdx", "Apache-2.0",
            "--s3-endpoint", self.s3.endpoint, "--s3-region", self.s3.region,
            "--s3-credentials-file", str(self.creds_file), "--multipart-threshold", "8MiB", "--part-size", "5MiB",
            "--progress-interval", "0.05", *extra,
        )  # fmt: skip

    def models(self) -> list[dict[str, Any]]:
        out = self.cp.cli("models", "list", "--json")
        assert out.returncode == 0, out.stderr
        return list(json.loads(out.stdout)["models"])


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, s3_store: S3Store) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("push")
    creds = tmp / "s3-credentials.json"
    creds.write_text(
        json.dumps(
            {
                "access_key_id": s3_store.credentials.access_key_id,
                "secret_access_key": s3_store.credentials.secret_access_key,
            }
        )
    )
    creds.chmod(0o600)
    config_file = tmp / "control.toml"
    config_file.write_text(
        f'[artifacts]\ns3_endpoint = "{s3_store.endpoint}"\ns3_region = "{s3_store.region}"\n'
        f's3_credentials_file = "{creds}"\n'
    )
    cp = ControllerProcess(state_dir=tmp / "state", port=free_port())
    try:
        cp.start("--config", str(config_file))
        yield Cluster(cp=cp, s3=s3_store, creds_file=creds)
    finally:
        cp.kill()


async def object_bytes(s3: S3Store, key: str) -> bytes:
    async with client(s3) as c:
        response = await c._request("GET", c._url(s3.bucket, key), what="GET")
    return response.content


@pytest.mark.slow
def test_push_uploads_registers_and_a_rerun_uploads_only_the_change(cluster: Cluster, tmp_path: Path) -> None:
    model = tmp_path / "llama"
    files = write_model(model)
    to = f"s3://{cluster.s3.bucket}/{secrets.token_hex(4)}/models/llama/"
    local, _ = trio.run(build_manifest, model)

    first = cluster.push(model, "v1", "--to", to, "--json")
    assert first.returncode == 0, first.stderr
    out = json.loads(first.stdout)
    assert out["model"]["state"] == "Candidate"
    assert out["model"]["artifact"]["sha256"] == local.digest
    assert out["model"]["artifact"]["size_bytes"] == sum(len(d) for d in files.values())
    assert out["uploaded"] == sorted(files) and out["skipped"] == []
    assert out["multipart"] == {"model-00001-of-00002.safetensors": 3}
    # Progress on stderr, not a terminal: whole lines with bytes, rate and ETA, and a final line.
    progress = [line for line in first.stderr.splitlines() if line.startswith("uploaded ") and " of " in line]
    assert progress and re.fullmatch(
        r"uploaded [\d.]+ MiB of [\d.]+ MiB \(100%\), [\d.]+ MB/s in [\d.]+ s", progress[-1]
    )
    assert "\r" not in first.stderr and cluster.s3.credentials.secret_access_key not in first.stderr

    bucket_prefix = to.removeprefix(f"s3://{cluster.s3.bucket}/")
    big_key = bucket_prefix + "model-00001-of-00002.safetensors"

    async def stored() -> tuple[Any, bytes]:
        async with client(cluster.s3) as c:
            head = await c.head(cluster.s3.bucket, big_key)
        return head, await object_bytes(cluster.s3, bucket_prefix.rstrip("/") + MANIFEST_SUFFIX)

    head, manifest_object = trio.run(stored)
    assert head.etag.strip('"').endswith("-3")  # it really went up in parts
    assert manifest_object == local.canonical_bytes()

    # Issue 30 point 13: version 2 with one changed file, pushed to version 1's prefix, would overwrite a
    # file version 1's manifest names (and break it): refused, naming the file and the version, and
    # nothing is uploaded or registered.
    config = (model / "config.json").read_bytes()
    (model / "config.json").write_bytes(b'{"architectures": ["LlamaForCausalLM"], "hidden_size": 128}')
    before = cluster.models()
    refused = cluster.push(model, "v2", "--to", to, "--json")
    assert refused.returncode == 1, refused.stdout
    assert refused.stderr.startswith("nexa: error: cannot push config.json") and "model llama@v1" in refused.stderr
    assert "Nothing was uploaded" in refused.stderr
    assert cluster.models() == before
    assert trio.run(object_bytes, cluster.s3, bucket_prefix + "config.json") == config
    verified = cluster.cp.cli("models", "verify", "llama", "v1")
    assert verified.returncode == 0, verified.stderr  # version 1 still verifies, byte for byte
    # Under a prefix of its own it goes up whole, and shares nothing it could break.
    to2 = f"s3://{cluster.s3.bucket}/{secrets.token_hex(4)}/models/llama/v2/"
    second = cluster.push(model, "v2", "--to", to2, "--json")
    assert second.returncode == 0, second.stderr
    again = json.loads(second.stdout)
    assert again["uploaded"] == sorted(files) and again["skipped"] == []
    assert again["model"]["artifact"]["sha256"] == trio.run(build_manifest, model)[0].digest != local.digest

    # A re-run with the same bytes as a registered version (here v1's) skips every file.
    (model / "config.json").write_bytes(config)
    human = cluster.push(model, "v3", "--to", to)
    assert human.returncode == 0, human.stderr
    assert "Candidate" in human.stdout and "uploaded     0; skipped 7" in human.stdout
    assert human.stderr.count("skipped ") == 7

    shown = cluster.cp.cli("models", "show", "llama", "v3")
    assert shown.returncode == 0, shown.stderr
    assert "(the manifest's digest)" in shown.stdout and "entry        . (of 7 files)" in shown.stdout
    assert re.search(r"file {7}model-00001-of-00002\.safetensors {2}11\.0 MiB", shown.stdout), shown.stdout


@pytest.mark.parametrize("case", ["fifo", "symlink out", "empty"])
def test_a_refused_push_names_the_file_and_uploads_and_registers_nothing(
    cluster: Cluster, tmp_path: Path, case: str
) -> None:
    model = tmp_path / "model"
    model.mkdir()
    if case == "empty":
        name = str(model)
    else:
        write_model(model)
        name = REFUSALS[case][0](model)
    before = cluster.models()
    prefix = f"{secrets.token_hex(4)}/refused/"
    out = cluster.push(model, "v1", "--to", f"s3://{cluster.s3.bucket}/{prefix}", name=f"refused-{case[:5]}")
    assert out.returncode == 1, out.stdout
    assert out.stderr.startswith("nexa: error: cannot push ") and name in out.stderr
    assert cluster.models() == before

    async def nothing_stored() -> None:
        async with client(cluster.s3) as c:
            for path in ("config.json", "model-00001-of-00002.safetensors"):
                assert await c.head(cluster.s3.bucket, prefix + path) is None
            assert await c.head(cluster.s3.bucket, prefix.rstrip("/") + MANIFEST_SUFFIX) is None

    trio.run(nothing_stored)


@pytest.mark.slow
def test_manifest_then_register_with_it_for_other_upload_tools(cluster: Cluster, tmp_path: Path) -> None:
    model = tmp_path / "own-tools"
    files = write_model(model)
    printed = cluster.cp.cli("models", "manifest", str(model))
    assert printed.returncode == 0, printed.stderr
    local, _ = trio.run(build_manifest, model)
    assert printed.stdout.encode() == local.canonical_bytes() + b"\n"
    assert f"manifest sha256 {local.digest}: 7 files" in printed.stderr

    prefix = f"{secrets.token_hex(4)}/own/"
    for path, data in files.items():
        trio.run(cluster.s3.put, prefix + path, data)
    (tmp_path / "m.json").write_text(printed.stdout)
    common = ["--format", "safetensors", "--memory", "40GiB", "--source", "https://example.com/own"]
    uri = f"s3://{cluster.s3.bucket}/{prefix}"
    manifest_file = str(tmp_path / "m.json")
    out = cluster.cp.cli(
        "models", "register", "own", "v1", "--uri", uri, "--manifest", manifest_file, *common, "--json"
    )
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["artifact"]["sha256"] == local.digest

    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({**json.loads(printed.stdout), "entry": "missing.bin"}))
    refused = cluster.cp.cli("models", "register", "own", "v2", "--uri", uri, "--manifest", str(bad), *common)
    assert refused.returncode == 2 and "manifest.entry: 'missing.bin'" in refused.stderr
    both = cluster.cp.cli(
        "models", "register", "own", "v3", "--uri", uri, "--manifest", manifest_file, "--size", "5", *common
    )
    assert both.returncode == 2 and "leave out --sha256 and --size" in both.stderr
    assert [m["version"] for m in cluster.models() if m["name"] == "own"] == ["v1"]
