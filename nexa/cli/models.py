"""`nexa models`: model versions and their lifecycle (register, push, verify, evaluate, approve …)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from nexa.cli import common
from nexa.cli.output import cell, print_json, size_text
from nexa.cli.tables import MODELS
from nexa.contracts.kvcache import kv_cache_bytes
from nexa.contracts.models import (
    EvaluationResult,
    LicenseRecord,
    ModelDetail,
    ModelFormat,
    ModelList,
    ModelRecord,
    Verification,
)
from nexa.errors import ConfigError

if TYPE_CHECKING:
    from nexa.contracts.manifest import Manifest
    from nexa.push import Held

EXIT_OK: Final = 0
#: Every format the controller takes (a hand-kept list once left whisper.cpp's `ggml` out).
MODEL_FORMATS: Final = tuple(str(f) for f in ModelFormat)
MODEL_STATES: Final = ("Candidate", "Verified", "Evaluated", "Approved", "Retired")


def add_commands(sub: Any, common_flags: argparse.ArgumentParser) -> None:
    models = sub.add_parser("models", help="model versions and their lifecycle (operator)").add_subparsers(
        metavar="VERB", required=True
    )
    s = models.add_parser("register", parents=[common_flags], help="register a version as Candidate")
    _model_version(s)
    s.add_argument(
        "--uri", required=True, help="s3://bucket/key of the artifact; with --manifest, the prefix its files are under"
    )
    s.add_argument("--manifest", help="a manifest file (`nexa models manifest`): register its files under --uri")
    s.add_argument("--sha256", help="the artifact's sha256 (64 hex); not with --manifest")
    s.add_argument(
        "--size", type=common.size, help="the artifact's size in bytes (or 8GiB, 512MiB, …); not with --manifest"
    )
    _model_claims(s)
    s.set_defaults(handler=_models_register)
    s = models.add_parser(
        "push", parents=[common_flags], help="upload a model directory (or one file) to S3 and register it as Candidate"
    )
    _model_version(s)
    s.add_argument("dir", metavar="DIR", help="the model directory, or a single file")
    s.add_argument("--to", help="s3://bucket/prefix/ to upload under (default s3://BUCKET/models/NAME/VERSION/)")
    s.add_argument("--bucket", default=os.environ.get("NEXA_S3_BUCKET"), help="the bucket of the default --to")
    _entry_flag(s)
    _model_claims(s)
    _push_flags(s)
    s.set_defaults(handler=_models_push)
    s = models.add_parser("manifest", help="print the manifest of a model directory (for uploads by other tools)")
    s.add_argument("dir", metavar="DIR", help="the model directory, or a single file")
    _entry_flag(s)
    s.set_defaults(handler=_models_manifest)
    s = models.add_parser("license", parents=[common_flags], help="record the licence and who accepted it")
    _model_version(s)
    _license_flags(s, required=True)
    s.set_defaults(handler=_models_license)
    s = models.add_parser(
        "verify", parents=[common_flags], help="the controller streams and hashes the artifact itself"
    )
    _model_version(s)
    s.add_argument("--signature", help="detached Ed25519 signature (base64) over the 32-byte sha256 digest")
    s.set_defaults(handler=_models_verify)
    s = models.add_parser("evaluate", parents=[common_flags], help="record an evaluation (a pass makes it Evaluated)")
    _model_version(s)
    s.add_argument("--suite", required=True)
    s.add_argument("--metric", action="append", default=[], help="NAME=NUMBER; repeat for more")
    verdict = s.add_mutually_exclusive_group(required=True)
    verdict.add_argument("--passed", dest="passed", action="store_true")
    verdict.add_argument("--failed", dest="passed", action="store_false")
    s.add_argument("--evidence", default="", help="where the full results are kept")
    s.set_defaults(handler=_models_evaluate)
    for verb in ("approve", "retire"):
        s = models.add_parser(verb, parents=[common_flags])
        _model_version(s)
        s.set_defaults(handler=_models_action, verb=verb)
    s = MODELS.add(models, common_flags)
    s.add_argument("--name")
    s.add_argument("--state", choices=MODEL_STATES)
    s = models.add_parser("show", parents=[common_flags])
    _model_version(s)
    s.set_defaults(handler=_models_show)


def _model_version(s: argparse.ArgumentParser) -> None:
    s.add_argument("name")
    s.add_argument("version")


def _model_claims(s: argparse.ArgumentParser) -> None:
    s.add_argument("--format", required=True, choices=MODEL_FORMATS)
    s.add_argument(
        "--kind",
        choices=("model", "lora"),
        default="model",
        help="lora: a LoRA adapter, served only on the base versions --base names (default model)",
    )
    s.add_argument(
        "--base",
        action="append",
        default=[],
        type=common.model_version,
        metavar="NAME@VERSION",
        help="a base model version a LoRA adapter applies to (repeat for more; with --kind lora)",
    )
    s.add_argument(
        "--memory", required=True, type=common.size, help="memory to schedule: weights plus runtime overhead"
    )
    s.add_argument("--source", required=True, help="provenance: where the weights come from")
    s.add_argument("--signer", default="", help="provenance: who signed them")
    s.add_argument(
        "--signature",
        help="detached Ed25519 signature (base64) over the 32-byte sha256 digest (a manifest's: see models manifest)",
    )
    _license_flags(s, required=False)


def _entry_flag(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "--entry",
        help="the file or directory the runtime is given, relative ('.' = the directory); "
        "default: the one file, else the one GGUF or a split GGUF's first shard, else '.'",
    )


def _push_flags(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "--s3-endpoint", default=os.environ.get("NEXA_S3_ENDPOINT"), help="the S3 endpoint URL ($NEXA_S3_ENDPOINT)"
    )
    s.add_argument("--s3-region", default=os.environ.get("NEXA_S3_REGION", "us-east-1"), help="($NEXA_S3_REGION)")
    s.add_argument(
        "--s3-credentials-file",
        default=os.environ.get("NEXA_S3_CREDENTIALS_FILE"),
        help='JSON {"access_key_id": …, "secret_access_key": …} ($NEXA_S3_CREDENTIALS_FILE); none: anonymous',
    )
    s.add_argument("--s3-no-tls-verify", action="store_true", help="do not verify the endpoint's TLS certificate")
    s.add_argument(
        "--multipart-threshold",
        type=common.size,
        default="64MiB",
        help="files of at least this size go up in parts (default 64MiB)",
    )
    s.add_argument(
        "--part-size",
        type=common.size,
        default="16MiB",
        help="bytes per part of a multipart upload; at least 5MiB, S3's minimum (default 16MiB)",
    )
    s.add_argument("--parallel", type=int, default=4, help="uploads (files and parts) in flight at once (default 4)")
    s.add_argument(
        "--progress-interval",
        type=float,
        help="seconds between progress lines (default 0.25 on a terminal, 5 otherwise)",
    )


def _license_flags(s: argparse.ArgumentParser, *, required: bool) -> None:
    terms = s.add_mutually_exclusive_group(required=required)
    terms.add_argument("--spdx", help="SPDX licence id or expression, e.g. Apache-2.0")
    terms.add_argument("--terms-sha256", help="sha256 of custom licence terms")
    terms.add_argument("--terms-file", help="custom licence terms: the file's sha256 is recorded")
    s.add_argument("--accepted-by", help="who accepted the terms (a person or a ticket)")
    s.add_argument(
        "--expires", type=common.when, help="when the acceptance expires: 2027-01-31, an ISO time, or unix seconds"
    )


def _license_body(args: argparse.Namespace) -> dict[str, Any] | None:
    terms_sha256 = args.terms_sha256
    if args.terms_file:
        import hashlib

        try:
            terms_sha256 = hashlib.sha256(Path(args.terms_file).read_bytes()).hexdigest()
        except OSError as exc:
            raise ConfigError(f"cannot read --terms-file {args.terms_file}: {exc.strerror}") from None
    if args.spdx is None and terms_sha256 is None:
        if args.accepted_by or args.expires:
            raise ConfigError("--accepted-by and --expires need --spdx, --terms-sha256 or --terms-file")
        return None
    return {
        "spdx_id": args.spdx,
        "terms_sha256": terms_sha256,
        "accepted_by": args.accepted_by,
        "expires_at": args.expires,
    }


def _model_path(args: argparse.Namespace) -> str:
    return f"/api/v1/models/{args.name}/{args.version}"


def _license_text(lic: LicenseRecord | None) -> str:
    if lic is None:
        return "-"
    terms = lic.spdx_id or f"custom terms sha256 {(lic.terms_sha256 or '')[:12]}…"
    accepted = f"accepted by {lic.accepted_by}" if lic.accepted_by else "not accepted"
    expires = f", expires {cell(lic.expires_at)}" if lic.expires_at else ""
    return f"{terms} ({accepted}{expires})"


def _print_model(args: argparse.Namespace, out: ModelRecord, what: str) -> None:
    if args.json:
        print_json(out)
    else:
        bases = f" (LoRA adapter for {', '.join(b.key for b in out.base)})" if out.base else ""
        print(f"model {out.name}@{out.version}: {out.state}{what}{bases}")


def _model_body(args: argparse.Namespace, artifact: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": args.name,
        "version": args.version,
        "artifact": artifact,
        "format": args.format,
        "memory_bytes": args.memory,
        "provenance": {"source": args.source, "signer": args.signer},
        "license": _license_body(args),
        "signature": args.signature,
        "kind": args.kind,
        "base": args.base,
    }


def _manifest_artifact(uri: str, manifest: Manifest) -> dict[str, Any]:
    """A manifest's artifact for `POST /api/v1/models`: no sha256 or size (the controller computes them)."""
    files = [{"path": f.path, "size_bytes": f.size_bytes, "sha256": f.sha256} for f in manifest.files]
    return {"uri": uri, "files": files, "entry": manifest.entry}


def _read_manifest(path: str) -> Manifest:
    """A manifest file as `nexa models manifest` prints it; ConfigError naming every problem."""
    from nexa.contracts.manifest import MANIFEST_SCHEMA, ArtifactFile, Manifest, manifest_problems

    try:
        data = json.loads(Path(path).read_bytes())
    except OSError as exc:
        raise ConfigError(f"cannot read --manifest {path}: {exc.strerror}") from None
    except ValueError:
        raise ConfigError(f"--manifest {path} is not valid JSON") from None
    if not isinstance(data, dict) or data.get("schema") != MANIFEST_SCHEMA or not isinstance(data.get("files"), list):
        raise ConfigError(
            f"--manifest {path}: not a manifest (a JSON object with schema {MANIFEST_SCHEMA!r} and files)"
        )
    try:
        files = [ArtifactFile(path=f["path"], size_bytes=f["size_bytes"], sha256=f["sha256"]) for f in data["files"]]
    except (TypeError, KeyError) as exc:
        raise ConfigError(f"--manifest {path}: every file needs path, size_bytes and sha256 ({exc})") from None
    entry = data.get("entry")
    if not isinstance(entry, str):
        raise ConfigError(f"--manifest {path}: entry must be a string")
    bad = [f"{f.path!r}" for f in files if not isinstance(f.path, str) or not isinstance(f.size_bytes, int)]
    problems = [f"files: {b} has a bad path or size" for b in bad] or manifest_problems(files, entry, field="manifest")
    if problems:
        raise ConfigError(f"--manifest {path}: " + "; ".join(problems), problems=tuple(problems))
    return Manifest(files=tuple(files), entry=entry)


def _models_register(args: argparse.Namespace) -> int:
    if args.manifest:
        if args.sha256 or args.size:
            raise ConfigError("--manifest gives the files' sha256 and size: leave out --sha256 and --size")
        artifact = _manifest_artifact(args.uri, _read_manifest(args.manifest))
    elif not args.sha256 or not args.size:
        raise ConfigError("--sha256 and --size are required (or --manifest FILE for a directory's files)")
    else:
        artifact = {"uri": args.uri, "sha256": args.sha256, "size_bytes": args.size}
    with common.client(args) as c:
        out = c.post("/api/v1/models", ModelRecord, body=_model_body(args, artifact))
    _print_model(args, out, " (registered; verify it next)")
    return EXIT_OK


def _models_manifest(args: argparse.Namespace) -> int:
    import trio

    from nexa.push import build_manifest

    manifest, _ = trio.run(partial(build_manifest, Path(args.dir), entry=args.entry))
    sys.stdout.write(manifest.canonical_bytes().decode("utf-8") + "\n")
    print(
        f"manifest sha256 {manifest.digest}: {len(manifest.files)} files, {manifest.size_bytes} bytes", file=sys.stderr
    )
    return EXIT_OK


def _models_push(args: argparse.Namespace) -> int:
    import trio

    from nexa.push import PushOptions, push_directory
    from nexa.s3.credentials import load_s3_credentials

    if not args.s3_endpoint:
        raise ConfigError("no S3 endpoint: pass --s3-endpoint or set NEXA_S3_ENDPOINT")
    to = args.to or (f"s3://{args.bucket}/models/{args.name}/{args.version}/" if args.bucket else None)
    if to is None:
        raise ConfigError("where to upload: pass --to s3://bucket/prefix/ or --bucket (or set NEXA_S3_BUCKET)")
    _license_body(args)  # refuse bad licence flags, and a missing API key, before any upload
    common.require_token(args)
    credentials = load_s3_credentials(args.s3_credentials_file) if args.s3_credentials_file else None
    with common.client(args) as c:
        held = _held_objects(c.get("/api/v1/models", ModelList).models)
    options = PushOptions(
        multipart_threshold=args.multipart_threshold, part_size=args.part_size, parallel=args.parallel
    )
    result = trio.run(
        partial(
            push_directory,
            Path(args.dir),
            to,
            endpoint=args.s3_endpoint,
            region=args.s3_region,
            credentials=credentials,
            tls_verify=not args.s3_no_tls_verify,
            entry=args.entry,
            options=options,
            progress_interval_s=args.progress_interval,
            held=held,
        )
    )
    m = result.manifest
    with common.client(args) as c:
        body = _model_body(args, _manifest_artifact(result.prefix_uri, m))
        out = c.post("/api/v1/models", ModelRecord, body=body)
    if args.json:
        from nexa.contracts import codec

        summary = {
            "model": codec.api.unstructure(out),
            "manifest_uri": result.manifest_uri,
            "uploaded": list(result.uploaded),
            "skipped": list(result.skipped),
            "multipart": result.multipart,
        }
        print(json.dumps(summary, indent=2, sort_keys=True))
        return EXIT_OK
    a = out.artifact
    print(f"model {out.name}@{out.version}: {out.state} (registered; verify it next)")
    print(f"manifest     {a.sha256} ({result.manifest_uri})")
    print(f"files        {len(m.files)}, {size_text(a.size_bytes)} in all; entry {m.entry}")
    print(f"uploaded     {len(result.uploaded)}; skipped {len(result.skipped)} (already in the store)")
    return EXIT_OK


def _held_objects(models: list[ModelRecord]) -> dict[str, Held]:
    """`s3://bucket/key` → what must stay there, for every file a registered version names."""
    from nexa.push import Held
    from nexa.s3.client import split_s3_uri

    held: dict[str, Held] = {}
    for record in models:
        artifact = record.artifact
        if not artifact.files:
            held[artifact.uri] = Held(artifact.sha256, record.key)
            continue
        bucket, prefix = split_s3_uri(artifact.uri)
        for f in artifact.files:
            held[f"s3://{bucket}/{prefix}{f.path}"] = Held(f.sha256, record.key)
    return held


def _models_license(args: argparse.Namespace) -> int:
    with common.client(args) as c:
        out = c.post(f"{_model_path(args)}/license", ModelRecord, body=_license_body(args))
    _print_model(args, out, f"; licence {_license_text(out.license)}")
    return EXIT_OK


def _models_verify(args: argparse.Namespace) -> int:
    body = {"signature": args.signature} if args.signature else None
    with common.client(args) as c:
        out = c.post(f"{_model_path(args)}/verify", ModelRecord, body=body)
    v = out.verification
    if v is None:  # the controller answers a verified record; say so if it did not
        _print_model(args, out, " (not verified)")
        return EXIT_OK
    signed = f", signature by key {v.signature_key}" if v.signature_key else ""
    _print_model(args, out, f" (sha256 {v.sha256}, {v.size_bytes} bytes in {v.seconds:.2f} s{signed})")
    return EXIT_OK


def _metrics(items: list[str]) -> dict[str, float]:
    metrics = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            metrics[name.strip()] = float(value)
        except ValueError:
            raise ConfigError(f"--metric {item!r}: expected NAME=NUMBER") from None
        if not sep:
            raise ConfigError(f"--metric {item!r}: expected NAME=NUMBER")
    return metrics


def _models_evaluate(args: argparse.Namespace) -> int:
    body = {"suite": args.suite, "metrics": _metrics(args.metric), "passed": args.passed, "evidence": args.evidence}
    with common.client(args) as c:
        out = c.post(f"{_model_path(args)}/evaluations", EvaluationResult, body=body)
    if args.json:
        print_json(out)
    else:
        e, m = out.evaluation, out.model
        verdict = "passed" if e.passed else "failed"
        print(f"evaluation {e.id} ({e.suite}) {verdict}; model {m.name}@{m.version} is {m.state}")
    return EXIT_OK


def _models_action(args: argparse.Namespace) -> int:
    with common.client(args) as c:
        out = c.post(f"{_model_path(args)}/{args.verb}", ModelRecord)
    _print_model(args, out, "")
    return EXIT_OK


def _models_show(args: argparse.Namespace) -> int:
    with common.client(args) as c:
        out = c.get(_model_path(args), ModelDetail)
    if args.json:
        print_json(out)
    else:
        print(render_model(out))
    return EXIT_OK


def _gguf_lines(v: Verification | None) -> list[str]:
    """A GGUF model's attention figures, as its verification read them (or why it could not)."""
    if v is None or (v.gguf is None and not v.gguf_problem):
        return []
    g = v.gguf
    if g is None:
        return [f"gguf         no figures: {v.gguf_problem}"]
    return [
        f"gguf         {g.architecture}: trained context {g.context_length} tokens, {g.block_count} layers, "
        f"{g.head_count} heads ({g.head_count_kv} KV) of {g.key_length}/{g.value_length}, width {g.embedding_length}",
        f"kv cache     {size_text(kv_cache_bytes(1, g.kv_bytes_per_token()))} a token (f16), "
        f"{size_text(kv_cache_bytes(g.context_length, g.kv_bytes_per_token()))} for the trained context",
    ]


def render_model(out: ModelDetail) -> str:
    m, v = out.model, out.model.verification
    a = m.artifact
    lines = [
        f"model        {m.name}@{m.version}",
        f"state        {m.state} since {cell(m.state_changed_at)}",
        f"artifact     {a.uri} ({m.format}, {size_text(a.size_bytes)})",
        f"sha256       {a.sha256}" + (" (the manifest's digest)" if a.files else ""),
    ]
    if m.base:
        lines.append(f"lora for     {', '.join(b.key for b in m.base)}")
    if a.files:
        lines.append(f"entry        {a.entry} (of {len(a.files)} files)")
        lines += [f"  file       {f.path}  {size_text(f.size_bytes)}  {f.sha256[:16]}…" for f in a.files]
    lines += [
        f"memory       {size_text(m.memory_bytes)}",
        f"licence      {_license_text(m.license)}",
        f"provenance   {m.provenance.source}" + (f", signed by {m.provenance.signer}" if m.provenance.signer else ""),
        "verified     " + (f"{cell(v.verified_at)} ({v.size_bytes} bytes, {v.seconds:.2f} s)" if v else "no"),
        *_gguf_lines(v),
        f"aliases      {', '.join(out.aliases) or '-'}",
    ]
    for e in out.evaluations:
        metrics = ", ".join(f"{k}={val:g}" for k, val in sorted(e.metrics.items()))
        verdict = "passed" if e.passed else "failed"
        lines.append(f"evaluation   {e.id} {e.suite} {verdict} {cell(e.recorded_at)} {metrics}".rstrip())
    return "\n".join(lines)
