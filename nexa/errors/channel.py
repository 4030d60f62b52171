"""Errors of the node channel: signed messages that are not accepted, and the link itself."""

from __future__ import annotations

from typing import Final

from nexa.errors.base import AuthError, NexaError


class BadSignature(AuthError):
    """A signature that does not verify. Says which kind of message, never the key or the bytes."""

    code = "bad_signature"

    def __init__(self, message: str, *, kind: str) -> None:
        super().__init__(message)
        self.kind = kind


class Replayed(AuthError):
    """A message whose sequence number is not above the last one accepted from that peer."""

    code = "replayed"

    def __init__(self, *, seq: int, last_seq: int) -> None:
        super().__init__(f"sequence number {seq} is not above the last accepted {last_seq}")
        self.seq = seq
        self.last_seq = last_seq


class ClockSkew(AuthError):
    """A message whose timestamp is further from our clock than the allowed skew."""

    code = "clock_skew"

    def __init__(self, *, skew_s: float, max_skew_s: float) -> None:
        super().__init__(f"timestamp is {skew_s:.3f} s from our clock (at most {max_skew_s:g} s allowed)")
        self.skew_s = skew_s
        self.max_skew_s = max_skew_s


class WrongNode(AuthError):
    """A message naming a node other than the one its channel's key belongs to."""

    code = "wrong_node"

    def __init__(self, *, channel_node: str, claimed_node: str) -> None:
        super().__init__(f"node {channel_node} sent a message naming node {claimed_node}")
        self.channel_node = channel_node
        self.claimed_node = claimed_node


class ControllerKeyMismatch(AuthError):
    """Enrollment: the answering controller's keys do not have the fingerprint the node was given
    (in the token, or by `--controller-fingerprint`). Nothing is saved."""

    code = "controller_key_mismatch"

    def __init__(self, *, expected: str, got: str) -> None:
        super().__init__(
            f"the controller answered with keys of fingerprint {got}, not the expected {expected}: "
            "refusing to enroll (wrong URL, or someone in between); nothing was saved"
        )
        self.expected = expected
        self.got = got


class NodeNeedsReenrollment(AuthError):
    """A node that pins only a controller key retired for good (it was offline through a rotation's
    overlap, `[nodes] key_overlap_s`): it cannot verify what the controller signs now, so its
    messages are refused and it is sent nothing until it is enrolled again."""

    code = "needs_reenrollment"

    def __init__(self, *, node_id: str, key_id: str) -> None:
        super().__init__(f"node {node_id} pins only the retired controller key {key_id}: {REENROLL_HINT}")
        self.node_id = node_id
        self.key_id = key_id


#: How an operator brings back a node that needs re-enrollment (`nexa nodes list` shows it).
REENROLL_HINT: Final = (
    "re-enroll: nexa tokens create, then on the node remove its state directory and run nexa node enroll"
    " (then nexa nodes revoke the old entry)"
)


class NodeRateLimited(AuthError):
    """A node's signed message above its channel's rate (`channel.signed_messages_per_s`): dropped unread."""

    code = "rate_limited"

    def __init__(self, *, node_id: str) -> None:
        super().__init__(f"node {node_id} sends signed messages faster than its channel allows")
        self.node_id = node_id


class UnprovenEpoch(AuthError):
    """A node's claimed (epoch, generation) above every epoch this controller issued, without a set
    one of its signing keys signed at it: the claim is ignored (counted, audited, shown on the node)."""

    code = "unproven_epoch"

    def __init__(self, *, node_id: str, epoch: int, issued: int, why: str) -> None:
        super().__init__(
            f"node {node_id} claims it accepted epoch {epoch}, above the highest this controller issued"
            f" ({issued}), {why}: the claim is ignored; if the node is not compromised, restart its agent"
            " (it then sends the signed set it accepted), else revoke it"
        )
        self.node_id = node_id
        self.epoch = epoch


class ChannelError(NexaError):
    code = "channel_error"


class ChannelClosed(ChannelError):
    code = "channel_closed"


class MessageTooLarge(ChannelError):
    """A node's message over the channel's limit; dropped, the connection kept (up to the transport's own bound)."""

    code = "message_too_large"

    def __init__(self, *, size: int, limit: int) -> None:
        super().__init__(f"a message of {size} bytes is over the channel's limit of {limit} bytes")


class NotConnected(ChannelError):
    code = "not_connected"
    retryable = True

    def __init__(self, *, node_id: str) -> None:
        super().__init__(f"node {node_id} has no open channel")
        self.node_id = node_id
