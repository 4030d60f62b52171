"""llama.cpp on a DGX Spark gets a context and a batch size that fit its reservation.

Through a real controller (`dep_reg`: the run's S3 store and OCI registry) and raw nodes reporting
the recorded GB10 inventory over the real channel: the tiny llama GGUF (`nexa.tinymodel`, written
with llama.cpp's own `gguf` package) is uploaded and verified, the controller reads its header's
attention figures (shown by `nexa models show`), and a `llamacpp` deployment's signed assignment
carries `--ctx-size` and `--batch-size` worked out from the reservation. An operator's context
too large for the reservation fails the node, saying why.
"""

from __future__ import annotations

import hashlib
import secrets
from pathlib import Path
from typing import Any

import pytest
import trio

from nexa.cli.deployments import _print_decision as print_decision
from nexa.cli.models import render_model
from nexa.config import ArtifactStoreConfig, OciConfig
from nexa.contracts import codec
from nexa.contracts.kvcache import CONTEXT_STEP, largest_context
from nexa.contracts.models import ModelDetail
from nexa.contracts.placement import PlacementDecision
from nexa.control.registry.outbound import Outbound
from nexa.errors import ArtifactMissing
from nexa.tinymodel import TINY_LLAMA, split_tiny_gguf
from tests.conftest import Controller
from tests.realparts import BuiltImages, S3Store
from tests.support.api import assert_envelope, node_view, ok
from tests.support.deployments import fleet_image, names, online, set_where
from tests.support.models import Artifact, bring_to, model_body, unique

GIB = 2**30
#: The recorded GB10's pool (tests/fixtures/meminfo/gb10_dgx_spark.meminfo).
POOL = 125106396 * 1024
#: The tiny llama's KV cache: 2 (K and V) x 2 layers x 4 KV heads x 16 x 2 bytes (f16) a token.
PER_TOKEN = 2 * TINY_LLAMA["blocks"] * TINY_LLAMA["heads"] * (TINY_LLAMA["embedding"] // TINY_LLAMA["heads"]) * 2
#: llama-server's engine overhead (adapters.base.ENGINE_OVERHEAD_BYTES), reserved beside the share.
OVERHEAD = GIB


async def test_a_llamacpp_replica_on_a_spark_gets_a_context_that_fits_its_reservation(
    dep_reg: Controller, dial: Any, nursery: trio.Nursery, s3_store: S3Store, test_images: BuiltImages, tiny_gguf: Path
) -> None:
    data = await trio.Path(tiny_gguf).read_bytes()
    weights = len(data)
    # Room for 300 tokens of KV cache beside the weights: a context of 256 (a multiple of 256).
    memory = weights + 300 * PER_TOKEN
    n1 = await online(dep_reg, dial, nursery, "n1")
    async with dep_reg.client() as http:
        runtime = {"name": "llama", "kind": "llamacpp", "version": "1", "image": fleet_image(test_images)}
        await ok(http.post("/api/v1/runtimes", json=runtime), 201)
        await bring_to(http, s3_store, "tiny", "v1", "Approved", data=data)
        detail = await ok(http.get("/api/v1/models/tiny/v1"))

        # Verification read the header's figures; `nexa models show` shows them.
        assert detail["model"]["verification"]["gguf"] == {
            "architecture": "llama",
            "context_length": 512,
            "block_count": 2,
            "embedding_length": 64,
            "head_count": 4,
            "head_count_kv": 4,
            "key_length": 16,
            "value_length": 16,
        }
        assert detail["model"]["verification"]["gguf_problem"] == ""
        shown = render_model(codec.api.structure(detail, ModelDetail))
        assert "gguf         llama: trained context 512 tokens, 2 layers, 4 heads (4 KV) of 16/16, width 64" in shown
        assert "kv cache     512 B a token (f16), 256.0 KiB for the trained context" in shown

        # An operator's context too large for the reservation: refused, naming the node and both figures.
        body: dict[str, Any] = {
            "name": "chat-l",
            "runtime": "llama",
            "model": {"model": "tiny", "version": "v1"},
            "resources": {"accelerators": 1, "memory_bytes": memory},
            "options": {"port": 18100, "settings": {"ctx_size": 512}},
        }
        err = assert_envelope(await http.post("/api/v1/deployments", json=body), 422, "memory_over_reservation")
        message = str(err["message"])
        assert "cannot run on node n1: settings.ctx_size 512 needs a 256.0 KiB KV cache, more than the 150.0 KiB" in (
            message
        )
        assert "on the 119.3 GiB unified pool leaves beside the weights and the engine's overhead" in message
        assert "lower settings.ctx_size, or leave it out to have it derived from the reservation" in message
        # The forecast shows the node failing its memory filter for it, and nothing changed.
        forecast = await ok(http.post("/api/v1/capacity/forecast", json=body))
        [e] = forecast["explanations"]
        [failed] = [f for f in e["filters"] if not f["passed"]]
        assert failed["name"] == "memory" and failed["detail"].startswith("settings.ctx_size 512 needs a 256.0 KiB")
        assert (await ok(http.get("/api/v1/deployments")))["deployments"] == []
        assert (await node_view(dep_reg, "n1"))["desired_generation"] == 1

        # Left out, the context is derived from the reservation, with a batch no larger.
        body["options"] = {"port": 18100}
        await ok(http.post("/api/v1/deployments", json=body), 201)
        placement = await ok(http.get("/api/v1/deployments/chat-l/placement"))
    context = largest_context(memory - weights, PER_TOKEN, 512)
    assert context == CONTEXT_STEP == 256
    [e] = placement["decision"]["explanations"]
    assert e["runtime_memory"] == {
        "setting": "ctx_size",
        "flag": "--ctx-size",
        "value": 256,
        "derived": True,
        "reserved_bytes": memory + OVERHEAD,
        "pool_bytes": POOL,
        "claim_bytes": weights + OVERHEAD + 256 * PER_TOKEN,
        "batch_setting": "batch_size",
        "batch_flag": "--batch-size",
        "batch": 256,
        "kv_cache_bytes": 256 * PER_TOKEN,
        "unbounded": "",
        "share_of": "context",
    }
    pushed = await set_where(n1.node, lambda s: "chat-l" in names(s))
    [a] = pushed.assignments
    command = a.runtime.command
    assert command[command.index("--ctx-size") + 1] == "256"
    assert command[command.index("--batch-size") + 1] == "256"
    assert command.count("--ctx-size") == command.count("--batch-size") == 1
    assert a.runtime.memory_bytes == memory


async def test_a_model_without_gguf_figures_runs_unbounded_and_the_explanation_says_why(
    dep_reg: Controller,
    dial: Any,
    nursery: trio.Nursery,
    s3_store: S3Store,
    test_images: BuiltImages,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Random bytes registered as a GGUF: verified (the digest holds), but no figures can be read."""
    n1 = await online(dep_reg, dial, nursery, "n1")
    async with dep_reg.client() as http:
        runtime = {"name": "llama", "kind": "llamacpp", "version": "1", "image": fleet_image(test_images)}
        await ok(http.post("/api/v1/runtimes", json=runtime), 201)
        model = await bring_to(http, s3_store, "tiny", "v1", "Approved")
        assert model["verification"]["gguf"] is None
        assert model["verification"]["gguf_problem"].startswith("the artifact: not a GGUF file: it starts with")
        body = {
            "name": "chat-u",
            "runtime": "llama",
            "model": {"model": "tiny", "version": "v1"},
            "resources": {"accelerators": 1, "memory_bytes": GIB},
            "options": {"port": 18100},
        }
        await ok(http.post("/api/v1/deployments", json=body), 201)
        placement = await ok(http.get("/api/v1/deployments/chat-u/placement"))
    [e] = placement["decision"]["explanations"]
    assert e["eligible"] is True
    memory = e["runtime_memory"]
    assert (memory["value"], memory["claim_bytes"], memory["batch"]) == (None, None, None)
    assert memory["unbounded"].startswith(
        "llama.cpp's context is not bounded by the reservation: its GGUF header could not be read "
        "(the artifact: not a GGUF file"
    )
    # `nexa deployments placement` says so on the node's line.
    print_decision(codec.api.structure(placement["decision"], PlacementDecision))
    assert "; llama.cpp's context is not bounded by the reservation: its GGUF header" in capsys.readouterr().out
    pushed = await set_where(n1.node, lambda s: "chat-u" in names(s))
    [a] = pushed.assignments
    assert "--ctx-size" not in a.runtime.command and "--batch-size" not in a.runtime.command


async def test_the_header_is_read_from_a_split_ggufs_first_shard(
    reg: Controller, s3_store: S3Store, tmp_path: Path
) -> None:
    shards = split_tiny_gguf(tmp_path / "split")
    prefix = unique("tiny/")
    files = []
    for shard in shards:
        data = await trio.Path(shard).read_bytes()
        await s3_store.put(prefix + shard.name, data)
        files.append({"path": shard.name, "size_bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()})
    art = Artifact(uri=s3_store.uri(prefix), sha256="", size=0)
    async with reg.client() as http:
        for version, entry in (("v1", shards[0].name), ("v2", ".")):
            body = model_body("tiny", version, art, artifact={"uri": art.uri, "files": files, "entry": entry})
            await ok(http.post("/api/v1/models", json=body), 201)
        verified = await ok(http.post("/api/v1/models/tiny/v1/verify"))
        # A GGUF manifest pointed at its directory has no file to read: verified, without figures.
        directory = await ok(http.post("/api/v1/models/tiny/v2/verify"))
    figures = verified["verification"]["gguf"]
    assert (figures["architecture"], figures["context_length"], figures["block_count"]) == ("llama", 512, 2)
    assert directory["state"] == "Verified" and directory["verification"]["gguf"] is None
    assert directory["verification"]["gguf_problem"] == "the manifest's entry '.' is a directory, not a GGUF file"


async def test_only_the_head_of_the_file_is_read(s3_store: S3Store) -> None:
    """`Outbound.read_head` against the run's S3 store: the bytes asked for, or the whole of a smaller object."""
    data = secrets.token_bytes(3 * 2**20)
    uri = await s3_store.put(unique("big.gguf"), data)
    store = ArtifactStoreConfig(s3_endpoint=s3_store.endpoint, s3_region=s3_store.region, s3_tls_verify=False)
    async with Outbound(OciConfig(), store, registry_credentials=None, s3_credentials=s3_store.credentials) as out:
        assert await out.read_head(uri, 5000) == data[:5000]
        assert await out.read_head(uri, 2**30) == data
        with pytest.raises(ArtifactMissing, match="does not exist in the S3 store"):
            await out.read_head(s3_store.uri(unique("none.gguf")), 5000)
