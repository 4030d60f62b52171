"""Domain records shared by the API, the store and the wire. Pure data."""

from __future__ import annotations

import enum
import re
from typing import Final, NewType

import attrs

KeyId = NewType("KeyId", str)
TenantId = NewType("TenantId", str)
EventId = NewType("EventId", str)

#: Lexical rule for names people choose (tenants, later models and aliases).
NAME_RE: Final = re.compile(r"^[a-z0-9](?:[a-z0-9._-]{0,62}[a-z0-9])?$")
#: An API key: `nxk_` + 12 hex chars of public key id + `_` + 32 random bytes in unpadded base64url.
API_KEY_PREFIX: Final = "nxk_"
API_KEY_RE: Final = re.compile(r"^nxk_([0-9a-f]{12})_([A-Za-z0-9_-]{43})$")


def parse_api_key(text: str) -> KeyId | None:
    """The public id of an API key (None: not a key's shape); the secret part stays the caller's."""
    match = API_KEY_RE.match(text)
    return KeyId(match.group(1)) if match else None


class Role(enum.StrEnum):
    """What an API key may do. Each key has exactly one role."""

    ADMIN = "admin"
    OPERATOR = "operator"
    INFERENCE = "inference"
    AUDIT = "audit"
    MONITORING = "monitoring"
    #: Reads retained payloads (`nexa retention show`), decrypted by the controller; every read is audited.
    RETENTION_READER = "retention-reader"


class Priority(enum.StrEnum):
    """An admission class. Waiting requests are granted slots by weight (`weight`: of every 7
    grants while all three classes wait, 4 go to `interactive`, 2 to `standard`, 1 to `batch`), so
    a higher class goes first and a lower one is never starved; within a class, round-robin over
    tenants. Which classes a key may ask for is its grant (`ApiKey.priorities`)."""

    INTERACTIVE = "interactive"
    STANDARD = "standard"
    BATCH = "batch"

    @property
    def rank(self) -> int:
        return _RANKS[self]

    @property
    def weight(self) -> int:
        return _WEIGHTS[self]


_RANKS: Final = {Priority.INTERACTIVE: 0, Priority.STANDARD: 1, Priority.BATCH: 2}
_WEIGHTS: Final = {Priority.INTERACTIVE: 4, Priority.STANDARD: 2, Priority.BATCH: 1}
#: The classes a key may ask for when its grant names none (`interactive` needs a grant).
DEFAULT_PRIORITIES: Final = (Priority.STANDARD, Priority.BATCH)


@attrs.frozen(kw_only=True)
class ApiKey:
    """An API key as the controller keeps it: never the secret, only its SHA-256."""

    id: KeyId
    name: str
    role: Role
    tenant: TenantId | None
    secret_sha256: str
    created_at: float
    created_by: KeyId | None
    revoked_at: float | None = None
    #: When the key stops working (unix seconds); None: never. A rotation sets it to the end of the grace.
    expires_at: float | None = None
    #: The key a rotation issued in this one's place.
    rotated_to: KeyId | None = None
    #: The priority classes requests with this key may ask for; None: `DEFAULT_PRIORITIES`.
    priorities: tuple[Priority, ...] | None = None

    @property
    def granted(self) -> tuple[Priority, ...]:
        """The priority classes this key may ask for."""
        return DEFAULT_PRIORITIES if self.priorities is None else self.priorities

    @property
    def active(self) -> bool:
        """Not revoked (an expired key is still active: it may be listed, rotated or revoked)."""
        return self.revoked_at is None

    def expired(self, now: float) -> bool:
        return self.expires_at is not None and now >= self.expires_at

    def usable(self, now: float) -> bool:
        """Neither revoked nor expired: requests with it are served."""
        return self.active and not self.expired(now)


@attrs.frozen(kw_only=True)
class Actor:
    """Who is asking: the authenticated key, or the controller itself (key_id None)."""

    key_id: KeyId | None
    role: Role | None
    tenant: TenantId | None = None


SYSTEM: Final = Actor(key_id=None, role=None)


@attrs.frozen(kw_only=True)
class Tenant:
    id: TenantId
    display_name: str
    created_at: float


class AuditResult(enum.StrEnum):
    OK = "ok"
    DENIED = "denied"
    REJECTED = "rejected"


@attrs.frozen(kw_only=True)
class AuditDraft:
    """What a mutation says about itself; the store fills in id, sequence, time and hashes."""

    actor_key_id: KeyId | None
    actor_role: Role | None
    action: str
    target: str
    prior_sha256: str | None
    next_sha256: str | None
    result: AuditResult = AuditResult.OK
    detail: str = ""


@attrs.frozen(kw_only=True)
class AuditEvent:
    """One link of the audit chain. `sha256` covers every other field, `prev_sha256` included."""

    seq: int
    id: EventId
    time: float
    actor_key_id: KeyId | None
    actor_role: Role | None
    action: str
    target: str
    prior_sha256: str | None
    next_sha256: str | None
    result: AuditResult
    detail: str
    prev_sha256: str
    sha256: str


NodeId = NewType("NodeId", str)


class NodeAdminState(enum.StrEnum):
    """What operators asked of a node; liveness is tracked separately."""

    ACTIVE = "active"
    CORDONED = "cordoned"
    DRAINING = "draining"
    REVOKED = "revoked"


class NodeState(enum.StrEnum):
    """The state operators see: admin state combined with liveness (Revoked > Unreachable > the rest).

    `Joining`: heard from, but its inventory (what it has, what it may run) has not arrived yet, so
    nothing can be placed on it; it is `Ready` with its first good heartbeat.
    """

    READY = "Ready"
    CORDONED = "Cordoned"
    DRAINING = "Draining"
    UNREACHABLE = "Unreachable"
    REVOKED = "Revoked"
    JOINING = "Joining"


@attrs.frozen(kw_only=True)
class EnrollmentToken:
    """A one-time bootstrap token as the controller keeps it: only its SHA-256."""

    id: str
    token_sha256: str
    labels: dict[str, str]
    created_at: float
    expires_at: float
    created_by: KeyId | None
    used_at: float | None = None
    used_by_node: NodeId | None = None


@attrs.frozen(kw_only=True)
class Node:
    """An enrolled node: its public keys and what operators decided about it."""

    id: NodeId
    hostname: str
    #: Ed25519 public key (base64 of the raw 32 bytes): verifies its heartbeats.
    signing_public_key: str
    #: Curve25519 public key (Z85): admits its channel.
    curve_public_key: str
    labels: dict[str, str]
    enrolled_at: float
    admin_state: NodeAdminState = NodeAdminState.ACTIVE
    revoked_at: float | None = None
