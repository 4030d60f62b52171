"""The campaign's steps, in order, each through the public interfaces only: the HTTP API and the
gateway (`nexa.sim.load`), the `nexa` CLI as a process, the agents' and controller's processes (by
PID) and the files an operator sees (sim faults files, runtime journals, logs, state dirs)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import trio

from nexa import security
from nexa.channel import links
from nexa.demo import Node
from nexa.node import identity
from nexa.node.processes import default_argv
from nexa.sim import impostor
from nexa.sim.campaign import Figures, Step, StepFailed, check
from nexa.sim.cluster import INFLIGHT_PER_REPLICA, NODES, REPLICAS, Cluster
from nexa.sim.load import Result, steady

#: Requests of the routing and retry steps.
REQUESTS: Final = 12
#: Requests sent at once in the burst (far beyond the replicas' slots plus the queue).
BURST: Final = 120
STEADY_CLIENTS: Final = 4
TIMEOUT_S: Final = 60.0


@attrs.define
class Campaign:
    cluster: Cluster
    rng: random.Random
    #: Sent in every prompt; found in no log, state file or public error (`payload-canary`).
    canary: str
    #: Requests the gateway answered with success, all steps together.
    acknowledged: int = 0

    def prompt(self, what: str) -> str:
        return f"{self.canary} {what} {self.rng.randrange(10**9)}"

    def count(self, results: Sequence[Result]) -> None:
        self.acknowledged += sum(r.ok for r in results)


def _journal_count(node: Node, event: str) -> int:
    """How many `event` lines the node's sim runtimes journaled (metadata only)."""
    total = 0
    for path in (node.state_dir / "sim").glob("*.jsonl"):
        total += sum(f'"event":"{event}"' in line for line in path.read_text(errors="replace").splitlines())
    return total


def _set_faults(node: Node, **faults: Any) -> None:
    path = node.state_dir / "sim" / "faults.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(faults))
    tmp.replace(path)


async def _burst(c: Campaign, n: int, what: str, *, stream: bool = False, max_tokens: int | None = 4) -> list[Result]:
    results: list[Result] = []
    gateway = c.cluster.the_gateway()

    async def one(i: int) -> None:
        results.append(await gateway.chat(c.prompt(f"{what} {i}"), stream=stream, max_tokens=max_tokens))

    async with trio.open_nursery() as nursery:
        for i in range(n):
            nursery.start_soon(one, i)
    c.count(results)
    return results


async def _sequential(c: Campaign, n: int, what: str, *, stream: bool = False) -> list[Result]:
    gateway = c.cluster.the_gateway()
    results = [await gateway.chat(c.prompt(f"{what} {i}"), stream=stream) for i in range(n)]
    c.count(results)
    return results


def _statuses(results: Sequence[Result]) -> str:
    seen: dict[str, int] = {}
    for r in results:
        key = r.transport or r.stream_error or str(r.status)
        seen[key] = seen.get(key, 0) + 1
    return ", ".join(f"{k} x{v}" for k, v in sorted(seen.items()))


async def _cli(c: Campaign, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NEXA_URL": c.cluster.url, "NEXA_TOKEN": c.cluster.admin_key}
    argv = [*default_argv(), *args]
    return await trio.to_thread.run_sync(
        lambda: subprocess.run(argv, env=env, capture_output=True, text=True, timeout=60, check=False)
    )


# ---- the steps ---------------------------------------------------------------------------------


async def enroll(c: Campaign) -> Figures:
    listed = (await c.cluster.the_api().get("/api/v1/nodes"))["nodes"]
    ready = [n for n in listed if n["state"] == "Ready"]
    ids = {n["id"] for n in ready}
    check(len(ready) == NODES and len(ids) == NODES, f"expected {NODES} distinct Ready nodes, saw {sorted(ids)}")
    curve = {links.load_curve_public(n.state_dir / "curve.pub") for n in c.cluster.nodes}
    signing = {security.load_signing_key(n.state_dir / identity.SIGNING_KEY_FILE).public.b64 for n in c.cluster.nodes}
    check(len(curve) == NODES and len(signing) == NODES, "the nodes do not each have their own keys")
    return {"nodes_ready": len(ready), "distinct_ids": len(ids), "distinct_keys": len(curve) + len(signing)}


async def signed_sets(c: Campaign) -> Figures:
    return await impostor.signed_sets(c.cluster)


async def ready_routing(c: Campaign) -> Figures:
    cluster = c.cluster
    ready = await cluster.wait_replicas()
    sick = cluster.node(c.rng.choice(sorted(set(ready.values()))))
    _set_faults(sick, unhealthy=True)
    try:
        with trio.fail_after(TIMEOUT_S):
            while sick.name in (await cluster.ready_replicas()).values():  # noqa: ASYNC110 - polling the API
                await trio.sleep(0.2)
        before = _journal_count(sick, "request")
        results = await _sequential(c, REQUESTS, "ready-routing")
        after = _journal_count(sick, "request")
    finally:
        _set_faults(sick)
    failed = [r for r in results if not r.ok]
    figures: Figures = {"requests": len(results), "failed": len(failed), "to_not_ready": after - before}
    check(not failed, f"requests failed: {_statuses(failed)}", figures)
    check(after == before, f"{after - before} requests reached the replica that was not Ready", figures)
    await cluster.wait_replicas()
    return figures


async def queue_shed(c: Campaign) -> Figures:
    await c.cluster.wait_replicas()
    results = await _burst(c, BURST, "burst", max_tokens=None)
    ok = [r for r in results if r.ok]
    shed = [r for r in results if r.status in (429, 503)]
    other = [r for r in results if not r.ok and r.status not in (429, 503)]
    figures: Figures = {"sent": len(results), "served": len(ok), "shed": len(shed), "other": len(other)}
    check(not other, f"answers other than success, 429 or 503: {_statuses(other)}", figures)
    check(bool(shed), "a burst beyond capacity shed nothing", figures)
    check(len(ok) > REPLICAS * INFLIGHT_PER_REPLICA, "nothing waited in the queue", figures)
    untyped = [r for r in shed if not r.retry_after or not r.error_code]
    check(not untyped, f"{len(untyped)} shed answers had no Retry-After or no error code", figures)
    figures["codes"] = ",".join(sorted({r.error_code or "" for r in shed}))
    return figures


async def retry_before_first_byte(c: Campaign) -> Figures:
    cluster = c.cluster
    ready = await cluster.wait_replicas()
    failing = cluster.node(c.rng.choice(sorted(set(ready.values()))))
    before = _journal_count(failing, "failed")
    _set_faults(failing, fail="before", status=500)
    try:
        results = await _sequential(c, REQUESTS, "retry") + await _sequential(c, REQUESTS, "retry", stream=True)
    finally:
        _set_faults(failing)
    retried = _journal_count(failing, "failed") - before
    failed = [r for r in results if not r.ok]
    figures: Figures = {"requests": len(results), "failed": len(failed), "retried": retried}
    check(not failed, f"the client saw failures: {_statuses(failed)}", figures)
    check(retried > 0, "no request met the failing replica: nothing was retried", figures)
    return figures


async def error_after_first_byte(c: Campaign) -> Figures:
    cluster = c.cluster
    await cluster.wait_replicas()
    for node in cluster.nodes:
        _set_faults(node, fail="after", after_tokens=2)
    try:
        with trio.fail_after(TIMEOUT_S):  # never a hang
            results = await _sequential(c, REQUESTS // 2, "after-first-byte", stream=True)
    finally:
        for node in cluster.nodes:
            _set_faults(node)
    typed = [r for r in results if r.status == 200 and r.stream_error and r.stream_error != "malformed_event"]
    figures: Figures = {"streams": len(results), "typed_errors": len(typed)}
    check(len(typed) == len(results), f"streams cut after the first byte: {_statuses(results)}", figures)
    figures["code"] = ",".join(sorted({r.stream_error or "" for r in typed}))
    return figures


async def _under_load(c: Campaign, action: Any) -> tuple[list[Result], float, Any]:
    """Steady load by STEADY_CLIENTS, `action()` run once it is going; (results, when it ran, what it gave)."""
    results: list[Result] = []
    stop = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            lambda: steady(c.cluster.the_gateway(), c.prompt("steady"), results, stop, clients=STEADY_CLIENTS)
        )
        with trio.fail_after(TIMEOUT_S):
            while len(results) < 2 * STEADY_CLIENTS:  # noqa: ASYNC110 - the load's own list
                await trio.sleep(0.05)
        at = trio.current_time()
        try:
            got = await action()
            with trio.fail_after(TIMEOUT_S):
                n = len(results)
                while len(results) < n + 2 * STEADY_CLIENTS:  # noqa: ASYNC110 - the load's own list
                    await trio.sleep(0.05)
        finally:
            stop.set()
    c.count(results)
    return results, at, got


async def node_kill(c: Campaign) -> Figures:
    cluster = c.cluster
    ready = await cluster.wait_replicas()
    victim = cluster.node(c.rng.choice(sorted(set(ready.values()))))

    async def kill() -> None:
        assert victim.proc is not None
        victim.proc.send_signal(signal.SIGKILL)  # by its PID: a crashed machine
        await trio.to_thread.run_sync(victim.proc.wait)
        await cluster.wait_replicas(avoid=victim.name)

    results, killed_at, _ = await _under_load(c, kill)
    started_after = [r for r in results if r.started >= killed_at]
    failed_after = [r for r in started_after if not r.ok]
    in_flight = [r for r in results if r.started < killed_at <= r.ended]
    figures: Figures = {
        "requests": len(results),
        "started_after_kill": len(started_after),
        "failed_after_kill": len(failed_after),
        "in_flight_at_kill": len(in_flight),
        "failed_in_flight": sum(not r.ok for r in in_flight),
    }
    cluster.restart_agent(victim)
    check(not failed_after, f"requests started after the kill failed: {_statuses(failed_after)}", figures)
    await cluster.wait_nodes_ready()
    return figures


async def drain(c: Campaign) -> Figures:
    cluster = c.cluster
    ready = await cluster.wait_replicas()
    drained = c.rng.choice(sorted(set(ready.values())))

    async def run_drain() -> subprocess.CompletedProcess[str]:
        done = await _cli(c, "nodes", "drain", drained)
        await cluster.wait_replicas(avoid=drained)
        return done

    results, _, done = await _under_load(c, run_drain)
    failed = [r for r in results if not r.ok]
    moved = await cluster.ready_replicas()
    figures: Figures = {"requests": len(results), "failed": len(failed), "replicas_ready": len(moved)}
    await _cli(c, "nodes", "uncordon", drained)
    check(done.returncode == 0, f"nexa nodes drain failed: {done.stderr.strip()[:200]}", figures)
    check(not failed, f"requests failed during the drain: {_statuses(failed)}", figures)
    check(drained not in moved.values(), "a replica is still on the drained node", figures)
    return figures


async def _usage_requests(c: Campaign) -> int:
    rows = (await c.cluster.the_api().get("/api/v1/usage"))["rows"]
    return sum(int(r["requests"]) for r in rows)


async def controller_restart(c: Campaign) -> Figures:
    cluster = c.cluster
    api = cluster.the_api()
    await cluster.wait_replicas()
    await _sequential(c, 4, "before-restart")
    deployments = sorted(d["deployment"]["name"] for d in (await api.get("/api/v1/deployments"))["deployments"])
    keys = sorted(k["id"] for k in (await api.get("/api/v1/keys"))["keys"])
    head = (await api.get("/api/v1/audit/head"))["checkpoint"]
    acknowledged = c.acknowledged
    code = await cluster.stop_control()
    await cluster.start_control()
    after_deployments = sorted(d["deployment"]["name"] for d in (await api.get("/api/v1/deployments"))["deployments"])
    after_keys = sorted(k["id"] for k in (await api.get("/api/v1/keys"))["keys"])
    after_head = (await api.get("/api/v1/audit/head"))["checkpoint"]
    verify = await _cli(c, "audit", "verify")
    usage = await _usage_requests(c)
    figures: Figures = {
        "stop_exit": code,
        "deployments": len(after_deployments),
        "keys": len(after_keys),
        "audit_seq": int(after_head["seq"]),
        "usage_requests": usage,
        "acknowledged": acknowledged,
    }
    check(after_deployments == deployments, f"deployments {deployments} became {after_deployments}", figures)
    check(after_keys == keys, "the API keys changed across the restart", figures)
    check(int(after_head["seq"]) >= int(head["seq"]), "the audit chain lost entries", figures)
    check(verify.returncode == 0, f"nexa audit verify failed: {verify.stdout.strip()[-200:]}", figures)
    check(usage >= acknowledged, f"usage shows {usage} requests, {acknowledged} were acknowledged", figures)
    await cluster.wait_nodes_ready()
    await cluster.wait_replicas()
    after = await _sequential(c, 4, "after-restart")
    check(all(r.ok for r in after), f"requests after the restart failed: {_statuses(after)}", figures)
    return figures


def _files_with(root: Path, needle: bytes) -> tuple[int, list[str]]:
    scanned, found = 0, []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        scanned += 1
        try:
            if needle in path.read_bytes():
                found.append(str(path.relative_to(root)))
        except OSError:
            continue
    return scanned, found


async def payload_canary(c: Campaign) -> Figures:
    cluster = c.cluster
    if c.acknowledged == 0:  # picked alone: send some now
        await _sequential(c, 4, "canary")
        await _sequential(c, 2, "canary", stream=True)
    needle = c.canary.encode()
    places = [cluster.control_dir, cluster.root / "nodes", *cluster.root.glob("control-*.log")]
    scanned, found = 0, []
    for place in places:
        if place.is_file():
            scanned += 1
            found += [place.name] if needle in place.read_bytes() else []
        elif place.is_dir():
            n, hits = await trio.to_thread.run_sync(_files_with, place, needle)
            scanned += n
            found += hits
    answers = [b for b in cluster.answers.bodies() if c.canary in b]
    figures: Figures = {"files_scanned": scanned, "files_with_canary": len(found), "answers_with_canary": len(answers)}
    check(not found, f"the canary is in: {', '.join(found[:5])}", figures)
    check(not answers, f"the canary is in {len(answers)} public answers", figures)
    return figures


STEPS: Final[list[Step[Campaign]]] = [
    Step("enroll", enroll),
    Step("signed-sets", signed_sets),
    Step("ready-routing", ready_routing),
    Step("queue-shed", queue_shed),
    Step("retry-before-first-byte", retry_before_first_byte),
    Step("error-after-first-byte", error_after_first_byte),
    Step("node-kill", node_kill),
    Step("drain", drain),
    Step("controller-restart", controller_restart),
    Step("payload-canary", payload_canary),
]
NAMES: Final = [s.name for s in STEPS]

__all__ = ["NAMES", "STEPS", "Campaign", "StepFailed"]
