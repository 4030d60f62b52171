"""The controller's side of the channel without a controller: its keys and an in-memory enrolment
table standing in for the registry (`Fleet`), the nodes it enrolls, and their first message."""

from __future__ import annotations

import time
from typing import Any

import attrs
import trio

from nexa import security
from nexa.channel import links
from nexa.contracts import wire

LOOPBACK = "tcp://127.0.0.1:*"


@attrs.frozen
class NodeIdentity:
    node_id: str
    curve: links.CurveKeyPair
    key: security.SigningKey


@attrs.define
class Fleet:
    """The controller's keys plus an in-memory enrolment table standing in for the registry."""

    curve: links.CurveKeyPair = attrs.field(factory=links.generate_curve_keypair)
    key: security.SigningKey = attrs.field(factory=security.generate_signing_key)
    by_curve: dict[str, str] = attrs.field(factory=dict)
    node_keys: dict[str, security.PublicKey] = attrs.field(factory=dict)
    zap_calls: list[str] = attrs.field(factory=list)
    zap_events: dict[str, trio.Event] = attrs.field(factory=dict)

    def authorize(self, curve_public: str) -> str | None:
        self.zap_calls.append(curve_public)
        self.zap_event(curve_public).set()
        return self.by_curve.get(curve_public)

    def zap_event(self, curve_public: str) -> trio.Event:
        return self.zap_events.setdefault(curve_public, trio.Event())

    def enroll(self, node_id: str) -> NodeIdentity:
        node = NodeIdentity(node_id, links.generate_curve_keypair(), security.generate_signing_key())
        self.by_curve[node.curve.public] = node_id
        self.node_keys[node_id] = node.key.public
        return node

    def stranger(self, node_id: str) -> NodeIdentity:
        """Keys the controller has never seen."""
        return NodeIdentity(node_id, links.generate_curve_keypair(), security.generate_signing_key())

    def link(self, endpoint: str = LOOPBACK, **kw: Any) -> links.Link:
        return links.Link(
            endpoint,
            curve=self.curve,
            signing_key=self.key,
            authorize=self.authorize,
            node_key=self.node_keys.get,
            **kw,
        )

    def uplink(self, endpoint: str, node: NodeIdentity, **kw: Any) -> links.Uplink:
        kw.setdefault("controller_key", self.key.public)
        kw.setdefault("server_curve_public", self.curve.public)
        return links.Uplink(
            endpoint,
            curve=node.curve,
            signing_key=node.key,
            reconnect_ivl_s=0.05,
            reconnect_ivl_max_s=0.2,
            **kw,
        )


def hello(node_id: str, seq: int = 0) -> wire.Hello:
    return wire.Hello(node_id=node_id, seq=seq, ts=time.time(), agent_version="test")
