"""`nexa runtimes qualify RUNTIME --node NODE [--model MODEL]` and the qualifications `nexa runtimes
show` lists (operator).

`qualify` asks the controller to qualify the runtime on the node (`POST
/api/v1/runtimes/{name}/qualify`), follows the job that runs it (`nexa jobs show` shows it too),
then prints each step of the signed record: what was seen, and for a failed step what to do. Exit
0 when it passed, 1 when a step failed (`qualification_failed`, naming the step) or the job did.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any, Final

from nexa.cli import common
from nexa.cli.output import emit, print_json
from nexa.cli.tables import RUNTIME_SHOW
from nexa.contracts.evidence import Job, JobState
from nexa.contracts.qualification import DEFAULT_TIMEOUT_S, QualificationList, SignedQualification, StepOutcome
from nexa.errors import ConfigError, QualificationFailed

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
#: How often the job is looked at while it runs.
POLL_S: Final = 0.5
#: The most qualifications `nexa runtimes show` lists.
SHOWN: Final = 10


def add_qualify_command(runtimes: Any, common_flags: argparse.ArgumentParser) -> None:
    s = runtimes.add_parser(
        "qualify",
        parents=[common_flags],
        help="start the runtime's image with a model on a node and check it step by step (a signed record)",
        description=(
            "Run the runtime on NODE as a short-lived replica of its own and check: the process that ran, the "
            "time to Ready, an answer through the gateway's relay, the metric series the router reads, the "
            "cache written, measured memory against the reservation, and a clean stop. The signed record "
            "qualifies (image digest, node architecture, GPU model) for [placement] require_qualified."
        ),
    )
    s.add_argument("runtime")
    s.add_argument("--node", required=True, help="a Ready (or Cordoned) node id")
    s.add_argument(
        "--model",
        help="an alias, a model name or NAME:VERSION (default: the smallest Approved model the runtime serves)",
    )
    s.add_argument("--settings", default="{}", help="the replica's runtime settings, JSON: '{\"n_ctx\": 512}'")
    s.add_argument("--accelerators", type=int, help="GPUs for the replica (default: 1 on a node with GPUs)")
    s.add_argument("--memory-bytes", type=common.size, help="the reservation (default: the model's memory)")
    s.add_argument(
        "--timeout",
        type=common.duration,
        default=DEFAULT_TIMEOUT_S,
        help=f"how long the replica may take to be Ready (default {DEFAULT_TIMEOUT_S:g} s)",
    )
    s.add_argument("--no-wait", action="store_true", help="print the job and return at once")
    s.set_defaults(handler=_qualify)


def _qualify(args: argparse.Namespace) -> int:
    try:
        settings = json.loads(args.settings)
    except ValueError:
        raise ConfigError("--settings takes a JSON object") from None
    if not isinstance(settings, dict):
        raise ConfigError("--settings takes a JSON object")
    body: dict[str, Any] = {"node": args.node, "settings": settings, "timeout_s": args.timeout}
    for key in ("model", "accelerators", "memory_bytes"):
        if (value := getattr(args, key)) is not None:
            body[key] = value
    with common.client(args) as c:
        job = c.post(f"/api/v1/runtimes/{args.runtime}/qualify", Job, body=body)
        if args.no_wait:
            if args.json:
                print_json(job)
            else:
                print(f"qualification started: job {job.id} (follow it with `nexa jobs show {job.id}`)")
            return EXIT_OK
        job = _follow(c, job, quiet=args.json)
        if job.link is None:
            print(f"nexa: error: the qualification did not finish: {job.summary}", file=sys.stderr)
            return EXIT_FAILED
        signed = c.get(job.link, SignedQualification)
    if args.json:
        print_json(signed)
    else:
        print_steps(signed)
    q = signed.qualification
    if q.passed:
        return EXIT_OK
    step = next(s for s in q.steps if s.name == q.failed_step)
    print(
        f"nexa: error: {QualificationFailed.code}: step {q.failed_step}: {step.detail}; what to do: {step.fix}",
        file=sys.stderr,
    )
    return EXIT_FAILED


def _follow(c: Any, job: Job, *, quiet: bool) -> Job:
    said = ""
    while job.state is JobState.RUNNING:
        if job.summary != said and not quiet:
            print(f"{job.summary}...", file=sys.stderr)
            said = job.summary
        time.sleep(POLL_S)
        job = c.get(f"/api/v1/jobs/{job.id}", Job)
    return job


def print_steps(signed: SignedQualification) -> None:
    q = signed.qualification
    verdict = "passed" if q.passed else f"FAILED at step {q.failed_step}"
    print(
        f"qualification {q.id}: {q.runtime} ({q.kind}, {q.image_digest[:19]}) on {q.node_id} "
        f"({q.arch}, GPU {q.gpu_model}) with {q.model.key}: {verdict}"
    )
    for step in q.steps:
        line = f"  {step.name:<9} {step.outcome.value:<8} {step.duration_s:>7.2f} s  {step.detail}"
        print(line.rstrip())
        if step.outcome is StepOutcome.FAIL and step.fix:
            print(f"  {'':<9} {'':<8} {'':>9}  what to do: {step.fix}")
    print(f"signed by the controller key {signed.public_key}")


def show_runtime(args: argparse.Namespace) -> int:
    """`nexa runtimes show NAME`: the runtime, then (not with --json) its newest qualifications."""
    code = RUNTIME_SHOW.run(args)
    if args.json:
        return code
    with common.client(args) as c:
        found = c.get("/api/v1/qualifications", QualificationList, params={"runtime": args.name, "limit": str(SHOWN)})
    if not found.qualifications:
        print(f"qualifications: none (`nexa runtimes qualify {args.name} --node NODE`)")
        return code
    print("qualifications (newest first):")
    rows = [
        {
            "id": s.qualification.id,
            "verdict": "passed" if s.qualification.passed else f"failed: {s.qualification.failed_step}",
            "node": s.qualification.node_id,
            "arch": s.qualification.arch,
            "gpu": s.qualification.gpu_model,
            "digest": s.qualification.image_digest[:19],
            "model": s.qualification.model.key,
            "finished_at": s.qualification.finished_at,
        }
        for s in found.qualifications
    ]
    emit(args, found, rows, ("id", "verdict", "node", "arch", "gpu", "digest", "model", "finished_at"))
    return code
