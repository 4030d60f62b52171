"""Which replica keeps each stored Responses API response, so a later turn reaches it: the rules
and the in-memory cache. Pure: no I/O, no trio; the caller gives the time.

A runtime that keeps responses (vLLM with `VLLM_ENABLE_RESPONSES_API_STORE=1`:
`Adapter.keeps_responses`) keeps them in its own memory; another replica of the same model
knows nothing of them. For each response a keeping replica answered, the gateway records the
tenant that asked and the replica (`Pin`), in the store, where every controller and gateway worker
finds it (`pins.Pins`, the I/O), and routes a request naming it — as `previous_response_id`, or
in the path of its own routes (`STORED_ROUTES`) — to that replica alone (`Work.pin`). A pin lives
`STORED_RESPONSE_TTL_S` after it was made, and a tenant has at most `MAX_STORED_RESPONSES`: one
not found answers `ResponseNotFound`, and the client resends the conversation as input items.
State is per tenant: another tenant's id is not found, never routed.

`StoredResponses` is each process's cache of pins it made or read (bounded in entries and age),
so a hot conversation does not read the store each turn: a pin never changes once made, so a
cached one is as good as the store's until it expires.
"""

from __future__ import annotations

import collections
import re
from typing import Final

import attrs

from nexa.contracts.domain import TenantId
from nexa.contracts.wire import RuntimeMethod
from nexa.control.store.responses import Pin

#: Stored responses a tenant has at most (its oldest go first, at the leader's sweep).
MAX_STORED_RESPONSES: Final = 100_000
#: How long one is found after it was made (seconds): a day.
STORED_RESPONSE_TTL_S: Final = 86_400.0
#: Pins a process caches at most (the oldest go first).
MAX_CACHED_PINS: Final = 10_000
#: The longest response id remembered (vLLM's are `resp_` and 32 hex digits).
MAX_RESPONSE_ID_CHARS: Final = 256
#: A response id nexa records and routes: letters, digits, `_` and `-` (a path segment as it is).
_RESPONSE_ID: Final = re.compile(rf"[A-Za-z0-9_\-]{{1,{MAX_RESPONSE_ID_CHARS}}}")


def response_id_ok(response_id: str) -> bool:
    """Whether `response_id` is one nexa records and routes (no runtime makes another)."""
    return _RESPONSE_ID.fullmatch(response_id) is not None


@attrs.frozen(kw_only=True)
class StoredRoute:
    """One of OpenAI's routes on a stored response (`/v1/responses/<response_id>…`) and whether
    the runtimes that keep responses serve it (vLLM's own router, `STORED_ROUTES`)."""

    method: RuntimeMethod
    #: The route's rest after `/v1/responses/<response_id>` ("" or `/cancel`, `/input_items`).
    suffix: str
    #: The SDK call that makes it.
    sdk: str
    served: bool
    #: What to do instead, when it is not served.
    instead: str = ""


#: What vLLM serves of a stored response (vllm/entrypoints/openai/responses/api_router.py, read at
#: f6e93254: `GET /v1/responses/{response_id}` and `POST /v1/responses/{response_id}/cancel` only;
#: `OpenAIServingResponses.retrieve_responses`/`cancel_responses` in serving.py, read at 4d89a999).
STORED_ROUTES: Final = (
    StoredRoute(method=RuntimeMethod.GET, suffix="", sdk="responses.retrieve", served=True),
    StoredRoute(method=RuntimeMethod.POST, suffix="/cancel", sdk="responses.cancel", served=True),
    StoredRoute(
        method=RuntimeMethod.DELETE,
        suffix="",
        sdk="responses.delete",
        served=False,
        instead=(
            "the runtime keeping it (vLLM) cannot delete a stored response: it keeps it in its memory until the"
            " replica stops, and nexa routes to it for a day; send store: false to keep none"
        ),
    ),
    StoredRoute(
        method=RuntimeMethod.GET,
        suffix="/input_items",
        sdk="responses.input_items.list",
        served=False,
        instead=(
            "the runtime keeping it (vLLM) does not list a stored response's input items: keep the input you"
            " sent, or retrieve the response (GET /v1/responses/{id}) for its output"
        ),
    ),
)


class StoredResponses:
    """(tenant, response id) → `Pin`, at most `max_entries`, each until `ttl_s` after it was made."""

    def __init__(self, *, max_entries: int = MAX_CACHED_PINS, ttl_s: float = STORED_RESPONSE_TTL_S) -> None:
        self._max = max_entries
        self._ttl_s = ttl_s
        #: Least recently used first.
        self._pins: collections.OrderedDict[tuple[TenantId, str], Pin] = collections.OrderedDict()

    def __len__(self) -> int:
        return len(self._pins)

    def remember(self, tenant: TenantId, response_id: str, pin: Pin) -> None:
        """`tenant`'s response `response_id` is kept by `pin`'s replica (an id no runtime makes is not kept)."""
        if not response_id_ok(response_id):
            return
        key = (tenant, response_id)
        self._pins.pop(key, None)
        self._pins[key] = pin
        while len(self._pins) > self._max:
            self._pins.popitem(last=False)

    def find(self, tenant: TenantId, response_id: str, now: float) -> Pin | None:
        """Where `tenant`'s response `response_id` is kept, as cached; None: not cached (another
        tenant's, never seen here, evicted) or older than the TTL."""
        key = (tenant, response_id)
        pin = self._pins.get(key)
        if pin is None:
            return None
        if now - pin.made_at >= self._ttl_s:
            del self._pins[key]
            return None
        self._pins.move_to_end(key)
        return pin

    def forget(self, tenant: TenantId, response_id: str) -> None:
        self._pins.pop((tenant, response_id), None)

    def made_after(self, now: float) -> float:
        """The oldest `made_at` still found at `now`."""
        return now - self._ttl_s
