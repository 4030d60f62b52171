"""Rerank, score, tokenize and detokenize end to end: real HTTP through a controller, real `nexa node`
agents and their `sim` runtimes, which serve these paths as vLLM documents them
(`nexa/simruntime/pooling.py`). The official `openai` SDK has no rerank, score or tokenizer call, so
these tests speak HTTP with httpx, as vLLM's and Cohere-compatible clients do.

Each call takes the embeddings' path through the gateway (key, tenant, quota, admission, routing,
metering by tokens); only replicas whose runtime serves the path get it (`ServingReplica.serves`).
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.support.cluster import SIM_ARGS, SimCluster, new_key, usage_rows

pytestmark = pytest.mark.slow

Json = dict[str, Any]
DOCUMENTS = ["the cat sat on the mat", "a france travel guide", "paris is the capital of france"]
QUERY = "capital of france"


def http(cluster: SimCluster, key: str | None = None) -> httpx.AsyncClient:
    """A client of the inference routes with an inference key (the cluster's tenant's by default)."""
    headers = {"authorization": f"Bearer {key or cluster.inference_key}"}
    return httpx.AsyncClient(base_url=cluster.controller.url, headers=headers, timeout=30)


async def test_rerank_score_tokenize_and_detokenize_answer_and_are_metered_by_tokens(cluster: SimCluster) -> None:
    async with http(cluster) as client:
        answers = []
        for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
            got = await client.post(path, json={"model": "chat", "query": QUERY, "documents": DOCUMENTS, "top_n": 2})
            assert got.status_code == 200, got.text
            answers.append(got.json())
        for ranked in answers:
            assert [r["index"] for r in ranked["results"]] == [2, 1]  # most query words first, the best two
            assert ranked["results"][0]["relevance_score"] == 1.0
            assert ranked["results"][0]["document"]["text"] == DOCUMENTS[2]
            assert ranked["model"] == "tiny" and ranked["usage"]["prompt_tokens"] == 3 * 3 + 6 + 4 + 6
        scored = (await client.post("/v1/score", json={"model": "chat", "text_1": QUERY, "text_2": DOCUMENTS})).json()
        assert [d["score"] for d in scored["data"]] == [0.0, 0.333333, 1.0] and scored["usage"]["prompt_tokens"] == 25
        alias = await client.post("/score", json={"model": "chat", "text_1": "a b", "text_2": "b c"})
        assert alias.status_code == 200 and alias.json()["data"][0]["score"] == 0.5

        tokens = (await client.post("/tokenize", json={"model": "chat", "prompt": "amber river nonword"})).json()
        assert tokens["count"] == 3 and len(tokens["tokens"]) == 3 and tokens["max_model_len"] > 0
        text = (await client.post("/detokenize", json={"model": "chat", "tokens": tokens["tokens"]})).json()
        assert text == {"prompt": "amber river <unk>"}
    [row] = await usage_rows(cluster, tenant="acme")
    # Rerank and score report their usage; tokenize is metered by the ids it answers, detokenize by those sent.
    assert row["requests"] == 7 and row["errors"] == 0 and row["completion_tokens"] == 0
    assert row["prompt_tokens"] == 3 * 25 + 25 + 4 + 3 + 3


async def test_a_model_whose_runtimes_do_not_serve_the_api_is_a_typed_404_naming_what_to_do(
    cluster: SimCluster,
) -> None:
    await cluster.model("plain", "plain")
    await cluster.deploy("plain-a", replicas=1, alias="plain", args=[*SIM_ARGS, "--serve", "tokenize"])
    async with http(cluster) as client:
        refused = await client.post("/v1/rerank", json={"model": "plain", "query": "q", "documents": ["d"]})
        assert refused.status_code == 404, refused.text
        error = refused.json()["error"]
        assert error["code"] == "api_not_served" and error["type"] == "invalid_request_error"
        assert "/v1/rerank" in error["message"] and "deploy it on one that does" in error["message"]
        # What it serves, it answers.
        served = await client.post("/tokenize", json={"model": "plain", "prompt": "one two"})
        assert served.status_code == 200 and served.json()["count"] == 2
    journal = [e for n in cluster.nodes for e in n.journal() if e["path"] in ("/v1/rerank", "/tokenize")]
    assert [e["path"] for e in journal if e["event"] == "request"] == ["/tokenize"]  # the refusal ran nothing


BAD: list[tuple[str, Json, str]] = [
    ("/v1/rerank", {"model": "chat", "documents": ["d"]}, "query"),
    ("/v1/rerank", {"model": "chat", "query": "q", "documents": []}, "documents"),
    ("/v1/rerank", {"model": "chat", "query": "q", "documents": ["d"], "top_n": -1}, "top_n"),
    ("/v1/rerank", {"model": "chat", "query": "q", "documents": ["d"], "stream": True}, "stream"),
    ("/v1/score", {"model": "chat", "text_1": "a"}, "text_2"),
    ("/tokenize", {"model": "chat"}, "prompt"),
    ("/detokenize", {"model": "chat", "tokens": [1, "x"]}, "tokens"),
    ("/detokenize", {"tokens": [1]}, "model"),
]


async def test_bad_input_is_a_typed_400_in_openai_shape_and_nothing_runs(cluster: SimCluster) -> None:
    async with http(cluster) as client:
        for path, body, problem in BAD:
            refused = await client.post(path, json=body)
            assert refused.status_code == 400, (path, refused.text)
            error = refused.json()["error"]
            assert error["type"] == "invalid_request_error" and problem in error["message"], (path, error)
        not_json = await client.post("/tokenize", content=b"{", headers={"content-type": "application/json"})
        assert not_json.status_code == 400 and not_json.json()["error"]["code"] == "invalid_request"
        unknown = await client.post("/v1/rerank", json={"model": "no-such-alias", "query": "q", "documents": ["d"]})
        assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "model_not_found"
        async with httpx.AsyncClient(base_url=cluster.controller.url, timeout=30) as anonymous:
            keyless = await anonymous.post("/tokenize", json={})
        assert keyless.status_code == 401 and keyless.json()["error"]["type"] == "authentication_error"
        # The controller serves on.
        served = await client.post("/tokenize", json={"model": "chat", "prompt": "one"})
        assert served.status_code == 200
    assert not [e for n in cluster.nodes for e in n.journal() if e["event"] == "failed"]


async def test_quota_refusal_is_openais_rate_limit_error_with_retry_after(cluster: SimCluster) -> None:
    limited = await new_key(cluster, "inference", "beta")
    async with cluster.client() as admin:
        await admin.put("/api/v1/quotas/beta", json={"requests_per_minute": 1})
    async with http(cluster, limited) as client:
        first = await client.post("/tokenize", json={"model": "chat", "prompt": "one two"})
        assert first.status_code == 200
        refused = await client.post("/v1/rerank", json={"model": "chat", "query": "q", "documents": ["d"]})
        assert refused.status_code == 429
        assert refused.json()["error"]["type"] == "rate_limit_error"
        assert refused.json()["error"]["code"] == "quota_exceeded"
        assert int(refused.headers["retry-after"]) >= 1
    rows = {r["tenant"]: r for r in await usage_rows(cluster)}
    assert rows["beta"]["requests"] == 2 and rows["beta"]["errors"] == 1 and rows["beta"]["prompt_tokens"] == 2
