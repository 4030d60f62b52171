"""LoRA adapters loaded at run time on a replica through the whole data path (issue 34, point 2): a controller,
a real `nexa node` whose runtime is `nexa sim-runtime` speaking vLLM's LoRA endpoints (`--max-loras 2`), and the
official `openai` SDK asking for three adapters' aliases in turn. The node loads each adapter into the running
replica when a request first needs it and, at the limit, unloads the least recently used one first: the
runtime's journal shows every load and unload, and the replica is never restarted. Usage names each adapter.
An adapter an alias serves only after the replica was placed reaches it by a rollout under watch (reason
`adapter`): the replica is replaced by one given the adapter, and the adapter's alias then answers.
A tenant's daily token budget for one adapter refuses that adapter's alias (429 `quota_exceeded`) once
used, while the base model's alias still answers.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import openai
import trio

from tests.realparts import BuiltImages, S3Store
from tests.support.api import ok
from tests.support.cluster import SIM_ARGS, gateway_cluster, sdk, usage_rows, wait_until
from tests.support.console import sign_in
from tests.support.models import Artifact, model_body, upload


async def test_adapters_load_on_demand_and_the_least_recently_used_is_unloaded_at_the_limit(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages, tiny_lora_gguf: Path
) -> None:
    async with gateway_cluster(nursery, tmp_path, s3_store, test_images) as cluster:
        art = await upload(s3_store, await trio.Path(tiny_lora_gguf).read_bytes())
        async with cluster.client() as http:
            for name in ("poet", "coder", "judge"):
                await serve_adapter(http, art, name)
        await cluster.deploy("chat", replicas=1, args=[*SIM_ARGS, "--max-loras", "2"])
        ready = await cluster.ready_replicas("chat")
        client = sdk(cluster)

        def ask(model: str) -> str:
            got = client.chat.completions.create(model=model, messages=[{"role": "user", "content": "hi"}])
            assert got.usage is not None and got.usage.completion_tokens >= 1
            return got.choices[0].message.content or ""

        for model in ("poet", "coder", "poet", "judge", "coder", "chat"):
            assert await trio.to_thread.run_sync(ask, model)
        assert await cluster.ready_replicas("chat") == ready  # the same replica all along
        node = next(n for n in cluster.nodes if n.node_id in ready.values())
        events = node.journal()
        loras = [(e["event"], e["loaded"]) for e in events if str(e["event"]).startswith("lora")]
        # vLLM and sim know each adapter version by `<alias>@<version>` (they load them at run time).
        assert loras == [
            ("lora_load", ["poet@a1"]),
            ("lora_load", ["poet@a1", "coder@a1"]),
            ("lora_unload", ["poet@a1"]),  # judge: coder was the least recently used
            ("lora_load", ["poet@a1", "judge@a1"]),
            ("lora_unload", ["judge@a1"]),  # coder again: poet was
            ("lora_load", ["judge@a1", "coder@a1"]),
        ]
        assert sum(1 for e in events if e["event"] == "completed") == 6

        # The console's models page names each adapter's base, and each alias's adapter.
        async with httpx.AsyncClient(base_url=cluster.controller.url) as browser:
            assert (await sign_in(browser, cluster.controller.admin_key)).status_code == 303
            page = (await browser.get("/console/models")).text
        assert 'id="lora-base-poet-a1">LoRA adapter on tiny v1</small>' in page
        assert 'id="alias-adapter-judge">+ LoRA judge a1</span>' in page

        async def counted() -> list[dict[str, object]] | None:
            rows = await usage_rows(cluster, tenant=cluster.tenant)
            return rows if sum(int(str(r["requests"])) for r in rows) >= 6 else None

        rows = await wait_until("usage of the six requests", counted)
        assert {r["model"]: r["requests"] for r in rows} == {
            "tiny:v1+poet:a1": 2,
            "tiny:v1+coder:a1": 2,
            "tiny:v1+judge:a1": 1,
            "tiny:v1": 1,
        }

        # An adapter an alias serves only after the replica was placed reaches it by a rollout under watch: the
        # replica is replaced by one whose assignment gives it the adapter, then the adapter's alias answers.
        async with cluster.client() as http:
            policy = {"rollout_policy": {"soak_s": 0.5, "min_requests": 5}}
            await ok(http.post("/api/v1/deployments/chat/change", json=policy))
            await serve_adapter(http, art, "late")

            async def rolled() -> bool:
                dep = (await ok(http.get("/api/v1/deployments/chat")))["deployment"]
                return dep["rollout"] is None and "late" in dep["loras"]

            await wait_until("the adapter's rollout", rolled)
            [started] = (await ok(http.get("/api/v1/audit", params={"action": "deployment.adapters"})))["events"]
        assert "late: - -> late@a1" in started["detail"]
        after = await cluster.wait_ready("chat", 1)
        assert after != ready  # a new replica
        assert await trio.to_thread.run_sync(ask, "late")
        assert await trio.to_thread.run_sync(ask, "poet")


async def test_an_adapters_daily_token_budget_refuses_its_alias_once_used_and_the_base_still_answers(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages, tiny_lora_gguf: Path
) -> None:
    async with gateway_cluster(nursery, tmp_path, s3_store, test_images) as cluster:
        art = await upload(s3_store, await trio.Path(tiny_lora_gguf).read_bytes())
        async with cluster.client() as http:
            await serve_adapter(http, art, "poet")
        await cluster.deploy("chat", replicas=1, args=[*SIM_ARGS, "--max-loras", "2"])
        client = sdk(cluster)

        def ask(model: str) -> int:
            got = client.chat.completions.create(
                model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            assert got.usage is not None and got.choices[0].message.content
            return got.usage.total_tokens

        # One answer's tokens, unlimited; then a budget of two more answers' for the adapter alone.
        per_answer = await trio.to_thread.run_sync(ask, "poet")
        limits = {"adapter_tokens_per_day": {"poet": 3 * per_answer}}
        async with cluster.client() as http:
            view = await ok(http.put(f"/api/v1/quotas/{cluster.tenant}", json=limits))
        assert view["limits"]["adapter_tokens_per_day"] == {"poet": 3 * per_answer}

        async def use() -> dict[str, object]:
            async with cluster.client() as http:
                used: dict[str, object] = (await ok(http.get(f"/api/v1/quotas/{cluster.tenant}")))["use"]
            return used

        async def settled() -> bool:
            # The quota settles as the call's last steps run, which may be after the client has its answer.
            return (await use())["concurrent_requests"] == 0

        answered, refused = 0, None
        while refused is None and answered < 10:
            await wait_until("the last answer settled", settled)
            try:
                await trio.to_thread.run_sync(ask, "poet")
                answered += 1
            except openai.RateLimitError as exc:
                refused = exc
        assert answered == 2 and refused is not None
        assert refused.code == "quota_exceeded" and "adapter poet" in refused.message
        assert int(refused.response.headers["retry-after"]) >= 1
        base = await trio.to_thread.run_sync(ask, "chat")  # the base model: not the adapter's budget
        await wait_until("the base model's answer settled", settled)
        today = await use()
        assert today["adapter_tokens_today"] == {"poet": 3 * per_answer}
        assert today["tokens_today"] == 3 * per_answer + base


async def serve_adapter(http: httpx.AsyncClient, art: Artifact, name: str) -> None:
    """Register the adapter `name@a1` for tiny@v1 from the uploaded artifact `art`, approve it, and
    have the alias `name` serve it on its base."""
    body = model_body(name, "a1", art, kind="lora", base=[{"model": "tiny", "version": "v1"}])
    await ok(http.post("/api/v1/models", json=body), 201)
    await bring_to_approved(http, name)
    adapter = {"model": "tiny", "version": "v1", "adapter": {"model": name, "version": "a1"}}
    await ok(http.post(f"/api/v1/aliases/{name}/promote", json=adapter))


async def bring_to_approved(http: httpx.AsyncClient, name: str) -> None:
    """Verify, evaluate and approve `name@a1` over the API."""
    path = f"/api/v1/models/{name}/a1"
    await ok(http.post(f"{path}/verify"))
    await ok(http.post(f"{path}/evaluations", json={"suite": "smoke", "metrics": {}, "passed": True}), 201)
    await ok(http.post(f"{path}/approve"))
