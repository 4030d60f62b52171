"""`nexa sim`: the whole campaign through the CLI, the runner with fake steps, and bad usage."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import trio

from nexa.contracts import codec
from nexa.contracts.evidence import SimSummary, StepVerdict
from nexa.errors import ConfigError
from nexa.sim.campaign import Figures, Step, StepFailed, UnknownSteps, check, live_line, pick, run_campaign, table
from nexa.sim.steps import NAMES
from nexa.simruntime.faults import Faults
from tests.conftest import ControllerProcess, require_tool

#: The whole campaign runs in under 3 minutes here; the limit is generous for a loaded CI machine.
CAMPAIGN_TIMEOUT_S = 400


def _nexa(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nexa", *args], capture_output=True, text=True, timeout=timeout, check=False
    )


@pytest.mark.slow
def test_the_whole_campaign_passes_through_the_cli(tmp_path: Path, controller_process: ControllerProcess) -> None:
    require_tool("docker-registry")
    summary_file, answers_file = tmp_path / "sim.json", tmp_path / "answers.jsonl"
    made = controller_process.cli("keys", "create", "--role", "operator", "--name", "sim-report", "--json", check=True)
    operator = json.loads(made.stdout)["key"]
    done = _nexa(
        "sim",
        "--report-to",
        controller_process.url,
        "--report-token",
        operator,
        "--state-dir",
        str(tmp_path / "sim"),
        "--seed",
        "7",
        "--json",
        str(summary_file),
        "--public-answers",
        str(answers_file),
        timeout=CAMPAIGN_TIMEOUT_S,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    summary = codec.structure(codec.api, json.loads(summary_file.read_text()), SimSummary)
    assert summary.passed and summary.seed == 7
    assert [s.name for s in summary.steps] == NAMES
    assert {s.name: s.verdict for s in summary.steps} == dict.fromkeys(NAMES, StepVerdict.PASS)
    for index, name in enumerate(NAMES, start=1):
        assert f"[{index}/{len(NAMES)}] {name} … pass" in done.stdout
    assert "sim passed" in done.stdout
    answers = [json.loads(line) for line in answers_file.read_text().splitlines()]
    assert any(a["status"] == 429 and "retry-after" in a["headers"] for a in answers)
    assert any(200 <= a["status"] < 300 for a in answers)
    # Everything it started has stopped: the sim's directory is named in no live process.
    assert not _processes_naming(str(tmp_path / "sim"))
    # The operator's controller recorded the campaign as a finished `sim` job.
    listed = controller_process.cli("jobs", "list", "--kind", "sim", "--json", token=operator, check=True)
    [job] = json.loads(listed.stdout)["jobs"]
    assert (job["state"], job["progress"], job["summary"]) == ("succeeded", 1.0, "all steps passed")
    assert job["title"] == "sim seed 7"


@pytest.mark.slow
def test_ctrl_c_stops_everything_exits_130_and_cancels_the_reported_job(
    tmp_path: Path, controller_process: ControllerProcess
) -> None:
    require_tool("docker-registry")
    made = controller_process.cli("keys", "create", "--role", "operator", "--name", "sim-report", "--json", check=True)
    operator = json.loads(made.stdout)["key"]
    state_dir = tmp_path / "sim"
    argv = [sys.executable, "-m", "nexa", "sim", "--steps", "enroll,ready-routing,queue-shed,node-kill"]
    argv += ["--state-dir", str(state_dir), "--report-to", controller_process.url, "--report-token", operator]
    # SIGINT at its default in the child: a suite started in the background (`cmd &`) inherits it
    # ignored, and Python then installs no Ctrl-C handler, so the SIGINT below would change nothing.
    sim = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),  # noqa: PLW1509 - takes no lock
    )
    try:
        assert sim.stdout is not None
        for line in sim.stdout:  # interrupt it inside a step, with its cluster running
            if line.startswith("[2/4]"):
                break
        sim.send_signal(signal.SIGINT)
        out, err = sim.communicate(timeout=120)
    finally:
        if sim.poll() is None:
            sim.kill()
            sim.wait()
    assert sim.returncode == 130, out + err
    assert "interrupted; everything it started is stopped" in err
    assert "Traceback" not in err
    assert not _processes_naming(str(state_dir))
    listed = controller_process.cli("jobs", "list", "--kind", "sim", "--json", token=operator, check=True)
    [job] = json.loads(listed.stdout)["jobs"]
    assert (job["state"], job["summary"]) == ("cancelled", "interrupted")


def _processes_naming(marker: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if marker in cmdline:
                found.append(cmdline)
    return found


def test_an_unknown_step_is_bad_usage_that_lists_the_steps(tmp_path: Path) -> None:
    done = _nexa("sim", "--steps", "enroll,no-such-step", "--state-dir", str(tmp_path / "sim"))
    assert done.returncode == 2
    assert "no-such-step" in done.stderr
    assert all(name in done.stderr for name in NAMES)
    assert not (tmp_path / "sim").exists()  # nothing was started


def test_pick_keeps_the_campaign_order() -> None:
    assert pick(NAMES, None) == NAMES
    assert pick(NAMES, "drain, enroll") == ["enroll", "drain"]
    with pytest.raises(UnknownSteps) as caught:
        pick(NAMES, "enroll,bogus")
    assert caught.value.unknown == ["bogus"]


async def _passes(_: list[str]) -> Figures:
    return {"requests": 3}


async def _fails(_: list[str]) -> Figures:
    check(False, "expected 0 failed, saw 2", {"failed": 2})
    return {}


async def _fails_in_a_nursery(seen: list[str]) -> Figures:
    async def boom() -> None:
        raise StepFailed("inside a nursery")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(boom)
    return {}


async def _crashes(_: list[str]) -> Figures:
    raise ConfigError("a broken step")


async def _records(seen: list[str]) -> Figures:
    seen.append("ran")
    return {}


STEPS = [
    Step("one", _passes),
    Step("two", _fails),
    Step("three", _fails_in_a_nursery),
    Step("four", _crashes),
    Step("five", _records),
    Step("six", _passes),
]


async def test_a_failing_step_fails_the_campaign_and_the_next_steps_still_run() -> None:
    lines: list[str] = []
    seen: list[str] = []
    summary = await run_campaign(STEPS, ["one", "two", "three", "four", "five"], seen, seed=3, say=lines.append)
    verdicts = {s.name: s.verdict for s in summary.steps}
    assert verdicts == {
        "one": StepVerdict.PASS,
        "two": StepVerdict.FAIL,
        "three": StepVerdict.FAIL,
        "four": StepVerdict.FAIL,
        "five": StepVerdict.PASS,
        "six": StepVerdict.SKIPPED,
    }
    assert not summary.passed and seen == ["ran"]
    two = summary.steps[1]
    assert (two.detail, two.figures) == ("expected 0 failed, saw 2", {"failed": 2})
    assert summary.steps[2].detail == "inside a nursery"
    assert summary.steps[3].detail == "ConfigError: a broken step"
    assert [line.split(" … ")[0] for line in lines] == [
        "[1/5] one",
        "[2/5] two",
        "[3/5] three",
        "[4/5] four",
        "[5/5] five",
    ]
    assert lines[1].endswith(": expected 0 failed, saw 2")
    # The summary round-trips through the contract's codec, and the table names every step.
    again = codec.structure(codec.api, json.loads(codec.dumps(codec.api, summary)), SimSummary)
    assert again == summary
    rendered = table(summary)
    assert all(name in rendered for name in ("one", "two", "six")) and "sim FAILED" in rendered


async def test_a_campaign_of_passing_steps_passes_and_reports_progress() -> None:
    done: list[tuple[int, int, str]] = []

    async def progress(index: int, total: int, step: object) -> None:
        done.append((index, total, getattr(step, "name", "")))

    summary = await run_campaign(STEPS, ["one", "six"], [], seed=0, progress=progress)
    assert summary.passed and done == [(1, 2, "one"), (2, 2, "six")]
    assert summary.steps[0].figures == {"requests": 3}
    assert live_line(1, 2, summary.steps[0]).startswith("[1/2] one … pass (")


async def test_an_empty_pick_does_not_pass() -> None:
    assert not (await run_campaign(STEPS, [], [], seed=0)).passed


def test_the_unhealthy_fault_is_parsed_and_checked() -> None:
    assert Faults.from_json({"unhealthy": True}).unhealthy
    assert not Faults.from_json({}).unhealthy
    with pytest.raises(ConfigError) as caught:
        Faults.from_json({"unhealthy": "yes"})
    assert caught.value.problems == ("unhealthy: must be true or false",)


@pytest.mark.slow
def test_sign_key_without_json_or_with_an_unreadable_key_is_bad_usage(tmp_path: Path) -> None:
    """Issue 30 point 10: `--sign-key` signs the `--json` summary; either wrong, nothing is started."""
    done = _nexa("sim", "--steps", "enroll", "--sign-key", str(tmp_path / "k.pem"), "--state-dir", str(tmp_path / "s"))
    assert done.returncode == 2 and "--sign-key signs the --json summary: give --json FILE too" in done.stderr
    (tmp_path / "bad.pem").write_text("not a key")
    (tmp_path / "bad.pem").chmod(0o600)
    args = ("--json", str(tmp_path / "sim.json"), "--sign-key", str(tmp_path / "bad.pem"))
    done = _nexa("sim", "--steps", "enroll", "--state-dir", str(tmp_path / "s"), *args)
    assert done.returncode == 2 and "is not an unencrypted PEM private key" in done.stderr
    assert not (tmp_path / "s").exists() and not (tmp_path / "sim.json").exists()
