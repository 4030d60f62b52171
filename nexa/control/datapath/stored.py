"""Which replica keeps each stored Responses API response, so a later turn reaches it.

A runtime that keeps responses (vLLM with `VLLM_ENABLE_RESPONSES_API_STORE=1`:
`Adapter.keeps_responses`) keeps them in its own memory; another replica of the same model
knows nothing of them. The gateway remembers, for each response a keeping replica answered, the
tenant that asked and the replica (`StoredResponses.remember`), and routes a request naming it as
`previous_response_id` to that replica alone (`Work.pin`). The map is this controller's memory
only, bounded in entries and age: a controller that restarts, another controller of the cluster
(each remembers what it served), or an entry evicted or expired answers `ResponseNotFound`, and
the client resends the conversation as input items. State is per tenant: another tenant's id is
not found, never routed. Pure: no I/O, no trio; the caller gives the time.
"""

from __future__ import annotations

import collections
from typing import Final

import attrs

from nexa.contracts.domain import TenantId

#: Responses remembered at most (the oldest goes first).
MAX_STORED_RESPONSES: Final = 100_000
#: How long one is remembered after it was made (seconds): a day.
STORED_RESPONSE_TTL_S: Final = 86_400.0
#: The longest response id remembered (vLLM's are `resp_` and 32 hex digits).
MAX_RESPONSE_ID_CHARS: Final = 256


@attrs.frozen(kw_only=True)
class Pin:
    """Where one stored response lives: its replica, and when it was made (Unix seconds)."""

    deployment: str
    replica_id: str
    made_at: float


class StoredResponses:
    """(tenant, response id) → `Pin`, at most `max_entries`, each for `ttl_s`."""

    def __init__(self, *, max_entries: int = MAX_STORED_RESPONSES, ttl_s: float = STORED_RESPONSE_TTL_S) -> None:
        self._max = max_entries
        self._ttl_s = ttl_s
        #: Oldest first: a response is remembered once, when made.
        self._pins: collections.OrderedDict[tuple[TenantId, str], Pin] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._pins)

    def remember(self, tenant: TenantId, response_id: str, pin: Pin) -> None:
        """`tenant`'s response `response_id` is kept by `pin`'s replica (an id too long is not kept)."""
        if not response_id or len(response_id) > MAX_RESPONSE_ID_CHARS:
            return
        key = (tenant, response_id)
        self._pins.pop(key, None)
        self._pins[key] = pin
        while len(self._pins) > self._max:
            self._pins.popitem(last=False)

    def find(self, tenant: TenantId, response_id: str, now: float) -> Pin | None:
        """Where `tenant`'s response `response_id` is kept; None: not one of its (another tenant's,
        never made here, evicted, or older than the TTL)."""
        self._expire(now)
        return self._pins.get((tenant, response_id))

    def forget(self, tenant: TenantId, response_id: str) -> None:
        self._pins.pop((tenant, response_id), None)

    def _expire(self, now: float) -> None:
        while self._pins:
            key, pin = next(iter(self._pins.items()))
            if now - pin.made_at < self._ttl_s:
                return
            del self._pins[key]
