"""Console sessions and CSRF: the pool of signed-in browsers, and the stateless sign-in form.

Sessions are server-side, in memory: the browser holds only a random session id in an HttpOnly,
SameSite=Strict cookie, never the API key. A revoked key's session stops at its next request; a
controller restart signs everyone out. Every POST carries the session's CSRF token (form field or
`X-CSRF-Token` header); without it nothing changes.

The sign-in form keeps no server-side state: its CSRF token is an HMAC (per-process secret) over a
time and a nonce, sent both in the form and in a SameSite=Strict cookie (double submit), so
anonymous visitors cannot fill, or evict from, the pool of signed-in sessions.

Nothing here touches a request: the page layer (`pages.py`) hands in the cookie, the presented
token and the peer, so every rule is checkable without a server.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import secrets
from collections.abc import Callable, Iterable
from typing import Final

import attrs

from nexa.contracts.domain import Actor, KeyId, Role, TenantId

#: The session cookie: a random id, nothing else.
COOKIE: Final = "nexa_console"
#: The sign-in form's CSRF cookie (double submit: it must equal the form's token).
LOGIN_COOKIE: Final = "nexa_console_login"
#: How long a signed-in session lasts (seconds); a controller restart ends it sooner.
SESSION_TTL_S: Final = 8 * 3600.0
#: How long a sign-in form stays valid (its stateless CSRF token expires then).
ANON_TTL_S: Final = 600.0
#: Signed-in sessions kept at most; the oldest are dropped beyond it.
MAX_SESSIONS: Final = 10_000
#: Signed-in sessions one key may hold; its oldest is dropped beyond it (not another key's).
MAX_SESSIONS_PER_KEY: Final = 32
#: Longest sign-in token looked at (ours are about 120 characters).
_MAX_TOKEN_CHARS: Final = 256

_Network = ipaddress.IPv4Network | ipaddress.IPv6Network


@attrs.define
class Session:
    """One browser's sign-in (only signed-in browsers have one; the sign-in form is stateless)."""

    csrf: str
    expires_at: float
    key_id: KeyId | None = None
    role: Role | None = None
    tenant: TenantId | None = None
    flash: list[tuple[str, str]] = attrs.Factory(list)

    @property
    def actor(self) -> Actor:
        return Actor(key_id=self.key_id, role=self.role, tenant=self.tenant)


def new_session(key_id: KeyId, role: Role, tenant: TenantId | None, *, now: float) -> Session:
    """A fresh signed-in session with its own CSRF token, lasting `SESSION_TTL_S`."""
    return Session(
        csrf=secrets.token_urlsafe(32), expires_at=now + SESSION_TTL_S, key_id=key_id, role=role, tenant=tenant
    )


def csrf_ok(session: Session, presented: str) -> bool:
    """Whether a POST carries this session's CSRF token (constant time)."""
    return hmac.compare_digest(presented.encode(), session.csrf.encode())


class Sessions:
    """The signed-in sessions, by id. `key_active` says whether a key still works (the accounts')."""

    def __init__(self, key_active: Callable[[KeyId], bool]) -> None:
        self._key_active = key_active
        self._by_id: dict[str, Session] = {}

    def __len__(self) -> int:
        return len(self._by_id)

    def add(self, session: Session, *, now: float) -> str:
        """Keep `session` under a new random id (returned), dropping the oldest beyond the limits."""
        mine = [sid for sid, s in self._by_id.items() if s.key_id == session.key_id]
        for sid in mine[: max(0, len(mine) - MAX_SESSIONS_PER_KEY + 1)]:
            del self._by_id[sid]  # this key's oldest: one key cannot push out the others
        if len(self._by_id) >= MAX_SESSIONS:
            for sid in [s for s, v in self._by_id.items() if v.expires_at <= now]:
                del self._by_id[sid]
            while len(self._by_id) >= MAX_SESSIONS:
                del self._by_id[next(iter(self._by_id))]
        sid = secrets.token_urlsafe(32)
        self._by_id[sid] = session
        return sid

    def current(self, sid: str, *, now: float) -> Session | None:
        """The live session of `sid`: None when unknown, expired, or its key was revoked or expired."""
        session = self._by_id.get(sid)
        if session is None:
            return None
        if session.expires_at <= now:
            del self._by_id[sid]
            return None
        if session.key_id is not None and not self._key_active(session.key_id):
            del self._by_id[sid]  # revoked or expired: the session ends at once
            return None
        return session

    def drop(self, sid: str) -> None:
        self._by_id.pop(sid, None)


class LoginForms:
    """The sign-in form's CSRF tokens: `time.nonce.mac`, nothing kept server-side.

    The secret is per process: a restart invalidates open forms (they reload)."""

    def __init__(self) -> None:
        self._secret = secrets.token_bytes(32)

    def token(self, now: float) -> str:
        body = f"{int(now)}.{secrets.token_urlsafe(16)}"
        return f"{body}.{self._mac(body)}"

    def _mac(self, body: str) -> str:
        return hmac.new(self._secret, b"console-login\x00" + body.encode(), hashlib.sha256).hexdigest()

    def token_ok(self, presented: str, cookie: str, now: float) -> bool:
        """The form's token equals the cookie's (double submit), is ours, and is not expired."""
        if (
            not presented
            or len(presented) > _MAX_TOKEN_CHARS
            or not hmac.compare_digest(presented.encode(), cookie.encode())
        ):
            return False
        body, _, mac = presented.rpartition(".")
        issued = body.partition(".")[0]
        if not issued.isdigit() or not hmac.compare_digest(mac.encode(), self._mac(body).encode()):
            return False
        return 0 <= now - int(issued) <= ANON_TTL_S


def trusted_networks(proxies: Iterable[str]) -> tuple[_Network, ...]:
    return tuple(ipaddress.ip_network(p, strict=False) for p in proxies)


def reached_over_https(scheme: str, peer: str | None, forwarded_proto: str, proxies: tuple[_Network, ...]) -> bool:
    """Whether the browser reached us over https (so cookies get `Secure`): directly, or through a
    trusted proxy that says so (`forwarded_proto`: its `X-Forwarded-Proto`). `peer` is the TCP
    peer's address itself, never a header."""
    if scheme in {"https", "wss"}:
        return True
    if not proxies:
        return False
    try:
        address = ipaddress.ip_address(peer or "")
    except ValueError:
        return False
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    if not any(address in net for net in proxies):
        return False
    # The nearest proxy (the trusted one) appends last; earlier values came from the client.
    proto = forwarded_proto.rsplit(",", 1)[-1]
    return proto.strip().lower() == "https"
