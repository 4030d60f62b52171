"""Image platforms (issue 14, point 4): the controller reads an image's index or manifest from the OCI
registry, records its platforms on the runtime, and placement filters nodes whose architecture the
image lacks. A two-platform index is pushed to the REAL registry (Debian `docker-registry`); the
registry faults that server cannot produce (a redirect to blob storage, bytes with another digest,
oversized or malformed documents) use httpx.MockTransport.
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from nexa.cli.tables import print_image_configs
from nexa.config import ArtifactStoreConfig, OciConfig
from nexa.contracts import codec
from nexa.contracts.domain import NodeState
from nexa.contracts.models import ImagePlatform, RuntimeRecord
from nexa.contracts.node import RuntimeKind
from nexa.contracts.placement import PlacementNode, PlacementRequest
from nexa.control.deployments.scheduler import image_platform_warnings, place
from nexa.control.registry.outbound import Outbound
from nexa.errors import DigestUnknown, ManifestInvalid
from nexa.oci import (
    DOCKER_LIST,
    DOCKER_MANIFEST,
    MAX_MANIFEST_BYTES,
    OCI_INDEX,
    OCI_MANIFEST,
    normalise_arch,
    parse_config_platform,
    parse_image_config,
    parse_manifest,
)
from tests.conftest import Controller
from tests.realparts import OciRegistry
from tests.support.api import ok
from tests.support.oci import config_blob, index_of, manifest_for, push_index, sha

Json = dict[str, Any]
GIB = 1024**3


# --- pure parsing ---------------------------------------------------------------------------------


@pytest.mark.parametrize("media_type", [OCI_INDEX, DOCKER_LIST])
def test_an_index_names_its_platforms_without_attestations(media_type: str) -> None:
    body = index_of(
        [
            (b"a", {"os": "linux", "architecture": "amd64"}),
            (b"b", {"os": "linux", "architecture": "arm64", "variant": "v8"}),
            (b"c", {"os": "unknown", "architecture": "unknown"}),  # buildx attestation
            (b"d", {"os": "linux", "architecture": "amd64"}),  # a duplicate
        ],
        media_type,
    )
    parsed = parse_manifest(body, "", image="x")
    assert (parsed.media_type, parsed.config_digest) == (media_type, None)
    assert [str(p) for p in parsed.platforms] == ["linux/amd64", "linux/arm64/v8"]


@pytest.mark.parametrize("media_type", [OCI_MANIFEST, DOCKER_MANIFEST])
def test_a_single_manifest_points_at_its_config(media_type: str) -> None:
    config = config_blob("aarch64")
    parsed = parse_manifest(manifest_for(config, media_type), "", image="x")
    assert (parsed.platforms, parsed.config_digest) == ([], sha(config))
    # The kernel's name is mapped to the container world's.
    assert parse_config_platform(config, image="x") == ImagePlatform(os="linux", architecture="arm64")


def test_arch_names_map_like_uname_to_oci() -> None:
    assert [normalise_arch(a) for a in ("x86_64", "aarch64", "ARM64", "amd64", "riscv64")] == [
        "amd64",
        "arm64",
        "arm64",
        "amd64",
        "riscv64",
    ]


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[]",
        json.dumps({"schemaVersion": 2, "mediaType": OCI_INDEX, "manifests": "x"}).encode(),
        json.dumps({"schemaVersion": 2, "mediaType": OCI_MANIFEST, "config": {"digest": "md5:1"}}).encode(),
        json.dumps({"schemaVersion": 1, "mediaType": "application/vnd.docker.distribution.manifest.v1+json"}).encode(),
        index_of([(b"a", {"os": "linux"})]),
        index_of([(b"a", {"os": "linux", "architecture": "amd 64"})]),
        index_of([(b"a", {"os": "linux", "architecture": "arm", "variant": 7})]),
    ],
)
def test_malformed_documents_are_manifest_invalid(body: bytes) -> None:
    with pytest.raises(ManifestInvalid):
        parse_manifest(body, OCI_INDEX, image="x")


def test_an_index_entry_without_a_digest_is_manifest_invalid() -> None:
    """Its config cannot be read (what runs there is unknown): the index is refused, not half recorded."""
    body = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": OCI_INDEX,
            "manifests": [{"platform": {"os": "linux", "architecture": "amd64"}}],
        }
    ).encode()
    with pytest.raises(ManifestInvalid, match="without a sha256 digest"):
        parse_manifest(body, "", image="x")


def test_a_config_without_a_platform_is_manifest_invalid() -> None:
    with pytest.raises(ManifestInvalid):
        parse_config_platform(json.dumps({"rootfs": {}}).encode(), image="x")


@pytest.mark.parametrize(
    "run",
    [
        {"Entrypoint": "/app/llama-server"},
        {"Cmd": [1]},
        {"User": 0},
        {"ExposedPorts": ["8080/tcp"]},
        {"Env": ["A\x00"]},
    ],
)
def test_an_image_config_with_a_field_of_the_wrong_shape_is_manifest_invalid(run: Json) -> None:
    body = json.dumps({"os": "linux", "architecture": "amd64", "config": run}).encode()
    with pytest.raises(ManifestInvalid):
        parse_image_config(body, image="x")


def test_old_runtime_records_load_with_unknown_platforms_and_filter_nothing() -> None:
    old = {
        "name": "vllm",
        "kind": "vllm",
        "version": "1",
        "image": f"r.example/v@sha256:{'1' * 64}",
        "media_type": OCI_INDEX,
        "registered_at": 1.0,
        "registered_by": None,
        "host_network": False,
    }
    record = codec.loads(codec.store, json.dumps(old), RuntimeRecord)
    assert record.platforms == []
    assert record.image_archs is None
    assert record.image_configs == [] and record.image_config("amd64") is None


def test_sim_runtimes_run_as_processes_and_are_never_filtered_by_their_placeholder_image() -> None:
    record = RuntimeRecord(
        name="sim",
        kind=RuntimeKind.SIM,
        version="1",
        image=f"r.example/v@sha256:{'1' * 64}",
        media_type=OCI_MANIFEST,
        registered_at=1.0,
        registered_by=None,
        platforms=[ImagePlatform(os="linux", architecture="amd64")],
    )
    assert record.image_archs is None


# --- placement ------------------------------------------------------------------------------------


def fleet() -> list[PlacementNode]:
    def node(node_id: str, arch: str) -> PlacementNode:
        return PlacementNode(
            id=node_id,
            state=NodeState.READY,
            arch=arch,
            runtimes=(RuntimeKind.VLLM,),
            host_memory_total_bytes=64 * GIB,
            host_memory_free_bytes=64 * GIB,
        )

    return [node("spark-1", "arm64"), node("spark-2", "aarch64"), node("x86-1", "amd64")]


def request(image_archs: tuple[str, ...] | None, **over: Any) -> PlacementRequest:
    return PlacementRequest(deployment="d", runtime=RuntimeKind.VLLM, memory_bytes=GIB, image_archs=image_archs, **over)


def arch_verdicts(image_archs: tuple[str, ...] | None, **over: Any) -> dict[str, str]:
    decision = place(fleet(), request(image_archs, **over))
    return {
        e.node_id: next(f.detail for f in e.filters if f.name == "architecture") or "ok" for e in decision.explanations
    }


def test_nodes_whose_architecture_the_image_lacks_are_filtered_with_the_reason() -> None:
    assert arch_verdicts(("amd64",)) == {
        "spark-1": "image has no linux/arm64 variant",
        "spark-2": "image has no linux/arm64 variant",  # aarch64 is arm64
        "x86-1": "ok",
    }
    decision = place(fleet()[:2], request(("amd64",)))  # the Sparks only
    assert not decision.feasible
    assert "image has no linux/arm64 variant" in (decision.reason or "")


def test_unknown_platforms_filter_nothing_and_both_archs_fit_all() -> None:
    assert set(arch_verdicts(None).values()) == {"ok"}
    assert set(arch_verdicts(("amd64", "arm64")).values()) == {"ok"}


def test_an_image_with_no_linux_platform_fits_no_node() -> None:
    assert arch_verdicts(()) == {
        "spark-1": "image has no linux/arm64 variant",
        "spark-2": "image has no linux/arm64 variant",
        "x86-1": "image has no linux/amd64 variant",
    }


def test_an_explicit_arch_request_is_judged_first() -> None:
    assert arch_verdicts(("amd64",), arch="amd64")["spark-1"] == "needs amd64, node is arm64"


def test_registration_warns_only_when_no_enrolled_node_can_run_the_image() -> None:
    [warning] = image_platform_warnings(("amd64",), ["arm64", "aarch64"])
    assert "no enrolled node can run this image" in warning
    assert "image has no linux/arm64 variant" in warning
    assert image_platform_warnings(("amd64",), ["arm64", "x86_64"]) == []
    assert image_platform_warnings(None, ["arm64"]) == []  # platforms unknown
    assert image_platform_warnings(("amd64",), ["", ""]) == []  # no node has reported yet


# --- registry faults (MockTransport) -----------------------------------------------------------------


def outbound(handler: Any) -> Outbound:
    return Outbound(
        OciConfig(),
        ArtifactStoreConfig(),
        registry_credentials=None,
        s3_credentials=None,
        transport=httpx.MockTransport(handler),
    )


async def test_a_single_manifest_reads_its_config_through_a_storage_redirect() -> None:
    config = config_blob("arm64", "v8")
    manifest = manifest_for(config)
    image = f"registry.example.com/team/app@{sha(manifest)}"
    seen: list[str] = []

    def handler(req: httpx.Request) -> httpx.Response:
        seen.append(f"{req.method} {req.url.host}{req.url.path}")
        if req.url.path.endswith(f"/manifests/{sha(manifest)}"):
            return httpx.Response(200, headers={"Content-Type": OCI_MANIFEST}, content=manifest)
        if req.url.path.endswith(f"/blobs/{sha(config)}"):
            return httpx.Response(307, headers={"Location": "https://storage.example.com/blob"})
        assert req.url.host == "storage.example.com"
        return httpx.Response(200, content=config)

    async with outbound(handler) as out:
        check = await out.check_image(image)
    assert [str(p) for p in check.platforms] == ["linux/arm64/v8"]
    assert seen[-1] == "GET storage.example.com/blob"


async def test_bytes_that_do_not_hash_to_the_digest_are_refused() -> None:
    body = index_of([(b"a", {"os": "linux", "architecture": "amd64"})])
    image = f"registry.example.com/team/app@{sha(b'something else')}"

    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"Content-Type": OCI_INDEX}, content=body)

    async with outbound(handler) as out:
        with pytest.raises(ManifestInvalid, match="another digest"):
            await out.check_image(image)


async def test_an_oversized_manifest_is_cut_off() -> None:
    body = b" " * (MAX_MANIFEST_BYTES + 1)
    image = f"registry.example.com/team/app@{sha(body)}"

    def handler(req: httpx.Request) -> httpx.Response:
        return httpx.Response(200, headers={"Content-Type": OCI_INDEX}, content=body)

    async with outbound(handler) as out:
        with pytest.raises(ManifestInvalid, match="more than"):
            await out.check_image(image)


async def test_a_config_the_registry_lacks_is_digest_unknown() -> None:
    manifest = manifest_for(config_blob("amd64"))
    image = f"registry.example.com/team/app@{sha(manifest)}"

    def handler(req: httpx.Request) -> httpx.Response:
        if "/manifests/" in req.url.path:
            return httpx.Response(200, headers={"Content-Type": OCI_MANIFEST}, content=manifest)
        return httpx.Response(404)

    async with outbound(handler) as out:
        with pytest.raises(DigestUnknown, match="config blob"):
            await out.check_image(image)


# --- the real registry ----------------------------------------------------------------------------------


def push(registry: OciRegistry, repository: str, platforms: list[Json]) -> str:
    """Push one empty-layered manifest per platform and an OCI index over them; `host/repo@digest`."""
    return push_index(registry.host, repository, platforms)


def push_single(registry: OciRegistry, repository: str, config: bytes) -> str:
    """Push one single-platform manifest (its config names the platform); `host/repo@digest`."""
    manifest = manifest_for(config)
    with httpx.Client(base_url=registry.url, timeout=30, trust_env=False) as http:
        started = http.post(f"/v2/{repository}/blobs/uploads/")
        location = httpx.URL(started.headers["Location"]).copy_merge_params({"digest": sha(config)})
        assert http.put(location, content=config).status_code == 201
        put = http.put(f"/v2/{repository}/manifests/v1", content=manifest, headers={"Content-Type": OCI_MANIFEST})
        assert put.status_code == 201, put.text
    return f"{registry.host}/{repository}@{sha(manifest)}"


async def test_a_two_platform_index_in_the_real_registry_is_recorded_and_filters_placement(
    reg: Controller, oci_registry: OciRegistry
) -> None:
    image = push(
        oci_registry,
        "nexa-test/two-platforms",
        [{"os": "linux", "architecture": "amd64"}, {"os": "linux", "architecture": "s390x"}],
    )
    body = {"name": "x86-only", "kind": "vllm", "version": "1", "image": image}
    async with reg.client() as http:
        answer = await ok(http.post("/api/v1/runtimes", json=body), 201)
        assert answer["media_type"] == OCI_INDEX
        assert answer["platforms"] == [
            {"os": "linux", "architecture": "amd64", "variant": ""},
            {"os": "linux", "architecture": "s390x", "variant": ""},
        ]
        assert answer["warnings"] == []  # no node has enrolled yet: nothing to compare with
        stored = await ok(http.get("/api/v1/runtimes/x86-only"))
    assert {k: v for k, v in answer.items() if k != "warnings"} == stored
    record = codec.loads(codec.api, json.dumps(stored), RuntimeRecord)
    assert record.image_archs == ("amd64", "s390x")
    # Each platform's config was read from its own manifest (by the digest the index names).
    assert [str(c.platform) for c in record.image_configs] == ["linux/amd64", "linux/s390x"]
    assert record.image_config("s390x") == record.image_configs[1]
    # What the deployments module asks placement for this runtime: the arm64 node is filtered.
    assert arch_verdicts(record.image_archs)["spark-1"] == "image has no linux/arm64 variant"
    assert arch_verdicts(record.image_archs)["x86-1"] == "ok"


LLAMA_CONFIG = {
    "architecture": "arm64",
    "os": "linux",
    "config": {
        "Entrypoint": ["/app/llama-server"],
        "Cmd": ["--help"],
        "User": "1000:1000",
        "Env": ["PATH=/usr/bin:/bin", "LLAMA_ARG_HOST=0.0.0.0"],
        "WorkingDir": "/app",
        "ExposedPorts": {"8080/tcp": {}},
    },
    "rootfs": {"type": "layers", "diff_ids": []},
}


async def test_registration_keeps_the_image_config_and_runtimes_show_prints_what_runs(
    reg: Controller, oci_registry: OciRegistry, capsys: pytest.CaptureFixture[str]
) -> None:
    image = push_single(oci_registry, "nexa-test/llama-config", json.dumps(LLAMA_CONFIG).encode())
    body = {"name": "llama", "kind": "llamacpp", "version": "1", "image": image}
    async with reg.client() as http:
        answer = await ok(http.post("/api/v1/runtimes", json=body), 201)
        stored = await ok(http.get("/api/v1/runtimes/llama"))
    assert (
        answer["image_configs"]
        == stored["image_configs"]
        == [
            {
                "platform": {"os": "linux", "architecture": "arm64", "variant": ""},
                "entrypoint": ["/app/llama-server"],
                "cmd": ["--help"],
                "user": "1000:1000",
                "env": ["PATH=/usr/bin:/bin", "LLAMA_ARG_HOST=0.0.0.0"],
                "working_dir": "/app",
                "exposed_ports": ["8080/tcp"],
            }
        ]
    )
    record = codec.loads(codec.api, json.dumps(stored), RuntimeRecord)
    assert record.image_config("arm64") == record.image_config(None) == record.image_configs[0]
    print_image_configs(record)
    out = capsys.readouterr().out
    assert "linux/arm64: entrypoint /app/llama-server; cmd --help; user 1000:1000; workdir /app; ports 8080/tcp" in out
    # The default variant's bare `llama-server` is the image's /app/llama-server; the other's python3 is set.
    assert "runs (llama-server): /app/llama-server …" in out
    assert "runs (llama-cpp-python): python3 -m llama_cpp.server …" in out


async def test_a_single_platform_image_in_the_real_registry_records_its_config_platform(
    reg: Controller, oci_registry: OciRegistry
) -> None:
    image = push_single(oci_registry, "nexa-test/single-arm64", config_blob("arm64", "v8"))
    async with reg.client() as http:
        answer = await ok(
            http.post("/api/v1/runtimes", json={"name": "arm", "kind": "vllm", "version": "1", "image": image}), 201
        )
    assert answer["platforms"] == [{"os": "linux", "architecture": "arm64", "variant": "v8"}]
