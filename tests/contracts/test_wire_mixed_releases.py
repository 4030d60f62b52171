"""A controller and nodes of neighbouring releases read each other's messages, whichever is upgraded
first (`contracts.wire`): a body leaves out every field at its default (`codec.wire_sent`), so a
peer whose records lack the fields added since decodes it with its own strict decoder, and one that
uses such a field is refused there, naming it. The "older peer" here is the record as an earlier
release declared it: the same class without the fields added since (each named with the release
feature that added it), decoded by `codec.wire`, which refuses unknown keys as every release did."""

from __future__ import annotations

import json
from typing import Any

import attrs
import pytest

from nexa import security
from nexa.channel.framing import decode_frames, encode_frames
from nexa.container_spec import spec_sha256
from nexa.contracts import codec, heads, wire
from nexa.contracts.node import RuntimeKind
from nexa.contracts.runtime import ArtifactRef, HealthProbe, LoraSpec, RuntimeSpec
from nexa.errors import ContractError

KEY = security.generate_signing_key()


def _earlier(cls: type[Any], without: set[str], **nested: type[Any]) -> type[Any]:
    """`cls` as an earlier release declared it: `without` those fields, `nested` fields of an
    earlier record type too. Frozen, keyword-only, the same defaults, no validators (the shape is
    what is tested)."""
    attrs.resolve_types(cls)
    fields = {
        a.name: attrs.field(type=nested.get(a.name, a.type), default=a.default)
        for a in attrs.fields(cls)
        if a.name not in without
    }
    assert len(fields) == len(attrs.fields(cls)) - len(without), "every dropped field exists"
    return attrs.make_class(f"Earlier{cls.__name__}", fields, frozen=True, kw_only=True)


def _hello(**changes: Any) -> wire.Hello:
    return wire.Hello(node_id="n1", seq=3, ts=1.7e9, agent_version="0.1.0", **changes)


#: `Hello` before the controller's key ids and epoch proofs (key rotation; fencing by proof).
EARLIER_HELLO = _earlier(wire.Hello, {"controller_key_id", "proof_set", "proof_signature"})


def _body(msg: wire.WireMessage) -> bytes:
    frames = encode_frames(msg, KEY)
    return frames[1]


def test_a_message_at_its_defaults_leaves_them_out_but_its_protocol() -> None:
    body = json.loads(_body(_hello()))
    assert set(body) == {"node_id", "seq", "ts", "agent_version", "protocol"}
    assert body["protocol"] == wire.PROTOCOL_VERSION  # ALWAYS_SENT: never the reader's own default
    # The full form (what an older sender writes) and the short one read as the same message.
    assert codec.loads(codec.wire, codec.dumps(codec.wire, _hello()), wire.Hello) == _hello()
    assert decode_frames(encode_frames(_hello(), KEY), KEY.public, {"hello": wire.Hello}) == _hello()


def test_an_earlier_controller_reads_a_new_nodes_hello_that_uses_nothing_new() -> None:
    got = codec.loads(codec.wire, _body(_hello(epoch=4, generation=9)), EARLIER_HELLO)
    assert (got.node_id, got.epoch, got.generation, got.protocol) == ("n1", 4, 9, wire.PROTOCOL_VERSION)


def test_a_field_the_earlier_peer_lacks_is_refused_there_naming_it() -> None:
    with pytest.raises(ContractError, match="controller_key_id"):
        codec.loads(codec.wire, _body(_hello(controller_key_id="0123456789abcdef")), EARLIER_HELLO)


def _spec(**changes: Any) -> RuntimeSpec:
    return RuntimeSpec(
        kind=RuntimeKind.LLAMACPP,
        image="ghcr.io/ggml-org/llama.cpp@sha256:" + "a" * 64,
        command=["--port", "8080"],
        port=8080,
        memory_bytes=2**30,
        cpus=2.0,
        health=HealthProbe(command=["true"]),
        **changes,
    )


#: `RuntimeSpec` before entrypoints, replica groups and LoRA adapters.
EARLIER_SPEC = _earlier(RuntimeSpec, {"entrypoint", "group", "loras"})


def test_an_earlier_node_reads_a_runtime_spec_that_uses_nothing_new() -> None:
    sent = codec.dumps(codec.wire_sent, _spec())
    assert not {"entrypoint", "group", "loras"} & set(json.loads(sent))
    got = codec.loads(codec.wire, sent, EARLIER_SPEC)
    assert (got.image, got.command, got.port) == (_spec().image, ["--port", "8080"], 8080)


def test_a_runtime_spec_with_an_adapter_is_refused_by_an_earlier_node_naming_it() -> None:
    lora = LoraSpec(name="poet", artifact=ArtifactRef(uri="s3://m/poet.gguf", sha256="b" * 64, size_bytes=10))
    with pytest.raises(ContractError, match="loras"):
        codec.loads(codec.wire, codec.dumps(codec.wire_sent, _spec(loras=[lora])), EARLIER_SPEC)


def test_what_is_hashed_keeps_its_bytes() -> None:
    """A replica's spec digest is taken over the full form, as before: an upgraded agent adopts the
    runtimes it runs instead of replacing them."""
    spec = _spec()
    full = json.loads(codec.dumps(codec.wire, spec))
    assert {"env", "gpus", "pids_limit", "shm_bytes", "stop_timeout_s", "host_network"} <= set(full)
    assert spec_sha256(spec) == spec_sha256(codec.loads(codec.wire, codec.dumps(codec.wire_sent, spec), RuntimeSpec))


#: `InferHead` before media uploads (`content_type`), LoRA adapters (`lora`) and stored responses'
#: own routes (`method`).
EARLIER_INFER = _earlier(wire.InferHead, {"content_type", "lora", "method"})


def _infer(**changes: Any) -> wire.InferHead:
    fields: dict[str, Any] = {"assignment_id": "r-1", "path": "/v1/chat/completions", "stream": False}
    return wire.InferHead(**(fields | {"deadline_at": 1.8e9, "window": 64} | changes))


def test_an_earlier_node_reads_an_infer_head_that_uses_nothing_new() -> None:
    # `content_type` equal to its default but not the same object: left out all the same.
    head = _infer(stream=True, content_type="application/" + "json", method=wire.RuntimeMethod("POST"))
    got = codec.loads(codec.wire, heads.encode(head), EARLIER_INFER)
    assert (got.assignment_id, got.path, got.stream, got.window) == ("r-1", "/v1/chat/completions", True, 64)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"lora": "poet"}, "lora"),  # a request for a LoRA adapter
        ({"path": "/v1/responses/resp_0123", "method": wire.RuntimeMethod.GET}, "method"),  # a retrieve
        ({"path": "/v1/audio/transcriptions", "content_type": "multipart/form-data; boundary=b"}, "content_type"),
    ],
)
def test_an_infer_head_using_a_new_field_is_refused_by_an_earlier_node_naming_it(
    changes: dict[str, Any], field: str
) -> None:
    with pytest.raises(ContractError, match=field):
        codec.loads(codec.wire, heads.encode(_infer(**changes)), EARLIER_INFER)
