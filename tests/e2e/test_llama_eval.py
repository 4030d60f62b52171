"""An evaluation suite run against the real llama.cpp (`llama-server`, built as in
`test_llama_server.py`) through real podman on CPU: a version registered and verified but not
approved is measured by `nexa eval run --model NAME@VERSION` on a short-lived evaluation replica run
like the `chat` deployment, with scorers that make sense for a tiny model whose text is gibberish: a
regular expression every bounded answer meets, a JSON Schema its text cannot meet, and cosine
similarity of embeddings from the `embed` deployment (issue 36, points 1 and 4)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import trio

from nexa.contracts import codec
from nexa.contracts.evals import EvalRun
from tests.conftest import Controller
from tests.realparts import PodmanService, S3Store
from tests.support.api import ok
from tests.support.models import upload
from tests.support.realmodel import (
    MIB,
    Node,
    cli,
    llama_server_deployment,
    ready_on,
    register_llama_server,
    register_model,
    wait_for,
)

pytestmark = pytest.mark.slow
TEXT = "The quick brown fox jumps over the lazy dog."
SUITE = [
    {
        "id": "bounded",
        "request": {"messages": [{"role": "user", "content": "hello"}], "max_tokens": 8, "temperature": 0},
        "scorer": {"kind": "regex", "pattern": "^[\\s\\S]{0,2000}$"},
        "metric": "bounded",
    },
    {
        "id": "json",
        "request": {"messages": [{"role": "user", "content": "a city as JSON"}], "max_tokens": 8, "temperature": 0},
        "scorer": {"kind": "json_schema", "schema": {"type": "object", "required": ["city"]}},
    },
    {
        "id": "same",
        "request": {"embedding_pair": [TEXT, TEXT]},
        "scorer": {"kind": "cosine", "min": 0.99, "deployment": "embed"},
    },
]


async def test_a_suite_measures_a_version_not_yet_approved_on_a_llama_server_evaluation_replica(
    llama_cluster: tuple[Controller, list[Node]],
    s3_store: S3Store,
    llama_server_image: str,
    tiny_gguf: Path,
    tiny_embedding_gguf: Path,
    podman_service: PodmanService,
    tmp_path: Path,
) -> None:
    controller, _nodes = llama_cluster
    await register_llama_server(controller, llama_server_image)
    await register_model(controller, s3_store, "tiny", tiny_gguf)
    await register_model(controller, s3_store, "tiny-embed", tiny_embedding_gguf)
    # tiny@v2: the same weights, registered and verified, not approved.
    art = await upload(s3_store, await trio.to_thread.run_sync(tiny_gguf.read_bytes))
    for step in (
        ["models", "register", "tiny", "v2", "--uri", art.uri, "--sha256", art.sha256, "--size", str(art.size),
         "--format", "gguf", "--memory", str(256 * MIB), "--source", "file://tiny.gguf"],
        ["models", "license", "tiny", "v2", "--spdx", "Apache-2.0", "--accepted-by", "legal@example.com"],
        ["models", "verify", "tiny", "v2"],
    ):  # fmt: skip
        await trio.to_thread.run_sync(cli, controller, *step)
    async with controller.client() as http:
        await ok(http.post("/api/v1/tenants", json={"id": "acme"}), 201)
        key = (await ok(http.post("/api/v1/keys", json={"role": "inference", "tenant": "acme"}), 201))["key"]
        chat = llama_server_deployment("chat", "tiny", {"ctx_size": 512, "parallel": 1, "flash_attn": "off"})
        await ok(http.post("/api/v1/deployments", json=chat), 201)
        await ok(
            http.post("/api/v1/deployments", json=llama_server_deployment("embed", "tiny-embed", {"embedding": True})),
            201,
        )
    await wait_for(lambda: ready_on(controller, "embed"), "embed Ready")
    suite = tmp_path / "qa.jsonl"
    suite.write_text("".join(json.dumps(case) + "\n" for case in SUITE))
    await trio.to_thread.run_sync(cli, controller, "eval", "register", str(suite), "--name", "qa")

    measured = await trio.to_thread.run_sync(
        cli, controller, "eval", "run", "qa", "--model", "tiny@v2", "--like", "chat", "--inference-key", key,
        "--min-pass-rate", "0", "--ready-timeout-s", "120", "--json",
    )  # fmt: skip
    run = codec.loads(codec.api, measured, EvalRun)
    assert (run.model, run.version) == ("tiny", "v2") and run.deployment.startswith("nexa-eval-")
    by_metric = {s.metric: s for s in run.summaries}
    assert by_metric["bounded"].pass_rate == 1.0, run.run.cases  # llama-server answered through the gateway
    assert by_metric["json_schema"].pass_rate == 0.0 and by_metric["json_schema"].errors == 0  # answered, not JSON
    assert by_metric["cosine"].pass_rate == 1.0 and by_metric["cosine"].mean > 0.99
    async with controller.client() as http:
        model = await ok(http.get("/api/v1/models/tiny/v2"))
        assert [e["run"] for e in model["evaluations"] if e["measured"]] == [run.id]
        assert (await ok(http.get("/api/v1/eval/replicas")))["replicas"] == []
