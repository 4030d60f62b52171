"""Enrollment and node routes: one-time tokens, enrolling, listing, showing, cordon, uncordon,
drain, revoke and key rotation. Each route is declared once, beside its handler (`http.declare`)."""

from __future__ import annotations

import trio
from quart import Response

from nexa import security
from nexa.contracts import pages
from nexa.contracts.api import (
    EnrollmentTokenCreate,
    EnrollmentTokenCreated,
    EnrollRequest,
    EnrollResponse,
    NodeList,
    NodeView,
)
from nexa.contracts.fabric import effective_fabric
from nexa.control.fleet import grants
from nexa.control.fleet.nodes import NodeLive
from nexa.control.http.api_io import actor, body, json_response, next_cursor, page
from nexa.control.http.declare import ADMIN, OPERATORS, PAGE_QUERY, route
from nexa.control.http.state import AppState
from nexa.errors import REENROLL_HINT, AuthError, Conflict, IllegalTransition, NodeUnreachable, NotFound

_NODE_ACTION = (IllegalTransition,)


@route(
    "POST",
    "/api/v1/enrollment-tokens",
    roles=ADMIN,
    summary="Create a one-time node enrollment token",
    tag="nodes",
    request=EnrollmentTokenCreate,
    answer=EnrollmentTokenCreated,
    status=201,
)
async def create_enrollment_token(s: AppState) -> Response:
    req = await body(EnrollmentTokenCreate)
    secret, token = await s.fleet.create_token(actor(), req)
    fingerprint = s.controller_keys.fingerprint
    created = EnrollmentTokenCreated(
        id=token.id,
        token=security.pinned_enrollment_token(secret, fingerprint),
        expires_at=token.expires_at,
        labels=token.labels,
        controller_fingerprint=fingerprint,
    )
    return json_response(created, 201)


# Authenticated by the one-time token in the body.
@route(
    "POST",
    "/api/v1/enroll",
    roles=None,
    summary="Enroll a node (authenticated by the one-time token in the body)",
    tag="nodes",
    request=EnrollRequest,
    answer=EnrollResponse,
    status=201,
    errors=(AuthError,),
)
async def enroll(s: AppState) -> Response:
    req = await body(EnrollRequest)
    node = await s.fleet.enroll(req)
    keys = s.controller_keys
    resp = EnrollResponse(
        node_id=node.id,
        controller_signing_public_key=keys.signing,
        controller_curve_public_key=keys.curve,
        channel_endpoint=s.fleet.channel_endpoint,
        labels=node.labels,
    )
    return json_response(resp, 201)


@route("GET", "/api/v1/nodes", roles=OPERATORS, summary="List nodes", tag="nodes", answer=NodeList, params=PAGE_QUERY)
async def list_nodes(s: AppState) -> Response:
    after, limit = page("nodes", (str,))
    nodes, last = pages.page_of(s.fleet, lambda live: (live.node.id,), after, limit)
    return json_response(NodeList(nodes=[_node_view(live) for live in nodes], next_cursor=next_cursor("nodes", last)))


@route("GET", "/api/v1/nodes/<node_id>", roles=OPERATORS, summary="Show a node", tag="nodes", answer=NodeView)
async def show_node(s: AppState, node_id: str) -> Response:
    return json_response(_node_view(s.fleet.get(node_id)))


@route(
    "POST",
    "/api/v1/nodes/<node_id>/cordon",
    roles=OPERATORS,
    summary="Cordon a node",
    tag="nodes",
    answer=NodeView,
    errors=_NODE_ACTION,
)
async def cordon(s: AppState, node_id: str) -> Response:
    return json_response(_node_view(await s.fleet.act(actor(), node_id, "cordon")))


@route(
    "POST",
    "/api/v1/nodes/<node_id>/uncordon",
    roles=OPERATORS,
    summary="Uncordon a node",
    tag="nodes",
    answer=NodeView,
    errors=_NODE_ACTION,
)
async def uncordon(s: AppState, node_id: str) -> Response:
    return json_response(_node_view(await s.fleet.act(actor(), node_id, "uncordon")))


@route(
    "POST",
    "/api/v1/nodes/<node_id>/drain",
    roles=OPERATORS,
    summary="Drain a node",
    tag="nodes",
    answer=NodeView,
    errors=_NODE_ACTION,
)
async def drain(s: AppState, node_id: str) -> Response:
    return json_response(_node_view(await s.fleet.act(actor(), node_id, "drain")))


@route(
    "POST",
    "/api/v1/nodes/<node_id>/revoke",
    roles=ADMIN,
    summary="Revoke a node's credentials",
    tag="nodes",
    answer=NodeView,
    errors=_NODE_ACTION,
)
async def revoke(s: AppState, node_id: str) -> Response:
    return json_response(_node_view(await s.fleet.act(actor(), node_id, "revoke")))


@route(
    "POST",
    "/api/v1/nodes/<node_id>/rotate-keys",
    roles=ADMIN,
    summary="Ask a node over its channel to rotate its keys (it sends the new ones, signed with the old)",
    tag="nodes",
    answer=NodeView,
    errors=(NotFound, Conflict, NodeUnreachable),
)
async def rotate_keys(s: AppState, node_id: str) -> Response:
    return json_response(_node_view(await s.fleet.request_rotation(actor(), node_id)))


def _node_view(live: NodeLive) -> NodeView:
    inventory = live.inventory
    merged = grants.labels(live.node.labels, inventory.labels.items() if inventory else ())
    labels = {str(k): str(v) for k, v in merged.items()}
    age = None if live.last_seen is None else max(0.0, trio.current_time() - live.last_seen)
    return NodeView(
        id=live.node.id,
        hostname=live.node.hostname,
        state=live.state,
        admin_state=live.node.admin_state,
        labels=labels,
        enrolled_at=live.node.enrolled_at,
        last_heartbeat_at=live.last_seen_wall,
        last_heartbeat_age_s=None if age is None else round(age, 3),
        agent_version=live.agent_version,
        inventory=inventory,
        free_memory_bytes=live.free_memory_bytes,
        free_accelerators=live.free_accelerators,
        assignments=list(live.statuses),
        desired_generation=live.desired.generation,
        acked_epoch=live.desired.acked_epoch,
        acked_generation=live.desired.acked_generation,
        ack_reason=live.desired.ack_reason,
        needs_reenrollment=bool(live.reenroll_key_id),
        hint=REENROLL_HINT if live.reenroll_key_id else "",
        cache_disk=live.cache_disk,
        channel=dict(live.channel),
        runtime_cache=live.runtime_cache,
        memory_pressure=live.memory_pressure,
        data_classes=list(grants.data_classes(live.node.labels, inventory)),
        fabric=effective_fabric(labels, inventory.fabric if inventory else None),
    )
