"""Payload retention: the policies an admin defines and the records of what was kept under them.

Pure data and validation; no I/O. A request names a policy (the envelope's `retention`, the
OpenAI routes' `x-nexa-retention` header); `ephemeral`, the default, keeps nothing. What a policy
keeps (the request and its answer) lives encrypted in the S3-compatible store only; the records
here carry ids, sizes and times, never a payload byte (`RetainedPayload` is built when the reader
role asks, decrypted in memory, and never stored).
"""

from __future__ import annotations

import re
from typing import Final

import attrs

from nexa.contracts.domain import NAME_RE, KeyId, TenantId

#: The retention that keeps nothing (the default); it is no policy's name.
EPHEMERAL: Final = "ephemeral"
#: A policy keeps payloads at least a second and at most ten years.
MIN_TTL_S: Final = 1.0
MAX_TTL_S: Final = 10 * 366 * 86400.0
#: How many tenants one policy may name.
MAX_POLICY_TENANTS: Final = 1000
#: What a purge may select by: request ids and tenant ids are of these characters.
_SELECTOR_RE: Final = re.compile(r"^[A-Za-z0-9._:@+=-]{1,256}$")


@attrs.frozen(kw_only=True)
class RetentionPolicySet:
    """`PUT /api/v1/retention/policies/{name}`: how long payloads are kept and which tenants may ask."""

    ttl_s: float
    #: The tenants whose requests may name this policy (each must exist).
    tenants: list[TenantId]


@attrs.frozen(kw_only=True)
class RetentionPolicy:
    name: str
    ttl_s: float
    tenants: list[TenantId]
    updated_at: float
    updated_by: KeyId | None = None


@attrs.frozen(kw_only=True)
class RetentionPolicyList:
    policies: list[RetentionPolicy]


@attrs.frozen(kw_only=True)
class RetainedRecord:
    """What the database holds of one retained request: whose, until when, never its content."""

    #: The record's own id (`ret_…`): a client may reuse a request id, never this.
    id: str
    request_id: str
    tenant: TenantId
    policy: str
    #: `openai` or `workloads`: the API it came through.
    api: str
    stored_at: float
    expires_at: float
    #: The sizes of the request and of the answer (the stored object is both, sealed).
    request_bytes: int
    answer_bytes: int


@attrs.frozen(kw_only=True)
class RetainedList:
    records: list[RetainedRecord]
    next_cursor: str | None = None


@attrs.frozen(kw_only=True)
class RetainedPayload:
    """`GET /api/v1/retention/records/{record_id}` (role `retention-reader`): decrypted on the server."""

    record: RetainedRecord
    #: The request body as the gateway received it (JSON), and the answer as the client got it
    #: (a JSON body, or a stream's server-sent events in order), as UTF-8 text.
    request: str
    answer: str


@attrs.frozen(kw_only=True)
class RetentionPurge:
    """`POST /api/v1/retention/purge`: exactly one of the three selects what is deleted now."""

    request_id: str | None = None
    tenant: TenantId | None = None
    policy: str | None = None


@attrs.frozen(kw_only=True)
class RetentionPurged:
    purged: int


def policy_name_problem(name: str) -> str | None:
    if name == EPHEMERAL:
        return f"name: {EPHEMERAL} keeps nothing and is no policy's name"
    if not NAME_RE.match(name):
        return "name: 1 to 64 characters of a-z 0-9 . _ - (starting and ending with a letter or digit)"
    return None


def retention_problem(value: str) -> str | None:
    """What is wrong with a request's `retention` (`ephemeral` or a policy name), or None."""
    if value == EPHEMERAL or NAME_RE.match(value):
        return None
    return f"retention: {EPHEMERAL} or a retention policy's name (a-z 0-9 . _ -, at most 64)"


def policy_problems(req: RetentionPolicySet) -> list[str]:
    problems = []
    if isinstance(req.ttl_s, bool) or not MIN_TTL_S <= req.ttl_s <= MAX_TTL_S:
        problems.append(f"ttl_s: seconds, {MIN_TTL_S:g} to {MAX_TTL_S:g}")
    if not req.tenants:
        problems.append("tenants: at least one tenant")
    if len(req.tenants) > MAX_POLICY_TENANTS:
        problems.append(f"tenants: at most {MAX_POLICY_TENANTS}")
    if len(set(req.tenants)) != len(req.tenants):
        problems.append("tenants: each tenant once")
    return problems


def purge_problems(req: RetentionPurge) -> list[str]:
    given = [v for v in (req.request_id, req.tenant, req.policy) if v is not None]
    if len(given) != 1:
        return ["give exactly one of request_id, tenant, policy"]
    if req.policy is not None and req.policy != EPHEMERAL and (problem := policy_name_problem(req.policy)):
        return [problem.replace("name:", "policy:", 1)]
    if not _SELECTOR_RE.match(given[0]):
        return ["request_id, tenant: 1 to 256 characters of A-Z a-z 0-9 . _ : @ + = -"]
    return []
