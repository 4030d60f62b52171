"""The store side of stored responses' pins (`stored`): written by the controller or gateway worker
that served the response, read by every one, through each one's cache, and swept by the leader.

A pin is written before its answer reaches the client (a unary answer's before it is sent, a
stream's before its last byte), so the client's next turn finds it through any controller or
worker; one whose write failed is logged and stays in this process's cache, where this process
alone finds it. A lookup the cache misses reads the store (the reader lane): a restarted
controller, or another worker of `[http] workers`, finds what the others made.
"""

from __future__ import annotations

import logging
import time
from typing import Final, NoReturn

import trio

from nexa.contracts.domain import TenantId
from nexa.control import store as st
from nexa.control.datapath.stored import MAX_STORED_RESPONSES, StoredResponses, response_id_ok
from nexa.errors import NexaError

log = logging.getLogger(__name__)

#: How often the leader deletes expired pins and each tenant's beyond its cap.
SWEEP_INTERVAL_S: Final = 300.0


class Pins:
    """Stored responses' pins: the store's, with this process's cache in front."""

    def __init__(
        self, store: st.Store, *, cache: StoredResponses | None = None, cap: int = MAX_STORED_RESPONSES
    ) -> None:
        self._store = store
        self.cache = cache if cache is not None else StoredResponses()
        self._cap = cap

    async def find(self, tenant: TenantId, response_id: str) -> st.Pin | None:
        """Where `tenant`'s response `response_id` is kept; None: not one of its (another tenant's,
        never stored, expired). Raises the store's errors when it must be read and cannot be."""
        if not response_id_ok(response_id):
            return None
        now = time.time()
        pin = self.cache.find(tenant, response_id, now)
        if pin is None:
            pin = await self._store.read(st.get_stored_response, tenant, response_id, self.cache.made_after(now))
            if pin is not None:
                self.cache.remember(tenant, response_id, pin)
        return pin

    async def remember(self, tenant: TenantId, response_id: str, pin: st.Pin) -> None:
        """Record `tenant`'s response `response_id` (an id no runtime makes is not recorded). A write
        that fails is logged: the pin stays in this process's cache."""
        if not response_id_ok(response_id):
            return
        self.cache.remember(tenant, response_id, pin)
        try:
            await self._store.run(st.save_stored_response, tenant, response_id, pin)
        except NexaError as exc:
            log.warning("recording a stored response failed (%s): only this process will find it", exc.code)

    async def run(
        self, *, interval_s: float = SWEEP_INTERVAL_S, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED
    ) -> NoReturn:
        """The leader's sweep, every `interval_s`: expired pins, then each tenant's oldest beyond its cap."""
        task_status.started()
        while True:
            await self.sweep()
            await trio.sleep(interval_s)

    async def sweep(self) -> int:
        """One sweep (a failure is logged; the next one retries); how many pins went."""
        try:
            deleted = await self._store.prune(st.prune_stored_responses, self.cache.made_after(time.time()))
            deleted += await self._store.run(st.cap_stored_responses, self._cap)
        except NexaError as exc:
            log.warning("sweeping stored responses failed (%s)", exc.code)
            return 0
        if deleted:
            log.info("forgot %d stored responses (expired, or past a tenant's %d)", deleted, self._cap)
        return deleted
