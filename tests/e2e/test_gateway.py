"""The inference gateway end to end: the official `openai` SDK and the canonical workloads API against
a controller, real `nexa node` agents on 127.0.0.11 and .12 and their `sim` runtimes.

Placement, signed assignments, readiness and the relay over each node's CurveZMQ channel are all
real; only the model server is the simulation.
"""

from __future__ import annotations

import json
import logging
import secrets
import subprocess
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, TypeVar

import httpx
import openai
import pytest
import trio

from nexa.telemetry import JsonFormatter
from tests.realparts import BuiltImages, S3Store
from tests.support.api import in_thread, ok, wait_for
from tests.support.cluster import MESSAGES, SimCluster, SimNode, gateway_cluster, new_key, sdk, usage_rows
from tests.support.models import bring_to

pytestmark = pytest.mark.slow
T = TypeVar("T")

Json = dict[str, Any]
#: A slow stream: 200 tokens at 20 per second.
SLOW_ARGS = ["--ttft-ms", "5", "--tokens-per-s", "20", "--output-tokens", "200"]


async def test_the_official_sdk_gets_chat_streams_completions_and_embeddings(cluster: SimCluster) -> None:
    client = sdk(cluster)

    def scenario() -> None:
        assert [m.id for m in client.models.list().data] == ["chat"]
        chat = client.chat.completions.create(model="chat", messages=MESSAGES)
        assert chat.choices[0].message.content
        assert chat.usage is not None and chat.usage.completion_tokens == 8 and chat.usage.prompt_tokens == 2

        stream = client.chat.completions.create(
            model="chat", messages=MESSAGES, stream=True, stream_options={"include_usage": True}
        )
        chunks = list(stream)
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
        # Without include_usage the client gets no usage chunk (the gateway asked the runtime for it anyway).
        plain = list(client.chat.completions.create(model="chat", messages=MESSAGES, stream=True))
        assert plain and all(c.usage is None for c in plain)

        completion = client.completions.create(model="chat", prompt="once upon a time", max_tokens=4)
        assert completion.usage is not None and completion.usage.completion_tokens == 4
        assert completion.choices[0].text

        embeddings = client.embeddings.create(model="chat", input=["alpha", "beta", "gamma"])
        assert [d.index for d in embeddings.data] == [0, 1, 2]
        assert len({tuple(d.embedding) for d in embeddings.data}) == 3
        single = client.embeddings.create(model="chat", input="alpha")
        assert single.data[0].embedding == embeddings.data[0].embedding  # deterministic, batched or not

    await in_thread(scenario)
    [row] = await usage_rows(cluster, tenant="acme")
    assert row["tenant"] == "acme" and row["requests"] == 6 and row["errors"] == 0
    assert row["completion_tokens"] == 8 + 8 + 8 + 4


async def test_concurrent_embeddings_are_batched_and_split_back(cluster: SimCluster) -> None:
    client = sdk(cluster)
    results: dict[int, list[float]] = {}

    def one(i: int) -> None:
        got = client.embeddings.create(model="chat", input=f"text number {i}")
        assert [d.index for d in got.data] == [0]
        assert got.usage.prompt_tokens >= 1
        results[i] = got.data[0].embedding

    async with trio.open_nursery() as n:
        for i in range(24):
            n.start_soon(trio.to_thread.run_sync, one, i)
    alone = await in_thread(lambda: client.embeddings.create(model="chat", input="text number 7"))
    assert results[7] == alone.data[0].embedding
    requests = [e for node in cluster.nodes for e in node.journal() if e["event"] == "request"]
    embedding_calls = [e for e in requests if e["path"] == "/v1/embeddings"]
    assert len(embedding_calls) < 25  # fewer runtime calls than client requests: merged
    [row] = await usage_rows(cluster, tenant="acme")
    assert row["requests"] == 25 and row["errors"] == 0


async def test_each_error_class_reaches_the_sdk_as_its_usual_exception(cluster: SimCluster) -> None:
    operator = await new_key(cluster, "operator")
    limited = await new_key(cluster, "inference", "beta")
    async with cluster.client() as http:
        await ok(http.put("/api/v1/quotas/beta", json={"requests_per_minute": 1}))

    def ask(key: str | None = None, model: str = "chat", **extra: Any) -> Any:
        return sdk(cluster, key).chat.completions.create(model=model, messages=MESSAGES, **extra)

    def scenario() -> None:
        with pytest.raises(openai.AuthenticationError):
            ask("nxk_not_a_key")
        with pytest.raises(openai.PermissionDeniedError):
            ask(operator)
        with pytest.raises(openai.NotFoundError) as not_found:
            ask(model="no-such-alias")
        assert not_found.value.code == "model_not_found"
        with pytest.raises(openai.BadRequestError):
            ask(stream_options={"include_usage": True})
        ask(limited)
        with pytest.raises(openai.RateLimitError) as limited_exc:
            ask(limited)
        assert limited_exc.value.code == "quota_exceeded"
        assert int(limited_exc.value.response.headers["retry-after"]) >= 1

    await in_thread(scenario)

    # A deployment whose runtime never becomes Ready: 503 at once, not a wait.
    await cluster.model("never", alias="idle")
    await cluster.deploy("broken", replicas=1, alias="idle", args=["--no-such-flag"], wait=False)
    started = trio.current_time()
    with pytest.raises(openai.InternalServerError) as unready:
        await in_thread(lambda: ask(model="idle"))
    assert unready.value.status_code == 503 and unready.value.code == "no_ready_replica"
    assert trio.current_time() - started < 1


async def test_a_failure_before_the_first_byte_is_retried_on_the_other_replica(cluster: SimCluster) -> None:
    failing, healthy = cluster.nodes
    failing.set_faults(fail="before", status=500)
    client = sdk(cluster)

    def scenario() -> None:
        for i in range(10):  # different prompts: prefix affinity spreads them over both replicas
            chat = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": f"q {i}"}])
            assert chat.choices[0].message.content
            streamed = client.chat.completions.create(
                model="chat", messages=[{"role": "user", "content": f"stream {i}"}], stream=True
            )
            assert list(streamed)

    await in_thread(scenario)
    assert any(e["event"] == "failed" for e in failing.journal())

    async def all_journaled() -> bool:  # a runtime journals `completed` just after the answer's last byte
        return sum(e["event"] == "completed" for e in healthy.journal()) >= 20

    await wait_for(all_journaled, timeout_s=10)
    assert sum(e["event"] == "completed" for e in healthy.journal()) == 20
    assert sum(r["errors"] for r in await usage_rows(cluster)) == 0


def streaming_now(cluster: SimCluster) -> tuple[SimNode, str]:
    """The node whose runtime is answering a stream now, and that stream's id (the relay's id,
    made by the controller: the client's X-Request-Id never reaches a node)."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for node in cluster.nodes:
            events = node.journal()
            ended = {e["id"] for e in events if e["event"] != "request"}
            for e in events:
                if e["event"] == "request" and e.get("stream") and e["id"] not in ended:
                    return node, e["id"]
        time.sleep(0.05)
    raise AssertionError("no runtime journaled a stream in progress")


async def slow_alias(cluster: SimCluster) -> None:
    """Alias `slow` on a model of its own, served by one slow replica."""
    await cluster.model("slowpoke", alias="slow")
    await cluster.deploy("slow", replicas=1, alias="slow", args=SLOW_ARGS)


async def test_a_client_that_goes_away_cancels_the_runtime_request(cluster: SimCluster) -> None:
    await slow_alias(cluster)
    client = sdk(cluster)

    def scenario() -> tuple[SimNode, str]:
        stream = client.chat.completions.create(model="slow", messages=MESSAGES, stream=True)
        for got, _ in enumerate(stream, 1):
            if got == 3:
                at = streaming_now(cluster)
                break
        stream.close()
        return at

    node, stream_id = await in_thread(scenario)
    with trio.fail_after(10):
        while not any(e["event"] == "cancelled" and e["id"] == stream_id for e in node.journal()):  # noqa: ASYNC110
            await trio.sleep(0.05)
    [row] = await usage_rows(cluster, tenant="acme")
    assert row["errors"] == 1  # metered, as cancelled


async def test_a_node_killed_mid_stream_ends_it_with_a_typed_error_and_a_usage_record(cluster: SimCluster) -> None:
    await slow_alias(cluster)
    client = sdk(cluster)

    def scenario() -> tuple[int, str]:
        raw = client.chat.completions.with_raw_response.create(model="slow", messages=MESSAGES, stream=True)
        got = 0

        def read_and_kill() -> None:
            nonlocal got
            for _ in raw.parse():
                got += 1
                if got == 2:
                    streaming_now(cluster)[0].kill()

        with pytest.raises(openai.APIError) as broken:
            read_and_kill()
        return got, str(broken.value)

    got, message = await in_thread(scenario)
    assert got >= 2
    assert "stopped answering" in message
    rows = await usage_rows(cluster, tenant="acme")
    assert sum(r["errors"] for r in rows) == 1
    assert sum(r["completion_tokens"] for r in rows) >= 1


async def test_the_deadline_covers_queue_time(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> None:
    async with gateway_cluster(nursery, tmp_path, s3_store, test_images, max_inflight_per_replica=1) as c:
        await c.deploy("slow", replicas=1, alias="chat", args=SLOW_ARGS)
        assert await in_thread(partial(_queued_past_deadline, sdk(c))) < 5


def _queued_past_deadline(client: openai.OpenAI) -> float:
    """With the only slot taken by a stream, a request with a 300 ms deadline is refused by then."""
    busy = client.chat.completions.create(model="chat", messages=MESSAGES, stream=True)
    assert next(iter(busy))
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as late:
        client.chat.completions.create(model="chat", messages=MESSAGES, extra_headers={"X-Nexa-Deadline-Ms": "300"})
    assert late.value.status_code == 504 and late.value.code == "deadline_exceeded"
    busy.close()
    return time.monotonic() - started


async def test_canonical_workloads_are_idempotent_cancellable_and_receipted(cluster: SimCluster) -> None:
    headers = {"Authorization": f"Bearer {cluster.inference_key}"}
    envelope: Json = {
        "version": "nexa.v1",
        "idempotency_key": "order-1",
        "workload_id": "wl-1",
        "capability": "chat",
        "model": "chat",
        "payload": {"messages": MESSAGES},
    }
    async with httpx.AsyncClient(base_url=cluster.controller.url, headers=headers, timeout=20) as http:
        done = await ok(http.post("/api/v1/workloads", json=envelope))
        assert done["state"] == "succeeded" and done["output"]["choices"]
        receipt = done["receipt"]
        assert receipt["receipt"]["completion_tokens"] == 8 and receipt["receipt"]["tenant"] == "acme"
        calls_before = sum(e["event"] == "request" for n in cluster.nodes for e in n.journal())
        again = await ok(http.post("/api/v1/workloads", json=envelope))
        assert again["receipt"] == receipt and again["output"] is None
        assert sum(e["event"] == "request" for n in cluster.nodes for e in n.journal()) == calls_before
        assert (await ok(http.get("/api/v1/workloads/wl-1")))["state"] == "succeeded"
        assert await ok(http.get("/api/v1/workloads/wl-1/receipt")) == receipt

        refused = await http.post(
            "/api/v1/workloads", json={**envelope, "idempotency_key": "x", "retention": "retain_until"}
        )
        assert refused.status_code == 422 and refused.json()["error"]["code"] == "retention_unavailable"

        await slow_alias(cluster)
        slow = {**envelope, "workload_id": "wl-2", "idempotency_key": "order-2", "model": "slow"}
        answers: list[httpx.Response] = []

        async def submit() -> None:
            answers.append(await http.post("/api/v1/workloads", json=slow))

        async with trio.open_nursery() as n:
            n.start_soon(submit)
            with trio.fail_after(10):
                while (await http.get("/api/v1/workloads/wl-2")).status_code != 200:  # noqa: ASYNC110
                    await trio.sleep(0.05)
            active = await http.post("/api/v1/workloads", json={**slow, "idempotency_key": "order-3"})
            assert active.status_code == 409 and active.json()["error"]["code"] == "workload_already_active"
            cancelled = await http.post("/api/v1/workloads/wl-2/cancel")
            assert cancelled.status_code == 202
        [answer] = answers
        assert answer.status_code == 499 and answer.json()["error"]["code"] == "cancelled"
        final = await ok(http.get("/api/v1/workloads/wl-2/receipt"))
        assert final["receipt"]["state"] == "cancelled"
        key = (await ok(http.get("/api/v1/receipts/public-key")))["public_key"]

    path = cluster.tmp / "receipt.json"
    path.write_text(json.dumps(receipt))
    good = await trio.to_thread.run_sync(_cli, "receipts", "verify", str(path), "--public-key", key)
    assert good.returncode == 0 and "valid" in good.stdout, good.stderr
    tampered = json.loads(json.dumps(receipt))
    tampered["receipt"]["completion_tokens"] = 1
    path.write_text(json.dumps(tampered))
    bad = await trio.to_thread.run_sync(_cli, "receipts", "verify", str(path), "--public-key", key)
    assert bad.returncode == 1 and "INVALID" in bad.stdout


def _cli(*args: str, url: str = "", token: str = "") -> subprocess.CompletedProcess[str]:
    env = {"NEXA_URL": url, "NEXA_TOKEN": token, "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [sys.executable, "-m", "nexa", *args], capture_output=True, text=True, timeout=60, env=env, check=False
    )


async def test_quotas_and_usage_through_the_cli(cluster: SimCluster) -> None:
    url, admin = cluster.controller.url, cluster.controller.admin_key
    await in_thread(lambda: sdk(cluster).chat.completions.create(model="chat", messages=MESSAGES))
    out = await trio.to_thread.run_sync(
        lambda: _cli("quotas", "set", "acme", "--rpm", "100", "--tpd", "5000", url=url, token=admin)
    )
    assert out.returncode == 0, out.stderr
    shown = await trio.to_thread.run_sync(lambda: _cli("quotas", "show", "acme", "--json", url=url, token=admin))
    quota = json.loads(shown.stdout)
    assert quota["limits"]["requests_per_minute"] == 100 and quota["limits"]["tokens_per_day"] == 5000
    assert quota["use"]["tokens_today"] == 10
    bad = await trio.to_thread.run_sync(lambda: _cli("quotas", "set", "acme", "--rpm", "0", url=url, token=admin))
    assert bad.returncode == 1 and "invalid_request" in bad.stderr
    csv = await trio.to_thread.run_sync(lambda: _cli("usage", "--csv", url=url, token=admin))
    lines = csv.stdout.strip().splitlines()
    assert lines[0].startswith("tenant,") and any(line.startswith("acme,") for line in lines[1:])


async def test_prompts_and_outputs_appear_in_no_log_and_no_state_file(
    cluster: SimCluster, caplog: pytest.LogCaptureFixture
) -> None:
    canary = "CANARY" + secrets.token_hex(8)
    captured: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            captured.append(JsonFormatter().format(record))

    handler = Keep(level=logging.DEBUG)
    root = logging.getLogger()
    root.addHandler(handler)
    old_level = root.level
    root.setLevel(logging.DEBUG)
    try:
        client = sdk(cluster)
        messages: Any = [{"role": "user", "content": f"secret {canary} words"}]

        def scenario() -> None:
            client.chat.completions.create(model="chat", messages=messages)
            assert list(client.chat.completions.create(model="chat", messages=messages, stream=True))
            client.completions.create(model="chat", prompt=canary)
            client.embeddings.create(model="chat", input=[canary, canary + "2"])

        await in_thread(scenario)
        async with httpx.AsyncClient(
            base_url=cluster.controller.url, headers={"Authorization": f"Bearer {cluster.inference_key}"}, timeout=20
        ) as http:
            envelope = {
                "version": "nexa.v1",
                "idempotency_key": canary,
                "workload_id": "w-canary",
                "capability": "completion",
                "model": "chat",
                "payload": {"prompt": canary},
            }
            await ok(http.post("/api/v1/workloads", json=envelope))
        async with cluster.client() as http:
            await ok(http.get("/api/v1/usage"))  # flushes metering
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
    assert captured, "the controller logged nothing at all: the check would be empty"
    assert not [line for line in captured if canary in line]
    assert canary not in caplog.text
    checked = 0
    for path in [cluster.controller.state_dir, *(n.state_dir for n in cluster.nodes)]:
        for f in path.rglob("*"):
            if f.is_file():
                checked += 1
                assert canary.encode() not in f.read_bytes(), f
    for node in cluster.nodes:
        assert node.log is not None
        assert canary.encode() not in node.log.read_bytes()
    assert checked > 5


async def test_a_canary_that_fails_its_objective_is_rolled_back_by_itself(cluster: SimCluster) -> None:
    """The gateway's metering feeds the rollout watcher: the canary's failed attempts (retried on the
    stable replicas, so clients see none) break its error-rate objective and it is removed, audited."""
    async with cluster.client() as http:
        # One stable replica on one node: the canary lands on the other (spread), which then fails.
        await ok(http.post("/api/v1/deployments/chat-a/scale", json={"replicas": 1}))
        await bring_to(http, cluster.s3, "tiny", "v2", "Approved")
        canary = {
            "model": {"model": "tiny", "version": "v2"},
            "replicas": 1,
            "weight": 0.5,
            "objective": {"max_error_rate": 0.2, "window_s": 30, "min_requests": 4},
        }
        await ok(http.post("/api/v1/deployments/chat-a/canary", json=canary), 201)
        with trio.fail_after(30):
            while (view := await ok(http.get("/api/v1/deployments/chat-a")))["canary_ready"] < 1:  # noqa: ASYNC110
                await trio.sleep(0.1)
    [canary_replica] = view["deployment"]["canary"]["placed"]
    [stable_replica] = view["deployment"]["placed"]
    assert canary_replica["node_id"] != stable_replica["node_id"]
    next(n for n in cluster.nodes if n.node_id == canary_replica["node_id"]).set_faults(fail="before")
    client = sdk(cluster)

    def traffic() -> None:
        for i in range(12):
            answer = client.chat.completions.create(model="chat", messages=[{"role": "user", "content": f"c {i}"}])
            assert answer.choices[0].message.content

    await in_thread(traffic)
    async with cluster.client() as http:
        with trio.fail_after(15):
            while (await ok(http.get("/api/v1/deployments/chat-a")))["deployment"]["canary"] is not None:  # noqa: ASYNC110
                await trio.sleep(0.2)
        events = (await ok(http.get("/api/v1/audit", params={"action": "deployment.canary.auto_rollback"})))["events"]
    [event] = events
    assert event["actor_key_id"] is None and "error rate" in event["detail"]


async def test_two_tenants_sending_the_same_request_id_at_once_both_succeed(cluster: SimCluster) -> None:
    """The relay is keyed by ids the controller makes: a reused X-Request-Id collides with nothing
    (it used to be the multiplex key, and the second tenant got 409)."""
    await slow_alias(cluster)
    other = await new_key(cluster, "inference", "beta")
    body = {"model": "slow", "messages": MESSAGES, "stream": True, "max_tokens": 12}
    shared = "client-chosen-id-1"
    texts: dict[str, bytes] = {}

    async def stream(key: str, opened: trio.Event, both: trio.Event) -> None:
        headers = {"Authorization": f"Bearer {key}", "X-Request-Id": shared}
        async with (
            httpx.AsyncClient(base_url=cluster.controller.url, headers=headers, timeout=30) as http,
            http.stream("POST", "/v1/chat/completions", json=body) as answer,
        ):
            assert answer.status_code == 200
            assert answer.headers["x-request-id"] == shared
            parts = answer.aiter_bytes()
            first = await parts.__anext__()
            opened.set()
            await both.wait()  # both streams are open on the same replica at once
            texts[key] = first + b"".join([p async for p in parts])

    a_open, b_open, both = trio.Event(), trio.Event(), trio.Event()
    with trio.fail_after(30):
        async with trio.open_nursery() as n:
            n.start_soon(stream, cluster.inference_key, a_open, both)
            n.start_soon(stream, other, b_open, both)
            await a_open.wait()
            await b_open.wait()
            both.set()
    for text in texts.values():
        assert b"data: [DONE]" in text and b'"error"' not in text
    assert len(texts) == 2
    ids = [e["id"] for node in cluster.nodes for e in node.journal() if e["event"] == "request" and e.get("stream")]
    assert len(ids) == len(set(ids)) == 2 and shared not in ids
    rows = await usage_rows(cluster)
    assert {r["tenant"] for r in rows} == {"acme", "beta"} and sum(r["errors"] for r in rows) == 0


async def test_a_runtime_answering_garbage_gives_every_caller_runtime_failed_and_the_controller_goes_on(
    cluster: SimCluster,
) -> None:
    """Real nodes, real sim runtimes answering 200 with an HTML page, cut-off JSON or JSON of the
    wrong shape: each caller gets a typed `runtime_failed` and the controller keeps serving."""
    headers = {"Authorization": f"Bearer {cluster.inference_key}"}
    chat_body = {"model": "chat", "messages": MESSAGES}
    async with httpx.AsyncClient(base_url=cluster.controller.url, headers=headers, timeout=30) as http:
        for garble in ("html", "truncated", "shape"):
            for node in cluster.nodes:
                node.set_faults(garble=garble, after_tokens=1)
            await trio.sleep(0.1)  # the runtimes re-read their faults file when it changes
            unary = await http.post("/v1/chat/completions", json=chat_body)
            assert unary.status_code == 502, (garble, unary.text)
            assert unary.json()["error"]["code"] == "runtime_failed"

            streamed = await http.post("/v1/chat/completions", json={**chat_body, "stream": True})
            assert streamed.status_code == 200
            assert b'"runtime_failed"' in streamed.content, garble  # the typed error closes the stream
            assert b"<html>" not in streamed.content and b"[1, 2, 3]" not in streamed.content

            answers = await embed_concurrently(http, 6)
            assert [a.status_code for a in answers] == [502] * 6, garble
            assert {a.json()["error"]["code"] for a in answers} == {"runtime_failed"}

        for node in cluster.nodes:
            node.faults.unlink()
        await trio.sleep(0.1)
        assert (await http.get("/healthz")).status_code == 200
        fine = await http.post("/v1/chat/completions", json=chat_body)
        assert fine.status_code == 200 and fine.json()["choices"]
        fine_embedding = await http.post("/v1/embeddings", json={"model": "chat", "input": "again"})
        assert fine_embedding.status_code == 200 and fine_embedding.json()["data"][0]["index"] == 0
    async with cluster.client() as admin:
        metrics = (await admin.get("/metrics")).text
    assert 'nexa_gateway_invalid_answers_total{kind="unary"}' in metrics
    assert 'nexa_gateway_invalid_answers_total{kind="batch"}' in metrics


async def embed_concurrently(http: httpx.AsyncClient, count: int) -> list[httpx.Response]:
    """`count` embedding requests at once (batched: one runtime call answers them all)."""
    answers: list[httpx.Response] = []

    async def embed(i: int) -> None:
        answers.append(await http.post("/v1/embeddings", json={"model": "chat", "input": f"t {i}"}))

    async with trio.open_nursery() as n:
        for i in range(count):
            n.start_soon(embed, i)
    return answers
