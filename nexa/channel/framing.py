"""The node channel's frames: signed messages `[kind, body, signature]`, the unsigned data-path
frames `[kind, request_id, head, body]` (`wire.DATA_KINDS`) and the node's unsigned liveness beat
`[alive, node_id, state_seq]`, which CurveZMQ alone authenticates. A node joins the data messages
queued at once into one zmq message, its groups of four frames in order (`joins_data`,
`decode_data_batch`): several streams' frames cost the two ends one send and one receive. Signed
messages and liveness beats always travel alone. Pure: `nexa.channel.links` moves them over its
sockets.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Final, TypeVar

from nexa import security
from nexa.contracts import codec, wire
from nexa.errors import ContractError

T = TypeVar("T")
Frames = list[bytes]

#: Longest request id a data frame may carry (bytes of UTF-8).
MAX_REQUEST_ID_BYTES: Final = 128
#: Most data messages (groups of four frames) one zmq message may carry.
MAX_DATA_BATCH: Final = 256
_DATA_KINDS: Final = frozenset(kind.encode("ascii") for kind in wire.DATA_KINDS)
#: Longest node id a liveness beat may carry (bytes of UTF-8).
MAX_NODE_ID_BYTES: Final = 256
_LIVENESS_KIND: Final = wire.LIVENESS.encode("ascii")


# --- signed framing -----------------------------------------------------------------------------


def encode_frames(msg: wire.WireMessage, key: security.SigningKey) -> Frames:
    """`[kind, body, signature]`, the signature over exactly the bytes sent; the body leaves out
    fields at their defaults (`codec.wire_sent`), so an older peer reads what it knows."""
    kind = msg.kind.encode("ascii")
    body = codec.dumps(codec.wire_sent, msg).encode("utf-8")
    return [kind, body, security.sign(key, kind, body)]


def decode_frames(frames: Sequence[bytes], peer: security.PublicKey, accept: Mapping[str, type[T]]) -> T:
    """Verify, then parse. Raises ContractError (shape, kind, body) or BadSignature."""
    if len(frames) != 3:
        raise ContractError(f"a message is 3 frames (kind, body, signature), got {len(frames)}")
    kind, body, sig = frames
    cls = accept.get(kind.decode("ascii", "replace"))
    if cls is None:
        raise ContractError(f"unexpected message kind {kind[:32].decode('ascii', 'replace')!r}")
    # Unauthenticated bytes never reach the JSON parser or cattrs.
    security.verify(peer, sig, kind, body)
    return codec.loads(codec.wire, body, cls)


# --- data-path framing (unsigned: CurveZMQ authenticates the channel) ----------------------------


def encode_data(kind: str, request_id: str, head: bytes, body: bytes) -> Frames:
    """`[kind, request_id, head, body]`; raises ContractError for a kind or id that cannot be sent."""
    if kind not in wire.DATA_KINDS:
        raise ContractError(f"{kind!r} is not a data-path kind")
    rid = request_id.encode("utf-8")
    if not rid or len(rid) > MAX_REQUEST_ID_BYTES:
        raise ContractError(f"a request id is 1 to {MAX_REQUEST_ID_BYTES} bytes")
    return [kind.encode("ascii"), rid, head, body]


def decode_data(frames: Sequence[bytes], accept: frozenset[str]) -> wire.DataFrame:
    """Check the shape and the direction of a data frame; heads stay encoded. Raises ContractError."""
    if len(frames) != 4:
        raise ContractError(f"a data message is 4 frames (kind, request id, head, body), got {len(frames)}")
    kind_b, rid_b, head, body = frames
    kind = kind_b.decode("ascii", "replace")
    if kind not in accept:
        raise ContractError(f"unexpected data kind {kind[:32]!r}")
    try:
        request_id = rid_b.decode("utf-8")
    except UnicodeDecodeError:
        raise ContractError("a request id must be UTF-8") from None
    if not request_id or len(rid_b) > MAX_REQUEST_ID_BYTES:
        raise ContractError(f"a request id is 1 to {MAX_REQUEST_ID_BYTES} bytes")
    return wire.DataFrame(kind=kind, request_id=request_id, head=head, body=body)


def decode_data_batch(frames: Sequence[bytes], accept: frozenset[str]) -> list[wire.DataFrame]:
    """`decode_data` of each group of four frames of a data message, in order: one bad group
    refuses the whole message (ContractError)."""
    if len(frames) <= 4 or len(frames) % 4:
        return [decode_data(frames, accept)]
    if len(frames) > 4 * MAX_DATA_BATCH:
        raise ContractError(f"a data message carries at most {MAX_DATA_BATCH} frames of four, got {len(frames) // 4}")
    return [decode_data(frames[i : i + 4], accept) for i in range(0, len(frames), 4)]


def joins_data(joined: Sequence[bytes], frames: Sequence[bytes]) -> bool:
    """Whether the data message `frames` may travel in one zmq message after `joined` (a node's
    uplink: `ZmqPump`'s coalesce); signed messages never join."""
    return joined[0] in _DATA_KINDS and frames[0] in _DATA_KINDS


def is_data(kind: bytes) -> bool:
    return kind in _DATA_KINDS


# --- liveness (unsigned: CurveZMQ authenticates the channel; the node id must be the channel's) --


def encode_liveness(node_id: str, state_seq: int) -> Frames:
    """`[alive, node_id, state_seq]`: the seq as 8 bytes, big-endian."""
    return [_LIVENESS_KIND, node_id.encode("utf-8"), state_seq.to_bytes(8, "big")]


def decode_liveness(frames: Sequence[bytes]) -> wire.Liveness:
    """Check a liveness beat's shape (kind already known to be `alive`). Raises ContractError."""
    if len(frames) != 3:
        raise ContractError(f"a liveness message is 3 frames (kind, node id, state seq), got {len(frames)}")
    _, node_b, seq_b = frames
    node_id, state_seq = read_liveness(node_b, seq_b)
    return wire.Liveness(node_id=node_id, state_seq=state_seq)


def read_liveness(node_b: bytes, seq_b: bytes) -> tuple[str, int]:
    """A liveness beat's node id and state seq from its two frames, checked (no record built: the
    controller's hot path, `Link.take_alive`). Raises ContractError."""
    if not node_b or len(node_b) > MAX_NODE_ID_BYTES or len(seq_b) != 8:
        raise ContractError(f"a liveness message carries a node id of 1 to {MAX_NODE_ID_BYTES} bytes and 8 seq bytes")
    try:
        return node_b.decode("utf-8"), int.from_bytes(seq_b, "big")
    except UnicodeDecodeError:
        raise ContractError("a node id must be UTF-8") from None


def is_liveness(kind: bytes) -> bool:
    return kind == _LIVENESS_KIND
