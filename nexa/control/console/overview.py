"""The overview: the fleet's size and free capacity, what serves, queues, recent changes, alerts."""

from __future__ import annotations

from typing import Final

from quart import Blueprint

from nexa.contracts.domain import AuditEvent, NodeState
from nexa.contracts.models import ModelState
from nexa.contracts.usage import QuotaLimits, QuotaUse
from nexa.control import store as st
from nexa.control.console.charts import RequestCharts
from nexa.control.console.pages import Console, Context, View
from nexa.control.console.sessions import Session
from nexa.control.deployments.rollout import breach as rollout_breach

#: Recent audit events the overview lists.
RECENT_EVENTS: Final = 10
#: Audit events read per page while catching up with the chain's tail.
_AUDIT_PAGE: Final = 500
#: The overview's first alert while the controller recovers.
_RECOVERING: Final = (
    "the controller is recovering: it serves reads and inference but refuses changes and pushes nothing to nodes;"
    " see `nexa recovery plan`, end it with `nexa recovery finish` (admin)"
)


class _RecentAudit:
    """The newest audit events; remembers where the tail was, so each look reads only what is new."""

    def __init__(self, store: st.Store) -> None:
        self._store = store
        self._tail = 0

    async def newest(self, count: int) -> list[AuditEvent]:
        events: list[AuditEvent] = []
        after = max(0, self._tail - count)
        while True:
            page = await self._store.read(st.list_audit, st.AuditQuery(after_seq=after, limit=_AUDIT_PAGE))
            events = (events + page)[-count:]
            if len(page) < _AUDIT_PAGE:
                break
            after = page[-1].seq
        if events:
            self._tail = events[-1].seq
        return events[::-1]


def register(bp: Blueprint, console: Console, charts: RequestCharts) -> None:
    state = console.state
    recent = _RecentAudit(state.store)

    async def context(session: Session, now: float) -> Context:
        nodes = list(state.fleet)
        inventories = [n.inventory for n in nodes if n.inventory is not None]
        reachable = [n for n in nodes if n.state is not NodeState.UNREACHABLE and n.state is not NodeState.REVOKED]
        alerts: list[str] = [f"node {n.node.id} is unreachable" for n in nodes if n.state is NodeState.UNREACHABLE]
        if state.recovery is not None and state.recovery.active:
            alerts.insert(0, _RECOVERING)
        for n in nodes:
            alerts += [
                f"replica {s.assignment_id} on {n.node.id} is crash-looping ({s.restarts} restarts)"
                for s in n.statuses
                if s.reason == "crash_loop" or s.restarts >= 3
            ]
        for name, canary in state.deployments.canaries():
            stats = state.meter.window(name, canary=True, seconds=canary.objective.window_s, now=now)
            breach = rollout_breach(canary.objective, stats)
            if breach:
                alerts.append(f"canary of {name} breaches its objective: {breach}")
        for q in state.quotas.all(now).quotas:
            alerts += [f"tenant {q.tenant} is at {pct}% of its {what}" for what, pct in _saturation(q.limits, q.use)]
        admission = state.admission.statistics()
        return {
            "nodes": nodes,
            "by_state": {s: sum(1 for n in nodes if n.state is s) for s in NodeState},
            "memory_total": sum(i.memory_total_bytes for i in inventories),
            "memory_free": sum(n.free_memory_bytes for n in reachable),
            "gpus_total": sum(len(i.gpus) for i in inventories),
            "gpus_free": sum(n.free_accelerators for n in reachable),
            "approved": [m for m in state.models.models() if m.state is ModelState.APPROVED],
            "aliases": state.models.aliases(),
            "deployments": state.deployments.all(),
            "queues": {model: sum(a.waiting.values()) for model, a in admission.models.items()},
            "summary": charts.summary(60),
            "recent": await recent.newest(RECENT_EVENTS),
            "alerts": alerts,
        }

    console.add_view(bp, View("overview", "Overview", ("GET", "/api/v1/nodes"), context))


def _saturation(limits: QuotaLimits, use: QuotaUse) -> list[tuple[str, int]]:
    pairs = (
        ("concurrent requests", limits.concurrent_requests, use.concurrent_requests),
        ("requests per minute", limits.requests_per_minute, use.requests_last_minute),
        ("tokens per minute", limits.tokens_per_minute, use.tokens_last_minute),
        ("tokens per day", limits.tokens_per_day, use.tokens_today),
        ("seconds of audio per day", limits.audio_seconds_per_day, use.audio_seconds_today),
        ("speech characters per day", limits.speech_characters_per_day, use.speech_characters_today),
        ("images per day", limits.images_per_day, use.images_today),
        *(
            (f"tokens per day of adapter {name}", limit, use.adapter_tokens_today.get(name, 0))
            for name, limit in sorted(limits.adapter_tokens_per_day.items())
        ),
    )
    return [(what, round(100 * used / limit)) for what, limit, used in pairs if limit and used >= 0.9 * limit]
