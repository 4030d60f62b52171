"""Gateway workers on the embedded store (issue 32, point 6): `nexa control` with `[http] workers = 2`
as an operator runs it, a `sim` node with a channel to each worker (node.toml `controllers`). Also:
a stored response's pin is found through either worker and after a restart (issue 35).

Asserted: both workers answer on the one shared port, inference included; a management write that
reached the worker that does not hold the lease was forwarded to the one that does, and each
worker's own address lists it; the owner of the store's writes, killed with SIGKILL, is started
again by `nexa control`, the other worker takes the lease, and no acknowledged write or usage
record is lost; writes and inference go on; SIGTERM stops everything, exit 0.
"""

from __future__ import annotations

import functools
import json
import os
import re
import signal
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import trio

from tests.conftest import Controller, ControllerProcess, free_channel_port, free_port
from tests.realparts import BuiltImages, S3Store
from tests.support.api import in_thread, ok
from tests.support.cluster import MESSAGES, SIM_ARGS, SimCluster, sim_fleet, wait_until
from tests.support.s3 import write_credentials

#: Fresh connections sent to the shared port; the chance that all reach one of two workers is 2**-23.
CONNECTIONS = 24
_STARTED = re.compile(r"gateway worker (\d+) started \(pid (\d+)\)")


def _config(tmp_path: Path, s3: S3Store) -> Path:
    """Two workers; what `registry_config` sets; a short lease, so the hand-over is quick."""
    creds = write_credentials(tmp_path / "s3-credentials.json", s3)
    config = tmp_path / "control.toml"
    config.write_text(
        "[http]\nworkers = 2\n"
        "[cluster]\nlease_s = 2.0\nrenew_s = 0.5\nrefresh_s = 0.1\n"
        "[gateway]\nmetering_flush_s = 0.2\n"
        "[oci]\ntls_verify = false\n"
        f'[artifacts]\ns3_endpoint = "{s3.endpoint}"\ns3_region = "{s3.region}"\n'
        f's3_credentials_file = "{creds}"\ns3_tls_verify = false\n'
    )
    return config


def _pids(cp: ControllerProcess) -> dict[int, int]:
    """worker → the pid it was last started with, from the supervisor's log."""
    assert cp.stderr_path is not None
    return {int(m[1]): int(m[2]) for m in _STARTED.finditer(cp.stderr_path.read_text())}


async def _fresh(url: str, method: str, path: str, key: str, **kwargs: Any) -> httpx.Response:
    """One request on a connection of its own: the kernel picks a worker per connection."""
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30) as http:
        return await http.request(method, path, **kwargs)


async def _cluster(url: str, key: str) -> dict[str, Any]:
    view: dict[str, Any] = (await ok(_fresh(url, "GET", "/api/v1/cluster", key))) or {}
    return view


async def _ready_on(address: str, key: str, inference_key: str, calls: Counter[str]) -> bool:
    """Whether the worker at `address` (its own) sees the replica of `chat-a` Ready on a Ready node,
    and its gateway answers a completion through it (counted in `calls`: every call is metered)."""
    dep = await ok(_fresh(address, "GET", "/api/v1/deployments/chat-a", key))
    nodes = {n["id"]: n for n in (await ok(_fresh(address, "GET", "/api/v1/nodes", key)))["nodes"]}
    for replica in dep["deployment"]["placed"]:
        node = nodes.get(replica["node_id"])
        states = {a["assignment_id"]: a["state"] for a in (node or {}).get("assignments", [])}
        if node is not None and node["state"] == "Ready" and states.get(replica["id"]) == "Ready":
            body = {"model": "chat", "messages": MESSAGES}
            calls["made"] += 1
            return (await _fresh(address, "POST", "/v1/chat/completions", inference_key, json=body)).status_code == 200
    return False


async def _completions(c: SimCluster, count: int, calls: Counter[str]) -> None:
    """`count` chat completions through the official SDK, each on a connection of its own (counted in `calls`)."""
    for _ in range(count):
        calls["made"] += 1
        async with openai.AsyncOpenAI(base_url=c.base_url, api_key=c.inference_key, max_retries=0) as client:
            done = await client.chat.completions.create(model="chat", messages=MESSAGES)
        assert done.choices[0].message.content


async def _requests_metered(c: SimCluster, url: str) -> int:
    """Requests in the usage records of the whole store (every worker's rows)."""
    report = await ok(_fresh(url, "GET", "/api/v1/usage", c.controller.admin_key))
    return sum(row["requests"] for row in report["rows"])


async def _gateway_requests(address: str, key: str) -> float:
    """`nexa_gateway_requests_total` of the one worker at `address` (its own)."""
    text = (await _fresh(address, "GET", "/metrics", key)).text
    return sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines() if line.startswith("nexa_gateway_requests_total{")
    )


@pytest.mark.slow
async def test_two_gateway_workers_share_the_port_and_a_killed_owner_loses_nothing_acknowledged(
    tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> None:
    # Worker i serves nodes on the channel port + 2i (its key rotation on the next): four free ports.
    cp = ControllerProcess(state_dir=tmp_path / "state", port=free_port(), channel_port=free_channel_port(4))
    channels = (f"tcp://127.0.0.1:{cp.channel_port}", f"tcp://127.0.0.1:{cp.channel_port + 2}")
    await trio.to_thread.run_sync(
        functools.partial(cp.start, "--config", str(_config(tmp_path, s3_store)), timeout_s=180)
    )
    assert cp.admin_key is not None
    key = cp.admin_key
    controller = Controller(cp.url, key, cp.state_dir, trio.Event())
    calls: Counter[str] = Counter()  # chat completions sent, each metered whatever its answer
    try:
        async with sim_fleet(controller, tmp_path, s3_store, test_images, nodes=1, controllers=channels) as c:
            await c.deploy("chat-a", replicas=1, wait=False)
            # Through the shared port the next read may come from the worker that did not take the
            # write and has not applied it yet (its change feed, every [cluster] refresh_s): a 404.
            with trio.fail_after(120):
                while True:
                    try:
                        if await c.ready_replicas("chat-a"):
                            break
                    except AssertionError as exc:
                        if "no deployment chat-a" not in str(exc):
                            raise
                    await trio.sleep(0.1)
            view = await _cluster(cp.url, key)
            own = {m["id"]: m["address"] for m in view["controllers"]}
            owner = view["leader"]
            [other] = [name for name in own if name != owner]
            assert owner.endswith("/0") and other.endswith("/1"), view  # worker 0 started alone, took the lease

            # Each worker learns the replica's state from the node's heartbeats on its own channel.
            for address in own.values():
                ready = functools.partial(_ready_on, address, key, c.inference_key, calls)
                await wait_until(f"the replica Ready as {address} sees it", ready)
            before = {name: await _gateway_requests(address, key) for name, address in own.items()}

            # Both workers answer on the shared port: reads, and inference through the node's channel to each.
            answered = Counter([(await _cluster(cp.url, key))["answered_by"] for _ in range(CONNECTIONS)])
            assert set(answered) == {owner, other}, answered
            await _completions(c, CONNECTIONS, calls)
            served = {name: await _gateway_requests(address, key) - before[name] for name, address in own.items()}
            assert all(n > 0 for n in served.values()) and sum(served.values()) == CONNECTIONS, served

            # A write that reached the other worker was forwarded to the owner; both list every write.
            forwarded: Counter[str | None] = Counter()
            for i in range(CONNECTIONS):
                made = await _fresh(cp.url, "POST", "/api/v1/tenants", key, json={"id": f"t{i}"})
                assert made.status_code == 201, made.text
                forwarded[made.headers.get("x-nexa-forwarded")] += 1
            assert set(forwarded) == {None, owner}, forwarded
            written = {f"t{i}" for i in range(CONNECTIONS)}

            # A worker that did not take a write lists it once its change feed has applied it
            # (every [cluster] refresh_s); the last write may be one feed step behind there.
            async def lists_every_write(address: str) -> bool:
                listed = await ok(_fresh(address, "GET", "/api/v1/tenants", key, params={"limit": 100}))
                return written <= {t["id"] for t in listed["tenants"]}

            for address in own.values():
                await wait_until(f"every write listed by {address}", functools.partial(lists_every_write, address))

            # Every usage record is acknowledged (in the store) once the report shows it.
            async def all_metered() -> bool:
                return await _requests_metered(c, cp.url) == calls["made"]

            await wait_until("every usage record written", all_metered)

            # The owner of the store's writes is killed and started again. The other worker usually
            # takes the lease, at a new epoch; on a machine kept busy, the restarted worker may come
            # back before it, and take its own id's lease again (at its epoch, while unexpired, as
            # `store.acquire_lease` says; at a new one once lapsed). Either way nothing acknowledged
            # is lost.
            epoch = view["epoch"]
            pids = _pids(cp)
            killed = pids[0]
            os.kill(killed, signal.SIGKILL)

            seen: list[object] = []  # what the last look saw, for the failure's message

            async def handed_over() -> dict[str, Any] | None:
                if _pids(cp).get(0) in (None, killed):
                    seen[:] = ["worker 0 not restarted yet", _pids(cp)]
                    return None
                try:
                    view = await _cluster(own[other], key)
                except (httpx.HTTPError, AssertionError) as exc:
                    seen[:] = ["the other worker did not answer", repr(exc)]
                    return None
                seen[:] = [view]
                members = {m["id"]: m for m in view["controllers"]}
                # the restarted worker writes its row again, with its new own address, as a follower
                back = members[owner]["address"] != own[owner] and members[owner]["seen_age_s"] < 2
                # The restarted worker leads once it renews the lease: the killed one renewed it
                # last at least a restart's delay (1 s) before the new one was back.
                renewed = members[owner]["lease_age_s"] is not None and members[owner]["lease_age_s"] < 1.0
                led = (view["leader"] == other and view["epoch"] > epoch) or (view["leader"] == owner and renewed)
                return view if led and back else None

            # A SIGKILLed process started again, on a machine the rest of the suite keeps busy: longer
            # than the usual wait (the lease itself passes in 2 s).
            try:
                after = await wait_until("a new leader's epoch and worker 0 back", handed_over, timeout_s=120)
            except AssertionError as exc:
                raise AssertionError(f"{exc}; last seen: {seen}") from None
            assert after["epoch"] >= epoch
            restarted = {m["id"]: m["address"] for m in after["controllers"]}[owner]

            # Nothing acknowledged was lost: every write, every usage record, through either worker.
            for address in (own[other], restarted):
                listed = await ok(_fresh(address, "GET", "/api/v1/tenants", key, params={"limit": 100}))
                assert written <= {t["id"] for t in listed["tenants"]}, address
                assert await _requests_metered(c, address) == calls["made"]
            # And both go on: writes (made by the new leader) and inference, once the restarted worker
            # has heard the node on its channel (until then it knows of no Ready replica).
            await wait_until(
                "the replica Ready as the restarted worker sees it",
                functools.partial(_ready_on, restarted, key, c.inference_key, calls),
            )
            for i in range(4):
                made = await _fresh(cp.url, "POST", "/api/v1/tenants", key, json={"id": f"after-{i}"})
                assert made.status_code == 201, made.text
            await _completions(c, 4, calls)
    finally:
        code = await trio.to_thread.run_sync(cp.stop)
    assert code == 0, cp.stderr_path.read_text()[-3000:] if cp.stderr_path else code
    log = [json.loads(line) for line in cp.stderr_path.read_text().splitlines() if line.startswith("{")]
    assert any(e["msg"].startswith("gateway worker 0 exited (status -9)") for e in log)
    # Each worker's lines name it: which worker answered each completion (both did).
    answering = {e.get("worker") for e in log if e["msg"] == "request" and e.get("route") == "/v1/chat/completions"}
    assert answering == {0, 1}, answering


async def _stores_on(address: str, key: str) -> bool:
    """Whether the worker at `address` (its own) serves `native` through a replica keeping responses."""
    body = {"model": "native", "input": "ready?", "store": False}
    return (await _fresh(address, "POST", "/v1/responses", key, json=body)).status_code == 200


@pytest.mark.slow
async def test_a_stored_response_made_through_one_worker_is_found_by_the_other_and_after_a_restart(
    tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> None:
    """Issue 35: pins are the store's, not a process's. A response made through worker 0 (its own
    address) is retrieved and continued through worker 1's, and through either after the whole
    `nexa control` restarted (the replica, on its node, kept it)."""
    cp = ControllerProcess(state_dir=tmp_path / "state", port=free_port(), channel_port=free_channel_port(4))
    channels = (f"tcp://127.0.0.1:{cp.channel_port}", f"tcp://127.0.0.1:{cp.channel_port + 2}")
    config = _config(tmp_path, s3_store)
    await trio.to_thread.run_sync(functools.partial(cp.start, "--config", str(config), timeout_s=180))
    assert cp.admin_key is not None
    key = cp.admin_key
    controller = Controller(cp.url, key, cp.state_dir, trio.Event())
    try:
        async with sim_fleet(controller, tmp_path, s3_store, test_images, nodes=1, controllers=channels) as c:
            await c.model("native", "native")
            store = {"VLLM_ENABLE_RESPONSES_API_STORE": "1"}
            await c.deploy(
                "native-a", replicas=1, alias="native", args=[*SIM_ARGS, "--serve", "responses"], env=store, wait=False
            )

            async def own_addresses() -> list[str]:
                view = await _cluster(cp.url, key)
                return [m["address"] for m in sorted(view["controllers"], key=lambda m: m["id"])]

            first, second = await own_addresses()
            for address in (first, second):
                ready = functools.partial(_stores_on, address, c.inference_key)
                await wait_until(f"native served by {address}", ready, timeout_s=120)

            def sdk_at(address: str) -> openai.OpenAI:
                return openai.OpenAI(base_url=address + "/v1", api_key=c.inference_key, max_retries=0, timeout=30)

            def made_and_continued() -> str:
                with sdk_at(first) as zero, sdk_at(second) as one:
                    made = zero.responses.create(model="native", input="hello there", store=True)
                    assert one.responses.retrieve(made.id).output_text == made.output_text
                    later = one.responses.create(model="native", input="and then", previous_response_id=made.id)
                    assert later.usage is not None and later.usage.input_tokens == 2 + 8 + 2
                    assert zero.responses.retrieve(later.id).id == later.id
                    return made.id

            made_id = await in_thread(made_and_continued)

            # The whole controller restarts (both workers); the node and its replica go on.
            assert await trio.to_thread.run_sync(cp.stop) == 0
            await trio.to_thread.run_sync(functools.partial(cp.start, "--config", str(config), timeout_s=180))
            first, second = await own_addresses()
            for address in (first, second):
                ready = functools.partial(_stores_on, address, c.inference_key)
                await wait_until(f"native served by {address} after the restart", ready, timeout_s=120)

            def found_after_restart() -> None:
                for address in (first, second):
                    with sdk_at(address) as client:
                        assert client.responses.retrieve(made_id).id == made_id
                        again = client.responses.create(model="native", input="so", previous_response_id=made_id)
                        assert again.usage is not None and again.usage.input_tokens == 2 + 8 + 1
                        with pytest.raises(openai.NotFoundError) as unknown:
                            client.responses.retrieve("resp_never_made")
                        assert unknown.value.code == "response_not_found"

            await in_thread(found_after_restart)
    finally:
        code = await trio.to_thread.run_sync(cp.stop)
    assert code == 0, cp.stderr_path.read_text()[-3000:] if cp.stderr_path else code
