"""What a node says about the epochs it accepted, judged before anything acts on it.

A node's hello and heartbeats report the highest (epoch, generation) it accepted. The leader
begins recovery on an epoch it cannot have signed (`Southbound._check_fence`) and, ending it, takes
an epoch above every node's (`control.operations.recovery`), so a claim taken on trust would let any node
put the controller into recovery, or push its epochs to the top of the range. A claim counts when:

- it is within what this controller issued: at most its epoch (the store's `meta.epoch`, or the
  lease's on PostgreSQL), as before; or
- it comes with its proof, the signed `AssignmentSet` the node accepted there (`proof_set`,
  `proof_signature`), which one of the controller's signing keys, current or retired, verifies,
  naming this node and exactly this (epoch, generation); or
- it is not above a claim of the same node proven before (a heartbeat after a proven hello).

Anything else is refused (`UnprovenEpoch`: counted by reason and by node, audited) and ignored:
the node's last trusted (epoch, generation) stands in for it. Epochs a controller signs never
pass `MAX_EPOCH` (`store.take_epoch`), so neither does any claim that counts. A follower judges
nothing (it acts on no claim; the leader's sets outrank what it last held).
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Callable, Mapping

import attrs

from nexa import security
from nexa.contracts import codec
from nexa.contracts.bounds import MAX_EPOCH
from nexa.contracts.wire import AssignmentSet, Heartbeat, Hello
from nexa.errors import NexaError, UnprovenEpoch
from nexa.security import PublicKey

_KIND = AssignmentSet.kind.encode("ascii")


def proof_problem(node_id: str, msg: Hello | Heartbeat, keys: Mapping[str, PublicKey]) -> str | None:
    """Why `msg`'s proof does not back its (epoch, generation), or None when one of `keys` signed
    a set at exactly that (epoch, generation) for `node_id`. Pure; never raises for a node's input."""
    if not msg.proof_set or not msg.proof_signature:
        return "without the signed set it accepted there (an agent that does not send it)"
    body = msg.proof_set.encode("utf-8")
    if not _signed_by_any(keys, msg.proof_signature, body):
        return "with a set no signing key of this controller signed"
    try:
        signed = codec.loads(codec.wire, body, AssignmentSet)
    except NexaError:
        return "with a signed set that does not parse"
    if signed.node_id != node_id:
        return f"with a set signed for node {signed.node_id[:64]!r}"
    if (signed.epoch, signed.generation) != (msg.epoch, msg.generation) or signed.epoch > MAX_EPOCH:
        return f"with a set signed at epoch {signed.epoch}, generation {signed.generation} (epochs end at {MAX_EPOCH})"
    return None


def _signed_by_any(keys: Mapping[str, PublicKey], signature_b64: str, body: bytes) -> bool:
    try:
        sig = base64.b64decode(signature_b64, validate=True)
    except (binascii.Error, ValueError):
        return False
    for key in keys.values():
        try:
            security.verify(key, sig, _KIND, body)
        except NexaError:
            continue
        return True
    return False


@attrs.define
class EpochClaims:
    """The leader's judge of nodes' epoch claims (module docstring)."""

    #: The highest epoch this controller issued (read at each use; it moves when a recovery ends).
    issued: Callable[[], int]
    #: The controller's signing keys, current and retired, by key id (read at each use).
    keys: Callable[[], Mapping[str, PublicKey]]
    #: Per node, the highest (epoch, generation) it proved, and the signature that proved it.
    _proven: dict[str, tuple[int, int, str]] = attrs.field(factory=dict)
    #: Per node, the last claim that counted.
    _trusted: dict[str, tuple[int, int]] = attrs.field(factory=dict)

    def judge(self, node_id: str, msg: Hello | Heartbeat) -> tuple[tuple[int, int], UnprovenEpoch | None]:
        """The (epoch, generation) to record for `node_id`: its claim when it counts (module
        docstring), else its last one that counted ((0, 0) before any) with the refusal to count."""
        claim = (msg.epoch, msg.generation)
        issued = self.issued()
        refusal = None
        if msg.epoch <= issued or (
            (proven := self._proven.get(node_id)) is not None
            and (claim <= proven[:2] and msg.proof_signature in ("", proven[2]))
        ):
            pass
        elif (why := proof_problem(node_id, msg, self.keys())) is not None:
            refusal = UnprovenEpoch(node_id=node_id, epoch=msg.epoch, issued=issued, why=why)
        elif proven is None or claim > proven[:2]:
            self._proven[node_id] = (*claim, msg.proof_signature)
        if refusal is not None:
            return self._trusted.get(node_id, (0, 0)), refusal
        self._trusted[node_id] = claim
        return claim, None
