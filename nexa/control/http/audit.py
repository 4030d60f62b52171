"""Audit routes: page through the chain, verify it (optionally against a signed checkpoint), and
its signed head. Each route is declared once, beside its handler (`http.declare`)."""

from __future__ import annotations

import time
from typing import Final

from quart import Response, request

from nexa.contracts import pages
from nexa.contracts.api import AuditCheckpoint, AuditPage, AuditVerdict, AuditVerifyRequest, SignedAuditCheckpoint
from nexa.control import store as st
from nexa.control.http.api_io import json_response, next_cursor, optional_body, page, query_float, query_int
from nexa.control.http.declare import AUDITORS, PAGE_QUERY, UNIX_S, Param, route
from nexa.control.http.state import AppState
from nexa.errors import BadSignature, CheckpointRejected, ContractError
from nexa.security import sign_audit_checkpoint, verify_audit_checkpoint

_AUDIT_QUERY: Final = (
    *PAGE_QUERY,
    Param(
        name="after",
        schema={"type": "integer", "minimum": 0, "maximum": 2**62},
        description="deprecated (send cursor): the seq of the last event seen (a cursor is read too)",
        deprecated=True,
    ),
    Param(name="action", schema=str),
    Param(name="actor", schema=str, description="an API key id"),
    Param(name="target", schema=str),
    Param(name="since", schema=UNIX_S),
    Param(name="until", schema=UNIX_S),
)


@route(
    "GET",
    "/api/v1/audit",
    roles=AUDITORS,
    summary="Page through the audit chain",
    tag="audit",
    answer=AuditPage,
    params=_AUDIT_QUERY,
)
async def list_audit(s: AppState) -> Response:
    after, limit = page("audit", (int,))
    legacy = request.args.get("after")  # deprecated alias: the seq of the last event seen, or a cursor
    if legacy is not None:
        if after is not None:
            raise ContractError("send cursor, or the deprecated after, not both", problems=("after",))
        digits = legacy.isascii() and legacy.isdigit()
        after = (query_int("after", 0, 0, 2**62),) if digits else pages.decode_cursor("audit", legacy, (int,), "after")
    q = st.AuditQuery(
        after_seq=0 if after is None else int(after[0]),
        limit=limit + 1,
        action=request.args.get("action"),
        actor_key_id=request.args.get("actor"),
        target=request.args.get("target"),
        since=query_float("since"),
        until=query_float("until"),
    )
    events, last = pages.cut(await s.store.read(st.list_audit, q), limit, lambda e: (e.seq,))
    return json_response(AuditPage(events=events, next_cursor=next_cursor("audit", last)))


@route(
    "POST",
    "/api/v1/audit/verify",
    roles=AUDITORS,
    summary="Verify the audit chain, optionally against a signed checkpoint",
    tag="audit",
    request=AuditVerifyRequest,
    body_kind="optional",
    answer=AuditVerdict,
    errors=(CheckpointRejected,),
)
async def verify(s: AppState) -> Response:
    """Recompute the chain on the read-only connection (writes go on meanwhile); with
    `against`, also check a signed checkpoint (`nexa audit head`) still holds."""
    req = await optional_body(AuditVerifyRequest)
    checkpoint = None
    if req.against is not None:
        # Signed by the current key, or by one it rotated away from (its public half is kept).
        rotation, pub = s.key_rotation, s.signing_key.public
        keys = rotation.keys.verifying_keys() if rotation else {pub.fingerprint: pub}
        embedded = req.against.public_key.strip()
        signer = next((k for k in keys.values() if k.b64 == embedded), pub)
        try:
            verify_audit_checkpoint(signer, req.against)
        except BadSignature as exc:
            raise CheckpointRejected(f"the checkpoint is not this controller's: {exc.message}") from None
        checkpoint = req.against.checkpoint
    verdict = await s.store.read(st.verify_audit, checkpoint)
    return json_response(verdict)


@route(
    "GET",
    "/api/v1/audit/head",
    roles=AUDITORS,
    summary="The chain's head, signed (keep it to verify against later)",
    tag="audit",
    answer=SignedAuditCheckpoint,
)
async def head(s: AppState) -> Response:
    """The chain's head (seq, sha256), signed with the controller's Ed25519 key: keep it, and
    `nexa audit verify --against` it later to detect a chain rebuilt after it."""
    seq, sha256 = await s.store.read(st.audit_head)
    checkpoint = AuditCheckpoint(seq=seq, sha256=sha256, at=time.time(), epoch=s.epoch())
    return json_response(sign_audit_checkpoint(s.signing_key, checkpoint))
