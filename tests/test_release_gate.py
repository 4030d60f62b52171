"""builds/release-gate.sh and its checks (builds/gate/): each check fails with a clear line on a
tree seeded with one violation, and passes on clean input. The helper runs on a temp root with
`--only`, so no test here lints or type-checks the whole repository."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from nexa.contracts import codec
from nexa.contracts.evidence import GateReport

ROOT = Path(__file__).resolve().parents[1]
GATE = ROOT / "builds" / "gate" / "gate.py"
# Built here, never written whole in this file: the gate's secret scan reads this file too.
FAKE_AWS_KEY = "AKIA" + "Z7Q3MXV2KD4N8PLW"
PEM_HEADER = "-----BEGIN " + "PRIVATE KEY-----"


def gate(root: Path, only: str, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, str(GATE), "--root", str(root), "--only", only, *extra],
        capture_output=True,
        text=True,
        timeout=300,
    )


def line_of(out: str, check: str) -> str:
    (line,) = [x for x in out.splitlines() if x.split(" ", 2)[1:2] == [check]]
    return line


def write(root: Path, rel: str, text: str) -> Path:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# --- images ---------------------------------------------------------------------------------------


def test_images_pinned_passes_on_digests_and_elided_docs(tmp_path: Path) -> None:
    write(tmp_path, "units/runtime.toml", f'image = "registry.lab:5000/nexa/vllm@sha256:{"a" * 64}"\n')
    write(tmp_path, "README.md", "nexa runtimes register x --image registry.lab/nexa/vllm@sha256:…\n")
    write(tmp_path, "builds/Containerfile", f"FROM docker.io/library/debian@sha256:{'b' * 64}\n")
    write(tmp_path, "nexa/code.py", 'image = "not/in/scope:latest"\n')  # code is not an example
    done = gate(tmp_path, "images-pinned")
    assert done.returncode == 0, done.stdout
    assert line_of(done.stdout, "images-pinned").startswith("PASS images-pinned — 3 files")


@pytest.mark.parametrize(
    ("rel", "text"),
    [
        ("units/runtime.toml", 'image = "registry.lab:5000/nexa/vllm:latest"\n'),
        ("README.md", "nexa runtimes register x --image registry.lab/nexa/vllm:0.6\n"),
        ("builds/Containerfile", "FROM debian:bookworm\n"),
        ("tests/fixtures/compose.yml", f"image: ghcr.io/x/y@sha256:{'c' * 63}\n"),
        ("units/runtime.json", '{"image": "ghcr.io/x/y@sha256:…"}\n'),  # elided outside docs: not pinned
    ],
)
def test_images_pinned_fails_on_an_unpinned_image(tmp_path: Path, rel: str, text: str) -> None:
    write(tmp_path, rel, text)
    done = gate(tmp_path, "images-pinned")
    assert done.returncode == 1
    line = line_of(done.stdout, "images-pinned")
    assert line.startswith(f"FAIL images-pinned — {rel}:1: image ")
    assert "is not pinned by digest" in line
    assert "release gate: NOT clean (0/1 passed)" in done.stdout


# --- secrets --------------------------------------------------------------------------------------


def test_secrets_fails_on_a_fake_aws_key_and_passes_clean(tmp_path: Path) -> None:
    write(tmp_path, "nexa/clean.py", 'GREETING = "hello"\n')
    done = gate(tmp_path, "secrets")
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASS secrets — detect-secrets: 1 files, no secret" in done.stdout

    write(tmp_path, "units/leaky.env", f"AWS_ACCESS_KEY_ID={FAKE_AWS_KEY}\n")
    done = gate(tmp_path, "secrets")
    assert done.returncode == 1
    assert "FAIL secrets — " in done.stdout
    assert "units/leaky.env:1: AWS Access Key" in done.stdout


def test_secrets_allowlist_needs_a_reason_per_entry(tmp_path: Path) -> None:
    write(tmp_path, "units/leaky.env", f"AWS_ACCESS_KEY_ID={FAKE_AWS_KEY}\n")
    found = json.loads(
        subprocess.run(
            [str(Path(sys.executable).parent / "detect-secrets"), "scan", "--all-files", "units/leaky.env"],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    )["results"]["units/leaky.env"]
    entries = [{"path": "units/*.env", "type": h["type"], "hashed_secret": h["hashed_secret"]} for h in found]
    allow = write(tmp_path, "builds/gate/secrets-allowed.json", json.dumps(entries))
    done = gate(tmp_path, "secrets")
    assert done.returncode == 1
    assert "needs non-empty path, type, hashed_secret, why" in done.stdout
    allow.write_text(json.dumps([{**e, "why": "a made-up key for this test"} for e in entries]))
    done = gate(tmp_path, "secrets")
    assert done.returncode == 0, done.stdout
    assert f"({len(entries)} known test values allowed)" in done.stdout


# --- isolation ------------------------------------------------------------------------------------


def _node_units(root: Path) -> None:
    shutil.copytree(ROOT / "units", root / "units")


def test_isolation_passes_on_the_shipped_units(tmp_path: Path) -> None:
    _node_units(tmp_path)
    done = gate(tmp_path, "isolation")
    assert done.returncode == 0, done.stdout
    assert line_of(done.stdout, "isolation").startswith("PASS isolation — ")


@pytest.mark.parametrize(
    ("rel", "old", "new", "said"),
    [
        (
            "units/node.toml",
            's3_credentials_file = ""',
            's3_credentials_file = "/home/alice/.aws/credentials"',
            "units/node.toml: artifacts.s3_credentials_file: '/home/alice/.aws/credentials' is outside",
        ),
        (
            "units/node.toml",
            'cache_dir = ""',
            'cache_dir = "/srv/app/checkout/models"',
            "units/node.toml: artifacts.cache_dir: '/srv/app/checkout/models' is outside the node's boundary",
        ),
        (
            "units/node.toml",
            's3_endpoint = ""',
            's3_endpoint = "git@github.com:acme/app.git"',
            "units/node.toml: artifacts.s3_endpoint: names an application repository",
        ),
        (
            "units/nexa-node.service",
            "StateDirectory=nexa/node",
            "StateDirectory=nexa/node\nReadWritePaths=/var/lib/postgresql",
            "units/nexa-node.service:",
        ),
        (
            "units/nexa-node.service.d/docker.conf",
            "SupplementaryGroups=docker",
            "SupplementaryGroups=docker\nEnvironment=HF_" + "TOKEN=hf_abc",
            "Environment: passes a credential to the agent",
        ),
    ],
)
def test_isolation_fails_on_a_path_outside_the_boundary(
    tmp_path: Path, rel: str, old: str, new: str, said: str
) -> None:
    _node_units(tmp_path)
    path = tmp_path / rel
    text = path.read_text()
    assert old in text
    path.write_text(text.replace(old, new, 1))
    done = gate(tmp_path, "isolation")
    assert done.returncode == 1
    assert line_of(done.stdout, "isolation").startswith("FAIL isolation — ")
    assert said in done.stdout


# --- public answers -------------------------------------------------------------------------------


def _answer(body: object, status: int = 503, **headers: str) -> str:
    return json.dumps({"status": status, "headers": {"content-type": "application/json", **headers}, "body": body})


CLEAN_ANSWERS = [
    _answer({"error": {"code": "overloaded", "message": "try again", "request_id": "r1"}}, 503, **{"retry-after": "1"}),
    _answer({"object": "list", "data": [{"id": "chat"}]}, 200, **{"x-nexa-request-id": "r2"}),
    _answer({"model": "chat", "artifact_sha256": "d" * 64, "digest": "sha256:" + "e" * 64}, 200),
    _answer(json.dumps({"error": {"code": "bad_request", "message": "controller at 127.0.0.1:8470"}}), 400),
]


def test_public_leaks_pass_on_clean_answers(tmp_path: Path) -> None:
    answers = write(tmp_path, "answers.jsonl", "\n".join(CLEAN_ANSWERS) + "\n")
    done = gate(tmp_path, "public-leaks", "--sim-answers", str(answers))
    assert done.returncode == 0, done.stdout
    assert line_of(done.stdout, "public-leaks").startswith("PASS public-leaks — 4 public answers")


def test_public_leaks_fail_on_an_empty_or_missing_file(tmp_path: Path) -> None:
    answers = write(tmp_path, "answers.jsonl", "")
    done = gate(tmp_path, "public-leaks", "--sim-answers", str(answers))
    assert done.returncode == 1
    assert "no public answer to scan" in done.stdout
    done = gate(tmp_path, "public-leaks", "--sim-answers", str(tmp_path / "absent.jsonl"))
    assert done.returncode == 1
    assert "no such file (write it with nexa sim --public-answers FILE)" in done.stdout


@pytest.mark.parametrize(
    ("leak", "said"),
    [
        ({"error": {"message": "node at 127.0.0.12:18000 failed"}}, "a node address (127.0.0.12)"),
        ({"error": {"message": "upstream 203.0.113.7 refused"}}, "a non-loopback address (203.0.113.7)"),
        ({"error": {"message": "cannot open /tmp/nexa-sim/state/control/db.sqlite"}}, "a file path"),
        ({"error": {"message": "cannot read /home/ops/model.gguf"}}, "a file path"),
        ({"error": {"message": "container " + "f" * 64 + " exited"}}, "a container id"),
        ({"error": {"message": PEM_HEADER + "\nMC4CAQAwBQYDK2VwBCIEI"}}, "key material"),
        (
            {"error": {"message": 'Traceback (most recent call last):\n  File "x.py", line 1'}},
            "a stack trace",
        ),
    ],
)
def test_public_leaks_fail_on_each_kind_of_leak(tmp_path: Path, leak: object, said: str) -> None:
    answers = write(tmp_path, "answers.jsonl", "\n".join([*CLEAN_ANSWERS, _answer(json.dumps(leak), 500)]) + "\n")
    done = gate(tmp_path, "public-leaks", "--sim-answers", str(answers))
    assert done.returncode == 1
    assert line_of(done.stdout, "public-leaks").startswith(f"FAIL public-leaks — answers.jsonl:5: {said}")


def test_public_leaks_find_a_key_from_the_sim_state_dir_and_the_dir_itself(tmp_path: Path) -> None:
    state = tmp_path / "state"
    curve_z85 = "rq:rM>}U?@Lns47E1" + "%kR.o@n%FcmmsL/@{H8]yf7"  # 40 Z85 characters, made up here
    write(state, "node-1/curve.key", curve_z85 + "\n")
    answers = write(tmp_path, "answers.jsonl", _answer({"error": {"message": f"bad key {curve_z85}"}}) + "\n")
    done = gate(tmp_path, "public-leaks", "--sim-answers", str(answers), "--sim-state-dir", str(state))
    assert done.returncode == 1
    assert "answers.jsonl:1: key material" in done.stdout
    answers.write_text(_answer({"error": {"message": f"at {state.resolve()}/db"}}) + "\n")
    done = gate(tmp_path, "public-leaks", "--sim-answers", str(answers), "--sim-state-dir", str(state))
    assert "answers.jsonl:1: a file path" in done.stdout


# --- quality gates and SBOM -------------------------------------------------------------------------


def test_quality_gates_fail_on_a_lint_error_and_bad_formatting(tmp_path: Path) -> None:
    write(tmp_path, "pyproject.toml", '[tool.ruff]\nline-length = 120\n[tool.ruff.lint]\nselect = ["F"]\n')
    write(tmp_path, "nexa/good.py", "VALUE = 1\n")
    done = gate(tmp_path, "ruff-check,ruff-format")
    assert done.returncode == 0, done.stdout
    assert line_of(done.stdout, "ruff-check").startswith("PASS ruff-check — ruff check --no-cache nexa")

    write(tmp_path, "nexa/bad.py", "import os\nx = {  'a':1 }\n")
    done = gate(tmp_path, "ruff-check,ruff-format")
    assert done.returncode == 1
    assert line_of(done.stdout, "ruff-check").startswith("FAIL ruff-check — ruff check")
    assert "F401" in done.stdout
    assert line_of(done.stdout, "ruff-format").startswith("FAIL ruff-format — ruff format --check")
    assert "nexa/bad.py" in done.stdout


@pytest.mark.slow
def test_sbom_lists_the_runtime_dependencies(tmp_path: Path) -> None:
    out = tmp_path / "sbom.cdx.json"
    done = gate(ROOT, "sbom", "--sbom", str(out))
    assert done.returncode == 0, done.stdout
    runtime = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    assert len(runtime) >= 12
    assert f"all {len(runtime)} runtime dependencies listed" in line_of(done.stdout, "sbom")
    bom = json.loads(out.read_text())
    assert bom["bomFormat"] == "CycloneDX"
    names = {c["name"].lower() for c in bom["components"]}
    assert {"trio", "hypercorn", "quart-trio", "apsw", "psycopg", "pyzmq", "cryptography", "prometheus-client"} <= names
    assert "pytest" not in names  # test tools are not in the binary


def test_sbom_fails_when_a_runtime_dependency_is_not_installed(tmp_path: Path) -> None:
    write(tmp_path, "pyproject.toml", '[project]\nname = "x"\nversion = "1"\ndependencies = ["no-such-dist-here>=1"]\n')
    done = gate(tmp_path, "sbom")
    assert done.returncode == 1
    assert line_of(done.stdout, "sbom").startswith("FAIL sbom — no-such-dist-here: not installed in ")


# --- the script -----------------------------------------------------------------------------------


def test_the_script_writes_a_gate_report(tmp_path: Path) -> None:
    report = tmp_path / "gate.json"
    done = subprocess.run(
        ["bash", str(ROOT / "builds" / "release-gate.sh"), "--only", "images-pinned,isolation", "--json", str(report)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.splitlines()[-1] == "release gate: clean (2/2 passed)"
    parsed = codec.loads(codec.api, report.read_bytes(), GateReport)
    assert parsed.clean
    assert [c.name for c in parsed.checks] == ["images-pinned", "isolation"]


def test_an_unknown_check_is_a_usage_error(tmp_path: Path) -> None:
    done = gate(tmp_path, "images-pinned,nonsense")
    assert done.returncode == 2
    assert "unknown check nonsense (known: ruff-check," in done.stderr


# --- a signed report (issue 30 point 10) ----------------------------------------------------------


def test_sign_key_signs_the_json_report_and_needs_json(tmp_path: Path) -> None:
    from nexa import security
    from nexa.contracts import codec
    from nexa.contracts.evidence import SignedGateReport

    key = security.generate_signing_key()
    security.save_signing_key(key, tmp_path / "release.pem")
    done = gate(tmp_path, "images-pinned", "--sign-key", str(tmp_path / "release.pem"))
    assert done.returncode == 2 and "--sign-key signs the --json report: give --json FILE too" in done.stderr
    assert "PASS" not in done.stdout  # refused before any check ran

    report_file = tmp_path / "gate.json"
    done = gate(tmp_path, "images-pinned", "--json", str(report_file), "--sign-key", str(tmp_path / "release.pem"))
    assert done.returncode == 0, done.stdout + done.stderr
    signed = codec.loads(codec.api, report_file.read_text(), SignedGateReport)
    assert signed.report.clean and [c.name for c in signed.report.checks] == ["images-pinned"]
    assert security.verify_report(signed.signature, signed.report) == key.public
