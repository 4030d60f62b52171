"""The fleet: enrollment tokens, enrolled nodes, their liveness and desired assignment sets.

Authoritative in memory (the node channel asks it on every message), written through to the store. Operator
actions and liveness transitions are audited; heartbeats are written only when a node's inventory changes.

A node is reachable while two things hold: something good came from it within `lease_s` (a signed
message or a liveness beat, `alive`), and its state (the signed `Heartbeat`) is current: it came
within the state interval the node announced plus `lease_s` (`state_current`). A liveness beat
changes nothing the node reports and never makes a node reachable whose state is not current: the
control loop then asks the node for its state (`Southbound`), and that state makes it reachable."""

from __future__ import annotations

import hashlib
import logging
import re
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Final

import attrs
import trio

from nexa.channel.links import check_curve_key
from nexa.config import NodesConfig
from nexa.contracts import codec
from nexa.contracts.api import EnrollmentTokenCreate, EnrollRequest
from nexa.contracts.domain import (
    NAME_RE,
    SYSTEM,
    Actor,
    AuditResult,
    EnrollmentToken,
    Node,
    NodeAdminState,
    NodeId,
    NodeState,
)
from nexa.contracts.node import NodeInventory, label_key_problem, label_value_problem, steady_inventory
from nexa.contracts.wire import (
    MEMORY_PRESSURE,
    Ack,
    AssignmentStatus,
    DesiredAssignments,
    Heartbeat,
    Hello,
    MemoryPressure,
    NodeMessage,
    RotateKeys,
    RuntimeLoad,
    RuntimeState,
)
from nexa.control import store as st
from nexa.control.access.accounts import audit_draft
from nexa.control.cluster.leadership import Leadership
from nexa.control.fleet.live import NodeLive
from nexa.errors import REENROLL_HINT, Conflict, ContractError, NodeUnreachable, NotConnected, NotFound
from nexa.ratelimit import RateLimiter
from nexa.security import (
    TOKEN_PIN_SEPARATOR,
    PublicKey,
    ReplayWindow,
    hash_token,
    is_enrollment_token,
    new_enrollment_token,
)
from nexa.telemetry import Metrics
from nexa.telemetry.fleet import NodeFigures, ReplicaFigures, ReplicaMemoryFigures

#: `NodeLive` lives in `fleet.live` and is imported from here as before.
__all__ = ["Fleet", "NodeLive"]

log = logging.getLogger(__name__)

_MIN_TOKEN_TTL_S: Final = 10.0
_NODE_ID_RE: Final = re.compile(r"[^a-z0-9.-]+")


#: Operator action → (admin states it may start from, the state it leads to).
_ACTIONS: Final[dict[str, tuple[frozenset[NodeAdminState], NodeAdminState]]] = {
    "cordon": (frozenset({NodeAdminState.ACTIVE, NodeAdminState.CORDONED}), NodeAdminState.CORDONED),
    "uncordon": (
        frozenset({NodeAdminState.ACTIVE, NodeAdminState.CORDONED, NodeAdminState.DRAINING}),
        NodeAdminState.ACTIVE,
    ),
    "drain": (
        frozenset({NodeAdminState.ACTIVE, NodeAdminState.CORDONED, NodeAdminState.DRAINING}),
        NodeAdminState.DRAINING,
    ),
    "revoke": (
        frozenset({NodeAdminState.ACTIVE, NodeAdminState.CORDONED, NodeAdminState.DRAINING}),
        NodeAdminState.REVOKED,
    ),
}


class Fleet:
    def __init__(
        self, cfg: NodesConfig, store: st.Store, metrics: Metrics, *, leadership: Leadership | None = None
    ) -> None:
        self._cfg = cfg
        self._store = store
        self._metrics = metrics
        #: Desired sets are leader-only writes (`Leadership.write`): a follower's or a deposed
        #: leader's copy of a set must never overwrite the leader's. None: the only controller.
        self._leadership = leadership or Leadership.solo(store)
        self._nodes: dict[NodeId, NodeLive] = {}
        self._by_curve: dict[str, NodeId] = {}
        self._lock = trio.Lock()  # serialises enrollment and admin-state changes
        #: Set once the node channel is bound; handed to nodes at enrollment.
        self.channel_endpoint = ""
        self._listeners: list[Callable[[], None]] = []
        self._measured_hooks: list[Callable[[NodeLive, dict[str, int]], Awaitable[None]]] = []
        #: One up whenever what routing reads of a node changes: its state (admin, reachability)
        #: or which of its replicas are Ready. The gateway's serving sets are cached against it.
        self.version = 0
        # Store writes that node messages cause, per node (`limit_writes`); None: unlimited.
        self._writes: RateLimiter | None = None
        # Curve keys nodes rotated away from (for the ZAP refusal's audit reason; this run only).
        self._retired_curve: dict[str, NodeId] = {}
        # Southbound's "ask this node to rotate its keys" (`on_rotation_request`).
        self._ask_rotation: Callable[[str], Awaitable[None]] | None = None

    def limit_writes(self, limiter: RateLimiter) -> None:
        """Bound the store writes each node's messages cause (inventory saves, acknowledgements).

        Above the rate the newest state stays in memory (placement and the API see it at once)
        and is written with a later message of that node; each deferral is counted.
        """
        self._writes = limiter

    def _may_write(self, live: NodeLive, kind: str) -> bool:
        if not self._leadership.is_leader:
            # A follower keeps what nodes report in memory (its gateway routes by it); the leader
            # hears the same heartbeats and is the one that writes them (DESIGN §5).
            return False
        if self._writes is None or self._writes.allow(live.node.id, trio.current_time()):
            return True
        self._metrics.node_store_writes_deferred.labels(kind).inc()
        return False

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call `listener` (sync, must not block) after a node's state changes: admin action or reachability."""
        self._listeners.append(listener)

    def on_measured(self, hook: Callable[[NodeLive, dict[str, int]], Awaitable[None]]) -> None:
        """Await `hook(node, measured bytes by assignment id)` when a node's measured replicas change."""
        self._measured_hooks.append(hook)

    def _changed(self) -> None:
        self.version += 1
        for listener in self._listeners:
            listener()

    async def load(self) -> None:
        for node, inventory, desired in await self._store.run(st.load_nodes):
            self._add(node, inventory, desired or DesiredAssignments(node_id=node.id, generation=1))
        for node_id, (signing, curve) in (await self._store.run(st.load_previous_keys)).items():
            live = self._nodes.get(NodeId(node_id))
            if live is not None and live.node.admin_state is not NodeAdminState.REVOKED:
                live.previous_keys = (PublicKey.from_b64(signing), curve)
                self._by_curve[curve] = live.node.id
        for node_id, key_id in (await self._store.run(st.load_reenrollment)).items():
            self._nodes[NodeId(node_id)].reenroll_key_id = key_id

    async def refresh(self) -> None:
        """Re-read the node records another controller on the store changed (`follow.ChangeFeed`):
        enrollments, admin states, rotated keys, re-enrollment marks, desired sets. What this
        controller hears from each node itself (liveness, statuses, loads, an inventory once the
        node reported one here) stays. Under the lock enrollment, admin actions and key rotations
        take; a desired set is taken when it is newer, or on a follower (the leader writes them)."""
        async with self._lock:
            rows = await self._store.read(st.load_nodes)
            previous = await self._store.read(st.load_previous_keys)
            reenroll = await self._store.read(st.load_reenrollment)
            changed = False
            for node, inventory, stored in rows:
                desired = stored or DesiredAssignments(node_id=node.id, generation=1)
                live = self._nodes.get(node.id)
                if live is None:
                    live = self._add(node, inventory, desired)
                    changed = True
                elif node != live.node:
                    self._rekeyed(live, node)
                    changed = True
                if desired.generation > live.desired.generation or (
                    not self._leadership.is_leader and desired != live.desired
                ):
                    live.desired = desired
                if live.last_seen is None and inventory != live.inventory:
                    live.inventory, live.inventory_digest = inventory, _static_digest(inventory)
                changed |= self._previous_from_store(live, previous.get(node.id))
                mark = reenroll.get(node.id, "")
                if mark and not live.reenroll_key_id:
                    live.reenroll_key_id, live.reachable = mark, False
                    changed = True
            if changed:
                self.version += 1
                self._changed()

    def _rekeyed(self, live: NodeLive, node: Node) -> None:
        """`live`'s record changed elsewhere (admin state, keys): ZAP and signature checks follow it."""
        before = live.node
        live.node = node
        if before.curve_public_key != node.curve_public_key and self._by_curve.get(before.curve_public_key) == node.id:
            del self._by_curve[before.curve_public_key]
        if before.signing_public_key != node.signing_public_key:
            live.signing_key = None  # parsed again at its next message
        if node.admin_state is NodeAdminState.REVOKED:
            self._by_curve.pop(node.curve_public_key, None)
            if live.previous_keys is not None:
                self._by_curve.pop(live.previous_keys[1], None)
            live.reachable = False
        else:
            self._by_curve[node.curve_public_key] = node.id

    def _previous_from_store(self, live: NodeLive, stored: tuple[str, str] | None) -> bool:
        """Keys a node rotated away from, as the store holds them; True when they changed here."""
        held = (live.previous_keys[0].b64, live.previous_keys[1]) if live.previous_keys is not None else None
        if stored == held or live.node.admin_state is NodeAdminState.REVOKED:
            return False
        if held is not None and self._by_curve.get(held[1]) == live.node.id:
            del self._by_curve[held[1]]
            self._retired_curve[held[1]] = live.node.id
        live.previous_keys = None
        if stored is not None:
            live.previous_keys = (PublicKey.from_b64(stored[0]), stored[1])
            self._by_curve[stored[1]] = live.node.id
        return True

    def _add(self, node: Node, inventory: NodeInventory | None, desired: DesiredAssignments) -> NodeLive:
        live = NodeLive(
            node=node,
            inventory=inventory,
            desired=desired,
            window=ReplayWindow(max_skew_s=self._cfg.max_clock_skew_s),
            inventory_digest=_static_digest(inventory),
        )
        self._nodes[node.id] = live
        self.version += 1
        if node.admin_state is not NodeAdminState.REVOKED:
            self._by_curve[node.curve_public_key] = node.id
        return live

    # ---- queries ---------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[NodeLive]:
        return iter(sorted(self._nodes.values(), key=lambda n: n.node.id))

    def get(self, node_id: str) -> NodeLive:
        live = self._nodes.get(NodeId(node_id))
        if live is None:
            raise NotFound(f"no node {node_id}")
        return live

    def count_channel(self, node_id: str, what: str) -> None:
        """One more refusal (by reason) or `disconnected` on a node's channel; nothing for an unknown node."""
        live = self._nodes.get(NodeId(node_id))
        if live is not None:
            live.channel[what] = live.channel.get(what, 0) + 1

    def replica_load(self, node_id: str, replica_id: str) -> tuple[RuntimeLoad, float] | None:
        """The load `replica_id`'s runtime reported through its node, and how many seconds old its
        figures are now; None when the node is unknown, unreachable, or sent none for it."""
        live = self._nodes.get(NodeId(node_id))
        if live is None or not live.reachable:
            return None
        got = live.loads.get(replica_id)
        if got is None:
            return None
        load, read_at = got
        return load, max(0.0, trio.current_time() - read_at)

    def figures(self) -> list[NodeFigures]:
        """What `/metrics` exports of the fleet now (`nexa.telemetry.fleet`): every node heard from
        since the controller started and not revoked; live figures (inventory, cache disk, the
        replicas' loads, each under its assignment's deployment) only from reachable nodes."""
        now = trio.current_time()
        out = []
        for live in self._nodes.values():
            if live.last_seen is None or live.node.admin_state is NodeAdminState.REVOKED:
                continue
            age = max(0.0, now - live.last_seen)
            if live.state is NodeState.UNREACHABLE:
                out.append(NodeFigures(node=live.node.id, heartbeat_age_s=age))
                continue
            replicas = tuple(
                ReplicaFigures(deployment=a.deployment, replica=a.id, load=got[0], age_s=max(0.0, now - got[1]))
                for a in live.desired.assignments
                if (got := live.loads.get(a.id)) is not None
            )
            measured = {s.assignment_id: s.memory for s in live.statuses if s.memory is not None}
            memory = tuple(
                ReplicaMemoryFigures(deployment=a.deployment, replica=a.id, memory=m)
                for a in live.desired.assignments
                if (m := measured.get(a.id)) is not None
            )
            out.append(
                NodeFigures(
                    node=live.node.id,
                    heartbeat_age_s=age,
                    inventory=live.inventory,
                    cache_disk=live.cache_disk,
                    replicas=replicas,
                    memory_pressure=live.memory_pressure,
                    memory_pressure_stops=live.memory_pressure_stops,
                    replica_memory=memory,
                )
            )
        return out

    def authorize_curve(self, curve_public_z85: str) -> str | None:
        """ZAP: the node id for an enrolled, non-revoked Curve key; None refuses the channel."""
        return self._by_curve.get(curve_public_z85)

    def node_key(self, node_id: str) -> PublicKey | None:
        """The Ed25519 key that must have signed a node's messages; None once it is revoked."""
        live = self._nodes.get(NodeId(node_id))
        if live is None or live.node.admin_state is NodeAdminState.REVOKED:
            return None
        if live.signing_key is None:  # parsed once per node, not per message
            live.signing_key = PublicKey.from_b64(live.node.signing_public_key)
        return live.signing_key

    def previous_node_key(self, node_id: str) -> PublicKey | None:
        """The signing key a node had before it rotated, while it is still accepted (`Link`)."""
        live = self._nodes.get(NodeId(node_id))
        if live is None or live.previous_keys is None or live.node.admin_state is NodeAdminState.REVOKED:
            return None
        return live.previous_keys[0]

    def retired_node_with_curve(self, curve_public_z85: str) -> str | None:
        """The node that used this Curve key before it rotated its keys (this run only)."""
        return self._retired_curve.get(curve_public_z85)

    def revoked_node_with_curve(self, curve_public_z85: str) -> str | None:
        for live in self._nodes.values():
            if live.node.curve_public_key == curve_public_z85 and live.node.admin_state is NodeAdminState.REVOKED:
                return live.node.id
        return None

    def counts(self) -> dict[NodeState, int]:
        counts = dict.fromkeys(NodeState, 0)
        for live in self._nodes.values():
            counts[live.state] += 1
        return counts

    def refresh_gauges(self) -> None:
        """Set `nexa_nodes` (enrolled nodes by state) from the fleet as it is now: at each scrape of
        `/metrics`, on the loop. Counting walks every node, so it is done when read, not at each
        change (with 1,000 nodes a storm of reachability changes made that quadratic)."""
        for state, count in self.counts().items():
            self._metrics.nodes.labels(state.value).set(count)

    # ---- enrollment ------------------------------------------------------------------------------

    async def create_token(self, actor: Actor, req: EnrollmentTokenCreate) -> tuple[str, EnrollmentToken]:
        problems = [
            f"labels[{k!r}]: {p}"
            for k, v in req.labels.items()
            for p in (label_key_problem(k), label_value_problem(v))
            if p is not None
        ]
        if not _MIN_TOKEN_TTL_S <= req.ttl_s <= self._cfg.max_token_ttl_s:
            problems.append(f"ttl_s: must be from {_MIN_TOKEN_TTL_S:g} to {self._cfg.max_token_ttl_s:g} seconds")
        if problems:
            raise ContractError("invalid enrollment token request: " + "; ".join(problems), problems=tuple(problems))
        secret = new_enrollment_token()
        now = time.time()
        token = EnrollmentToken(
            id="et_" + secrets.token_hex(6),
            token_sha256=hash_token(secret),
            labels=dict(req.labels),
            created_at=now,
            expires_at=now + req.ttl_s,
            created_by=actor.key_id,
        )
        shown = attrs.evolve(token, token_sha256="")  # the audit digest need not cover the hash
        event = await self._store.run(
            st.insert_token,
            token,
            audit_draft(actor, "enrollment_token.create", f"enrollment_token/{token.id}", None, shown),
        )
        self._metrics.audit_events.labels(event.result.value).inc()
        return secret, token

    async def enroll(self, req: EnrollRequest) -> Node:
        """Spend a token and enroll a node with the public keys it sent. Refusals change nothing."""
        problems = []
        # A token as `nexa tokens create` shows it carries the controller fingerprint after a `.`
        # (for the node to check); only the secret before it is ours to check.
        secret = req.token.partition(TOKEN_PIN_SEPARATOR)[0]
        if not is_enrollment_token(secret):
            problems.append("token: not an enrollment token")
        try:
            PublicKey.from_b64(req.signing_public_key)
        except ContractError:
            problems.append("signing_public_key: not an Ed25519 public key")
        try:
            check_curve_key(req.curve_public_key)
        except Exception:
            problems.append("curve_public_key: not a Curve25519 public key in Z85")
        if not req.hostname or len(req.hostname) > 253:
            problems.append("hostname: 1 to 253 characters")
        if problems:
            raise ContractError("invalid enrollment request: " + "; ".join(problems), problems=tuple(problems))
        async with self._lock:
            # A key already enrolled fails the UNIQUE constraints after the token check, so a
            # caller without a valid token learns nothing about which keys are enrolled.
            node = Node(
                id=self._new_node_id(req.hostname),
                hostname=req.hostname,
                signing_public_key=req.signing_public_key,
                curve_public_key=req.curve_public_key,
                labels={},
                enrolled_at=time.time(),
            )
            draft = audit_draft(SYSTEM, "node.enroll", f"node/{node.id}")
            node = await self._store.run(st.enroll_node, hash_token(secret), time.time(), node, draft)
            desired = DesiredAssignments(node_id=node.id, generation=1)
            await self._leadership.write(st.save_desired, desired, None)
            self._add(node, None, desired)
        self._metrics.audit_events.labels("ok").inc()
        log.info("node enrolled", extra={"fields": {"node": node.id}})
        return node

    def _new_node_id(self, hostname: str) -> NodeId:
        base = _NODE_ID_RE.sub("-", hostname.lower().split(".")[0]).strip("-.")[:40] or "node"
        if not NAME_RE.match(base):
            base = "node"
        candidate = base
        while candidate in self._nodes:
            candidate = f"{base}-{secrets.token_hex(2)}"
        return NodeId(candidate)

    # ---- operator actions ------------------------------------------------------------------------

    async def act(self, actor: Actor, node_id: str, action: str) -> NodeLive:
        """cordon, uncordon, drain or revoke; the same action twice is a no-op answer, not an error."""
        allowed_from, target = _ACTIONS[action]
        async with self._lock:
            live = self.get(node_id)
            before = live.node
            if before.admin_state is target:
                return live
            if before.admin_state not in allowed_from:
                raise Conflict(f"node {node_id} is {before.admin_state.value}; it cannot be {action}ed")
            after = attrs.evolve(
                before, admin_state=target, revoked_at=time.time() if target is NodeAdminState.REVOKED else None
            )
            event = await self._store.run(
                st.update_node, after, audit_draft(actor, f"node.{action}", f"node/{node_id}", before, after)
            )
            self._metrics.audit_events.labels(event.result.value).inc()
            live.node = after
            self.version += 1
            if target is NodeAdminState.REVOKED:
                self._by_curve.pop(after.curve_public_key, None)
                if live.previous_keys is not None:
                    self._by_curve.pop(live.previous_keys[1], None)
                live.reachable = False
        self._changed()
        return live

    # ---- node key rotation ------------------------------------------------------------------------

    def on_rotation_request(self, ask: Callable[[str], Awaitable[None]]) -> None:
        """How to ask a node over its channel to rotate its keys (set by the node channel)."""
        self._ask_rotation = ask

    async def request_rotation(self, actor: Actor, node_id: str) -> NodeLive:
        """`nexa nodes rotate`: ask the node to rotate its keys, audited. Refusals change nothing:
        Conflict for a revoked node, NodeUnreachable for one with no open channel."""
        live = self.get(node_id)
        if live.node.admin_state is NodeAdminState.REVOKED:
            raise Conflict(f"node {node_id} is revoked; a revoked node has no keys to rotate")
        if not live.reachable or self._ask_rotation is None:
            raise NodeUnreachable(node_id=node_id)
        try:
            await self._ask_rotation(live.node.id)
        except NotConnected:
            raise NodeUnreachable(node_id=node_id) from None
        draft = audit_draft(actor, "node.rotate_keys_requested", f"node/{node_id}", detail="asked over its channel")
        event = await self._store.run(st.record_audit, draft)
        self._metrics.audit_events.labels(event.result.value).inc()
        return live

    async def rotate_keys(self, node_id: str, msg: RotateKeys, *, by_previous: bool) -> bool:
        """Know the node by the public keys in `msg` from now on; the keys it signed `msg` with
        stay admitted until it uses the new ones (`keys_in_use`). True when the keys changed; a
        repeat of the rotation already done changes nothing. Refusals (ContractError for keys
        that do not parse, Conflict for keys another node has) change nothing."""
        problems = []
        try:
            new_signing = PublicKey.from_b64(msg.signing_public_key)
        except ContractError:
            problems.append("signing_public_key: not an Ed25519 public key")
        try:
            check_curve_key(msg.curve_public_key)
        except ContractError:
            problems.append("curve_public_key: not a Curve25519 public key in Z85")
        if problems:
            raise ContractError("invalid key rotation: " + "; ".join(problems), problems=tuple(problems))
        async with self._lock:
            live = self.get(node_id)
            before = live.node
            keys = (msg.signing_public_key, msg.curve_public_key)
            if keys == (before.signing_public_key, before.curve_public_key):
                return False  # answered again: the node did not get (or act on) the first answer
            # Signed with the keys it had before the rotation under way: it never used the keys
            # the controller holds for it now, so they are replaced and the old ones stay admitted.
            if by_previous and live.previous_keys is not None:
                previous = (live.previous_keys[0].b64, live.previous_keys[1])
            else:
                previous = (before.signing_public_key, before.curve_public_key)
            taken = self._keys_taken(keys)
            if taken == live.node.id:
                raise Conflict(f"node {node_id} has had one of these keys already: a rotation needs two new keys")
            if taken is not None:
                raise Conflict("another node is enrolled with one of these keys")
            after = attrs.evolve(before, signing_public_key=keys[0], curve_public_key=keys[1])
            detail = f"signing key {new_signing.fingerprint}; the previous keys are admitted until the node uses these"
            draft = audit_draft(SYSTEM, "node.keys_rotated", f"node/{node_id}", before, after, detail=detail)
            event = await self._store.run(st.rotate_node_keys, node_id, keys, previous, draft)
            self._metrics.audit_events.labels(event.result.value).inc()
            admitted = {after.curve_public_key, previous[1]}
            # Keys it will never use (a rotation it started again from its previous keys) go.
            held = {before.curve_public_key} | ({live.previous_keys[1]} if live.previous_keys else set())
            for curve in held - admitted:
                if self._by_curve.get(curve) == live.node.id:
                    del self._by_curve[curve]
            self._by_curve.update(dict.fromkeys(admitted, live.node.id))
            live.node, live.signing_key = after, new_signing
            live.previous_keys = (PublicKey.from_b64(previous[0]), previous[1])
        log.info("node %s rotated its keys", node_id, extra={"fields": {"node": node_id}})
        return True

    def _keys_taken(self, keys: tuple[str, str]) -> NodeId | None:
        """The node that holds (or held, while a rotation overlaps) one of these keys."""
        for other in self._nodes.values():
            held = {other.node.signing_public_key, other.node.curve_public_key}
            if other.previous_keys is not None:
                held |= {other.previous_keys[0].b64, other.previous_keys[1]}
            if held & set(keys):
                return other.node.id
        return None

    async def keys_in_use(self, live: NodeLive) -> None:
        """The node signed with its new key: its previous keys are admitted no more."""
        previous = live.previous_keys
        if previous is None:
            return
        live.previous_keys = None
        if self._by_curve.get(previous[1]) == live.node.id:
            del self._by_curve[previous[1]]
        self._retired_curve[previous[1]] = live.node.id
        await self._store.run(st.retire_previous_keys, live.node.id)
        log.info("node %s uses its new keys; the previous ones are refused from now on", live.node.id)

    async def needs_reenrollment(self, live: NodeLive, key_id: str) -> None:
        """The node pins only `key_id`, a controller key retired for good: Unreachable from now on
        and sent nothing (southbound refuses its messages) until it is enrolled again. Stored and
        audited once (`node.needs_reenrollment`); marking it again changes nothing."""
        if live.reenroll_key_id:
            return
        detail = f"it pins only the retired controller key {key_id}, whose overlap ended: {REENROLL_HINT}"
        draft = audit_draft(
            SYSTEM, "node.needs_reenrollment", f"node/{live.node.id}", result=AuditResult.REJECTED, detail=detail
        )
        event = await self._store.run(st.mark_needs_reenrollment, live.node.id, key_id, draft)
        live.reenroll_key_id, live.reachable = key_id, False
        if event is not None:
            self._metrics.audit_events.labels(event.result.value).inc()
        log.warning("node %s needs re-enrollment: %s", live.node.id, detail, extra={"fields": {"node": live.node.id}})
        self.version += 1
        self._changed()

    # ---- what the node channel reports -------------------------------------------------------------

    def check_replay(self, node_id: str, seq: int, ts: float) -> None:
        """Advance the node's replay window; raises Replayed or ClockSkew (nothing changes then)."""
        live = self.get(node_id)
        live.window = live.window.check(seq, ts, time.time())

    def alive(self, node_id: str, state_seq: int) -> bool:
        """A liveness beat (never waits; the receive loop's hot path): a reachable node's `last_seen`
        moves, and nothing else. True when the control loop must see it: the node is not
        reachable, its state is not current, or it sent a state (`state_seq`) that never came here."""
        live = self._nodes.get(NodeId(node_id))
        if live is None:
            return False
        if not live.reachable:
            return True  # only a current state makes it reachable again (`alive_again`)
        now = trio.current_time()
        live.last_seen, live.last_seen_wall = now, time.time()
        return state_seq > live.state_seq or not self.state_current(live, now)

    def state_current(self, live: NodeLive, now: float) -> bool:
        """Whether the node's last state came within the interval it announced plus `lease_s`."""
        return live.state_current(now, self._cfg.lease_s)

    async def alive_again(self, live: NodeLive) -> bool:
        """A liveness beat from an Unreachable node: reachable again (audited) when its state is
        current, else nothing changes. Whether it is reachable now."""
        now = trio.current_time()
        if live.reachable or live.reenroll_key_id or not self.state_current(live, now):
            return live.reachable
        if live.node.admin_state is NodeAdminState.REVOKED:
            return False
        live.last_seen, live.last_seen_wall = now, time.time()
        live.reachable = True
        await self._transition(live, "node.reachable", "liveness resumed; its state is current")
        return True

    async def heard(self, node_id: str, msg: NodeMessage) -> NodeLive:
        """Record a verified message; a node that was Unreachable becomes reachable again."""
        live = self.get(node_id)
        live.last_seen = trio.current_time()
        live.last_seen_wall = time.time()
        if live.last_state is None or isinstance(msg, Heartbeat):
            # The state's clock: a Heartbeat, or the first signed message, which starts it with no
            # interval (the state must come within `lease_s`, as every heartbeat had to before).
            live.last_state = live.last_seen
            live.state_interval_s = msg.state_interval_s if isinstance(msg, Heartbeat) else 0.0
            live.state_seq = msg.seq if isinstance(msg, Heartbeat) else live.state_seq
        if isinstance(msg, Hello):
            live.agent_version, live.protocol = msg.agent_version, msg.protocol
            live.reported_epoch, live.reported_generation = msg.epoch, msg.generation
        elif isinstance(msg, Heartbeat):
            statuses = list(msg.assignments)
            if _ready_ids(statuses) != _ready_ids(live.statuses):
                self.version += 1
            live.statuses = statuses
            live.reported_epoch, live.reported_generation = msg.epoch, msg.generation
            live.free_memory_bytes, live.free_accelerators = msg.free_memory_bytes, msg.free_accelerators
            live.loads = {
                s.assignment_id: (s.load, live.last_seen - s.load.age_s) for s in statuses if s.load is not None
            }
            live.cache_disk = msg.cache_disk
            live.runtime_cache = msg.runtime_cache
            if msg.memory_pressure != live.memory_pressure:
                await self._memory_pressure(live, msg.memory_pressure)
            if msg.memory_pressure_stops > live.memory_pressure_stops:
                await self._pressure_stops(live, msg)
            live.memory_pressure_stops = msg.memory_pressure_stops
            measured = {s.assignment_id: s.memory.measured_bytes for s in statuses if s.memory is not None}
            if measured != live.measured:
                live.measured = measured
                for hook in self._measured_hooks:
                    await hook(live, measured)
            await self._take_inventory(live, msg.inventory)
        if not live.reachable:
            live.reachable = True
            await self._transition(live, "node.reachable", "heartbeats resumed")
        await self._write_deferred(live)
        return live

    async def _take_inventory(self, live: NodeLive, inventory: NodeInventory) -> None:
        if inventory == live.inventory:
            return  # the usual heartbeat: the agent re-sends the inventory it already reported
        live.inventory = inventory
        digest = _static_digest(inventory)
        if digest != live.inventory_digest:
            live.inventory_digest = digest
            live.inventory_unsaved = True  # written now, or by `_write_deferred` within the node's rate

    async def _write_deferred(self, live: NodeLive) -> None:
        """Write what this node's messages changed and the store has not seen, within its write rate."""
        if live.inventory_unsaved and live.inventory is not None and self._may_write(live, "inventory"):
            live.inventory_unsaved = False
            await self._store.run(st.save_inventory, live.node.id, live.inventory, time.time())
        if live.desired_unsaved and self._may_write(live, "ack"):
            live.desired_unsaved = False
            await self._leadership.write(st.save_desired, live.desired, None)

    def overdue(self, now: float) -> tuple[list[NodeLive], float]:
        """Reachable nodes whose lease (liveness, or state: `state_current`) ran out by `now`, and
        the next deadline among the rest."""
        lapsed, next_deadline = [], now + self._cfg.lease_s
        for live in self._nodes.values():
            deadline = live.deadline(self._cfg.lease_s)
            if not live.reachable or deadline is None:
                continue
            if deadline <= now:
                lapsed.append(live)
            else:
                next_deadline = min(next_deadline, deadline)
        return lapsed, next_deadline

    async def mark_unreachable(self, live: NodeLive) -> None:
        live.reachable = False
        if live.last_seen is not None and trio.current_time() - live.last_seen < self._cfg.lease_s:
            waited = live.state_interval_s + self._cfg.lease_s
            detail = f"alive, but no state for {waited:g} s (its state interval and the lease)"
        else:
            detail = f"no good heartbeat for {self._cfg.lease_s:g} s"
        await self._transition(live, "node.unreachable", detail)

    async def _memory_pressure(self, live: NodeLive, pressure: MemoryPressure | None) -> None:
        """The node's memory-pressure condition came or went: placement follows, and the audit says so."""
        live.memory_pressure = pressure
        if pressure is None:
            await self._transition(live, "node.memory_pressure_cleared", "MemAvailable is back above the floor")
        else:
            await self._transition(live, "node.memory_pressure", pressure.describe())

    async def _pressure_stops(self, live: NodeLive, msg: Heartbeat) -> None:
        stopped = [s.assignment_id for s in msg.assignments if s.reason == MEMORY_PRESSURE]
        detail = f"the node's memory guard stopped {', '.join(stopped) or 'a replica'}"
        draft = audit_draft(SYSTEM, "replica.memory_pressure", f"node/{live.node.id}", detail=detail)
        event = await self._store.run(st.record_audit, draft)
        self._metrics.audit_events.labels(event.result.value).inc()

    async def _transition(self, live: NodeLive, action: str, detail: str) -> None:
        self.version += 1  # reachability changed: seen by the next request, before the audit write
        log.info("node %s: %s", live.node.id, action, extra={"fields": {"node": live.node.id}})
        draft = audit_draft(SYSTEM, action, f"node/{live.node.id}", detail=detail)
        event = await self._store.run(st.record_audit, draft)
        self._metrics.audit_events.labels(event.result.value).inc()
        self._changed()

    async def record_ack(self, live: NodeLive, ack: Ack) -> None:
        desired = live.desired
        reason = None if ack.accepted else ack.reason
        changed = (desired.acked_epoch, desired.acked_generation, desired.ack_reason) != (
            ack.epoch,
            ack.generation,
            reason,
        )
        live.desired = attrs.evolve(
            desired, acked_epoch=ack.epoch, acked_generation=ack.generation, ack_reason=reason, ack_at=time.time()
        )
        self._metrics.assignment_acks.labels(reason.value if reason else "accepted").inc()
        if not changed:
            return  # a lease renewal acknowledged again: nothing new to keep
        if not self._may_write(live, "ack"):
            # Above the node's write rate: the answer is kept in memory and written later (its
            # audit event, for a refusal, is not: the counter and the node's state show it).
            live.desired_unsaved = True
            return
        live.desired_unsaved = False
        draft = None
        if reason is not None:
            detail = f"{reason.value}: epoch {ack.epoch} generation {ack.generation}"
            draft = audit_draft(
                SYSTEM, "assignments.rejected", f"node/{live.node.id}", result=AuditResult.REJECTED, detail=detail
            )
        await self._leadership.write(st.save_desired, live.desired, draft)
        if draft is not None:
            self._metrics.audit_events.labels(AuditResult.REJECTED.value).inc()

    async def record_refusal(self, node_id: str, code: str, detail: str) -> None:
        target = f"node/{node_id}" if node_id else "node/(unknown)"
        draft = audit_draft(
            SYSTEM, "node.message.rejected", target, result=AuditResult.REJECTED, detail=f"{code}: {detail}"[:300]
        )
        event = await self._store.run(st.record_audit, draft)
        self._metrics.audit_events.labels(event.result.value).inc()


def _ready_ids(statuses: list[AssignmentStatus]) -> set[str]:
    return {s.assignment_id for s in statuses if s.state is RuntimeState.READY}


def _static_digest(inventory: NodeInventory | None) -> str | None:
    """Digest of what placement cares about, without the values that move every second."""
    if inventory is None:
        return None
    steady = steady_inventory(inventory)
    return hashlib.sha256(codec.dumps(codec.store, steady).encode()).hexdigest()
