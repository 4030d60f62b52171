"""Automatic canary rollback: a loop that compares each running canary with its objective.

Every `interval_s` the watcher asks the meter (`WindowSource`, fed by the gateway's metering of
finished requests) for the canary replicas' figures over the objective's window, never reaching
back before the canary started (an earlier canary's requests are not this one's). When the
window holds at least `min_requests` requests and the error rate is above `max_error_rate`, or
a `max_p95_ms` is set and the p95 latency is above it, the canary's replicas are removed
(`Deployments.drop_canary`), audited as `deployment.canary.auto_rollback` by the controller
itself with the figures that triggered it in the event's detail, and logged (figures only;
no payload ever reaches this module). Fewer requests decide nothing.

Promotion stays an operator's decision: a canary within its objective is left running.
"""

from __future__ import annotations

import logging
import time
from typing import Final, Protocol

import trio

from nexa.contracts.deployments import Canary, CanaryObjective
from nexa.contracts.domain import SYSTEM
from nexa.contracts.usage import WindowStats
from nexa.control.deployments import Deployments

log = logging.getLogger(__name__)

#: The audit action of an automatic rollback.
AUTO_ROLLBACK: Final = "deployment.canary.auto_rollback"


class WindowSource(Protocol):
    """Finished requests of a deployment over a recent window (`nexa.control.datapath.metering.Meter`)."""

    def window(self, deployment: str, *, canary: bool | None, seconds: float, now: float) -> WindowStats:
        """`canary`: True for its canary replicas, False for the others, None for all (wall clock `now`)."""
        ...


def breach(objective: CanaryObjective, stats: WindowStats) -> str | None:
    """What in `stats` breaks `objective`; None when it holds, or when the window has too few requests."""
    if stats.requests < objective.min_requests:
        return None
    broken = []
    if stats.error_rate > objective.max_error_rate:
        broken.append(f"error rate {stats.error_rate:.4f} > {objective.max_error_rate:g}")
    if objective.max_p95_ms is not None and stats.p95_ms is not None and stats.p95_ms > objective.max_p95_ms:
        broken.append(f"p95 {stats.p95_ms:.1f} ms > {objective.max_p95_ms:g} ms")
    return " and ".join(broken) or None


def figures(objective: CanaryObjective, stats: WindowStats, seconds: float) -> str:
    """The figures an automatic rollback is audited with: the window's, then the objective's."""
    p95 = "-" if stats.p95_ms is None else f"{stats.p95_ms:.1f} ms"
    max_p95 = "-" if objective.max_p95_ms is None else f"{objective.max_p95_ms:g} ms"
    return (
        f"over {seconds:.1f} s: requests {stats.requests}, errors {stats.errors}, "
        f"error rate {stats.error_rate:.4f}, p95 {p95}; objective: max error rate {objective.max_error_rate:g}, "
        f"max p95 {max_p95}, window {objective.window_s:g} s, min requests {objective.min_requests}"
    )


class RolloutWatcher:
    """Rolls back canaries that break their objective (see the module docstring)."""

    def __init__(self, deployments: Deployments, meter: WindowSource, *, interval_s: float = 1.0) -> None:
        self._deployments = deployments
        self._meter = meter
        self._interval_s = interval_s

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        while True:
            await self.check()
            await trio.sleep(self._interval_s)

    async def check(self) -> list[str]:
        """One look at every running canary; the deployments whose canary was rolled back."""
        rolled_back: list[str] = []
        if self._deployments.recovering:
            return rolled_back  # no change while the controller recovers; the next look after it
        for name, canary in self._deployments.canaries():
            if await self._check_one(name, canary):
                rolled_back.append(name)
        return rolled_back

    async def _check_one(self, name: str, canary: Canary) -> bool:
        objective = canary.objective
        now = time.time()
        seconds = min(objective.window_s, now - canary.started_at)
        if seconds <= 0:
            return False
        stats = self._meter.window(name, canary=True, seconds=seconds, now=now)
        why = breach(objective, stats)
        if why is None:
            return False
        detail = f"broke its objective ({why}) {figures(objective, stats, seconds)}"
        if not await self._deployments.drop_canary(SYSTEM, name, canary, action=AUTO_ROLLBACK, detail=detail):
            return False  # promoted, rolled back or replaced meanwhile
        log.warning("deployment %s: canary %s rolled back automatically: %s", name, canary.model.key, detail)
        return True
