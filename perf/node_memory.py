"""Node agent memory: the steady VmRSS of real `nexa node` processes, enrolled to a real `nexa control`.

Sets up on loopback, as `perf/gateway.py` does: an OCI registry and SeaweedFS S3 (`nexa.localparts`),
`nexa control`, a `sim` runtime, a model verified and approved, aliased `chat`. Then one `nexa node`
(`simulation = true`, NEXA_SIMULATION_ONLY=1) per `--tree`, each run from that source tree
(PYTHONPATH and working directory), so a before tree (`git archive HEAD | tar -x -C /tmp/before`) and
this one run side by side, on the same controller, at the same time. One `sim` deployment has one
replica on each node (spread). After `--requests` chat completions through the controller (so each
agent has relayed, probed and scraped), it samples each agent's VmRSS from /proc every second for
`--seconds` and prints the median and the last VmHWM, in MiB (2**20 bytes); the agents' sim runtimes
are their own processes and not counted. Target (issue 16): ≤ 60 MB. Stops only what it started.
Each `--binary LABEL=PATH` adds an agent run as that PyInstaller executable (`PATH node`, from
`bash builds/build.sh`): what runs on a node, whose bundle holds the runtime dependencies only.

    .venv/bin/python perf/node_memory.py
    .venv/bin/python perf/node_memory.py --tree before=/tmp/before --tree after=.
    .venv/bin/python perf/node_memory.py --tree source=. --binary binary=dist/nexa
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import secrets
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

import attrs
import httpx
import trio

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nexa.localparts import S3_REGION, LocalS3, free_ports
from nexa.s3.credentials import write_s3_credentials
from perf.gateway import Processes, deploy, local_parts, ok, register_model, start_control, upload

ROOT = Path(__file__).resolve().parent.parent
MIB = 2**20


def vm_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def agent_kib(pid: int, field: str, *, binary: bool) -> int:
    """`field` of the agent started as `pid`. A one-file PyInstaller executable is two processes: its
    bootloader unpacks the bundle and runs the agent as its child, so both count (the agent's own
    children, the sim runtimes, do not)."""
    pids = [pid]
    if binary:
        children = Path(f"/proc/{pid}/task/{pid}/children").read_text().split()
        pids += [int(c) for c in children]
    return sum(vm_kib(p, field) for p in pids)


def start_node(
    procs: Processes,
    base: Path,
    admin: httpx.Client,
    url: str,
    s3: LocalS3,
    creds: Path,
    i: int,
    agent: Agent,
) -> int:
    """Enroll node `i` and start `agent`; its PID."""
    name = f"mem-{i}"
    node_dir = base / name
    inventory = base / f"{name}-inventory.json"
    inventory.write_text(json.dumps({"labels": {"board": "sim"}, "runtimes": ["sim"]}))
    host = f"127.0.0.{30 + i}"
    node_config = base / f"{name}.toml"
    node_config.write_text(
        f'state_dir = "{node_dir}"\ninventory_path = "{inventory}"\nsimulation = true\n'
        f'source_address = "{host}"\nruntime_host = "{host}"\n[log]\nlevel = "warning"\n'
        f'[artifacts]\ns3_endpoint = "{s3.endpoint}"\ns3_region = "{S3_REGION}"\n'
        f's3_credentials_file = "{creds}"\ns3_tls_verify = false\n'
    )
    env = {**os.environ, "NEXA_SIMULATION_ONLY": "1", **agent.env}
    if agent.binary is None:
        env["PYTHONPATH"] = str(agent.where)
    token = ok(admin.post("/api/v1/enrollment-tokens", json={"ttl_s": 600}))["token"]
    argv = [sys.executable, "-m", "nexa", "node"] if agent.binary is None else [str(agent.binary), "node"]
    tree = agent.where if agent.binary is None else base
    enroll = procs.start(
        f"{name}-enroll",
        [*argv, "enroll", "--controller", url, "--token", token, "--name", name, "--state-dir", str(node_dir)],
        env=env,
        cwd=tree,
    )
    if enroll.wait(timeout=60) != 0:
        raise RuntimeError(f"nexa node enroll failed: {procs.tail(f'{name}-enroll')}")
    node = procs.start(name, [*argv, "--config", str(node_config)], env=env, cwd=tree)
    return node.pid


@attrs.frozen
class Agent:
    """How one measured agent runs: from a source tree with this interpreter, or as a binary."""

    where: Path
    binary: Path | None
    env: dict[str, str]


def _agent_env(items: list[str], labels: list[str]) -> dict[str, dict[str, str]]:
    """`--env LABEL:NAME=VALUE` items, by label (an unknown label is an error)."""
    by_label: dict[str, dict[str, str]] = {label: {} for label in labels}
    for item in items:
        label, _, assignment = item.partition(":")
        name, eq, value = assignment.partition("=")
        if label not in by_label or not name or not eq:
            raise SystemExit(f"--env {item!r}: give LABEL:NAME=VALUE with a LABEL named by --tree or --binary")
        by_label[label][name] = value
    return by_label


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument(
        "--tree", action="append", default=[], help="LABEL=DIR: a node agent run from that source tree (repeatable)"
    )
    parser.add_argument(
        "--binary", action="append", default=[], help="LABEL=PATH: a node agent run as that nexa executable"
    )
    parser.add_argument(
        "--env", action="append", default=[], help="LABEL:NAME=VALUE: an environment variable for that tree's agent"
    )
    parser.add_argument("--requests", type=int, default=200, help="chat completions through the controller first")
    parser.add_argument("--settle-s", type=float, default=5.0, help="seconds after the requests before sampling")
    parser.add_argument("--seconds", type=int, default=20, help="seconds of VmRSS samples (one a second)")
    parser.add_argument("--keep-logs", default="", help="copy the processes' logs to this directory at the end")
    args = parser.parse_args()
    print("command:", shlex.join([sys.executable, *sys.argv]), flush=True)
    trees: dict[str, tuple[Path, bool]] = {}
    for item, is_binary in [*((t, False) for t in args.tree), *((b, True) for b in args.binary)] or [
        (f"this={ROOT}", False)
    ]:
        label, _, where = item.partition("=")
        if label in trees:
            raise SystemExit(f"{item!r}: the label {label!r} is given twice")
        trees[label] = (Path(where or label).resolve(), is_binary)
    envs = _agent_env(args.env, list(trees))
    agents = {
        label: Agent(where, where if is_binary else None, envs[label]) for label, (where, is_binary) in trees.items()
    }

    with tempfile.TemporaryDirectory(prefix="nexa-perf-mem-") as tmp, contextlib.ExitStack() as parts:
        base = Path(tmp)
        registry, s3, procs = local_parts(base, parts, args.keep_logs)
        registry.start()
        s3.start()
        creds = write_s3_credentials(base / "s3-credentials.json", s3.credentials)
        url, admin, _ = start_control(procs, base, s3, creds)
        ok(admin.post("/api/v1/tenants", json={"id": "perf"}))
        key = ok(admin.post("/api/v1/keys", json={"role": "inference", "tenant": "perf"}))["key"]
        image = registry.push_empty_image("nexa-perf/sim")
        ok(admin.post("/api/v1/runtimes", json={"name": "sim", "kind": "sim", "version": "1", "image": image}))
        artifact = secrets.token_bytes(200_000)
        trio.run(upload, s3, "perf/tiny.gguf", artifact)
        register_model(admin, s3, "tiny", "chat", artifact)
        pids = {
            label: start_node(procs, base, admin, url, s3, creds, i, agent)
            for i, (label, agent) in enumerate(agents.items())
        }

        def nodes_ready() -> bool:
            listed = ok(admin.get("/api/v1/nodes"))["nodes"]
            return len(listed) == len(pids) and all(n["state"] == "Ready" for n in listed)

        procs.wait("mem-0", nodes_ready, "the nodes")
        sim = ["--ttft-ms", "1", "--tokens-per-s", "2000", "--output-tokens", "8"]
        deploy(admin, "mem-chat", "chat", free_ports(1)[0], sim, replicas=len(pids))

        def replicas_ready() -> bool:
            placed = ok(admin.get("/api/v1/deployments/mem-chat"))["deployment"]["placed"]
            states = {
                a["assignment_id"]: a["state"]
                for n in ok(admin.get("/api/v1/nodes"))["nodes"]
                for a in n["assignments"]
            }
            return len(placed) == len(pids) and all(states.get(r["id"]) == "Ready" for r in placed)

        procs.wait("mem-0", replicas_ready, "the replicas")
        body = {"model": "chat", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}
        with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as client:
            for n in range(args.requests):
                resp = client.post("/v1/chat/completions", json={**body, "stream": n % 2 == 1})
                if resp.status_code != 200:
                    raise RuntimeError(f"chat completion {n}: {resp.status_code} {resp.text[:500]}")
        time.sleep(args.settle_s)
        samples: dict[str, list[int]] = {label: [] for label in pids}
        for _ in range(args.seconds):
            for label, pid in pids.items():
                samples[label].append(agent_kib(pid, "VmRSS", binary=agents[label].binary is not None))
            time.sleep(1.0)
        print(f"{args.requests} requests, then {args.seconds} samples a second apart; MiB = 2**20 bytes")
        print(f"{'agent':10s} {'tree or binary':40s} {'VmRSS median':>13s} {'min':>7s} {'max':>7s} {'VmHWM':>7s}")
        for label, pid in pids.items():
            kib = samples[label]
            hwm = agent_kib(pid, "VmHWM", binary=agents[label].binary is not None)
            print(
                f"{label:10s} {agents[label].where!s:40s} {statistics.median(kib) / 1024:13.1f} "
                f"{min(kib) / 1024:7.1f} {max(kib) / 1024:7.1f} {hwm / 1024:7.1f}"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
