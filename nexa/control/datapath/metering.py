"""Metering: one usage record per finished request, written behind in batches; usage reports.

`record` is on the hot path: it never blocks and never raises. It updates the Prometheus
metrics and the in-memory windows rollouts read (`window`), and queues the record; `run` writes
the queue to the store in one transaction every `metering_flush_s`. A clean shutdown (the run
task cancelled) flushes what is pending, so it loses nothing; a crash loses at most one flush
window of records. Records are metadata only (ids, counts, timings): never prompts or outputs.

No record is dropped for its figures: a token count outside 0..2^31 is clamped into it and a
timing that is not a finite, non-negative number is zeroed before the record is queued, so the
flush never meets a value SQLite cannot bind (an int beyond 2^63 raised OverflowError there).
Each such record is counted in `nexa_usage_records_refused_total{reason}` and logged by id.

Several controllers on one store each meter their own calls, and only the leader prunes
(`leading`): one pruning pass per store, not one per controller racing for the same rows.

Reports group by tenant, model and UTC day in SQL. The model of a row is `name:version` of the
version that served it, or the alias the client asked for when it never resolved to one.
"""

from __future__ import annotations

import bisect
import csv
import io
import itertools
import logging
import math
import time
from collections import deque
from collections.abc import Callable, Collection
from typing import Final

import attrs
import trio

from nexa.config import GatewayConfig
from nexa.contracts.bounds import MAX_TOKENS
from nexa.contracts.gateway import UsageRecord
from nexa.contracts.usage import UsageReport, WatchStats, WindowStats
from nexa.control import store as st
from nexa.errors import NexaError
from nexa.telemetry import INFERENCE_BUCKETS, Children, Metrics

log = logging.getLogger(__name__)

#: How long a clean shutdown may spend writing the last batch, shielded from the cancellation that
#: stops the controller: one transaction of at most a flush window's records, which takes well
#: under a second; 10 s still lets a store briefly busy finish, and bounds one that hangs.
SHUTDOWN_FLUSH_TIMEOUT_S: Final = 10.0
#: Records kept in memory while the store cannot take them; beyond it the oldest are dropped (and logged).
MAX_PENDING: Final = 200_000
#: How far back `window` can look.
WINDOW_KEEP_S: Final = 3600.0
#: At most this many finished requests kept per deployment for `window`.
#: How often records past their retention are deleted; the first time, this long after start.
PRUNE_INTERVAL_S: Final = 3600.0
FIRST_PRUNE_S: Final = 60.0
WINDOW_MAX_RECORDS: Final = 100_000
CSV_HEADER: Final = ("tenant", "model", "day", "requests", "errors", "prompt_tokens", "completion_tokens")
#: Largest token count one figure of a usage record takes (issue 12: 0 … 2^31, as on the wire).
#: Far above any real request, and small enough that sums over years stay within SQLite's int64.
MAX_TOKEN_COUNT: Final = MAX_TOKENS
#: Reasons of `nexa_usage_records_refused_total`.
REFUSED_TOKENS: Final = "tokens_out_of_range"
#: A count above what the request could produce (`usage_bounds`): clamped to that bound.
REFUSED_OVER_REQUEST: Final = "tokens_over_request"
REFUSED_TIMING: Final = "timing_invalid"
REFUSED_BACKLOG: Final = "backlog_full"
#: A runtime's usage object that is not an object of whole counts (the gateway fails the call).
REFUSED_USAGE_SHAPE: Final = "usage_malformed"
#: Upper bounds (seconds) of `MeterStatistics`' latency buckets: the request histograms' own, +Inf last.
LATENCY_BOUNDS_S: Final = (*INFERENCE_BUCKETS, math.inf)


def token_count_ok(value: object) -> bool:
    """Whether `value` is a whole token count a usage record takes: an int (not a bool) in 0..2^31."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_TOKEN_COUNT


def clamp_token_count(value: object) -> int:
    """`value` brought into 0..2^31; anything that is not an int counts 0."""
    if not isinstance(value, int) or isinstance(value, bool):
        return 0
    return min(max(value, 0), MAX_TOKEN_COUNT)


def _finite_non_negative(value: object) -> bool:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return False
    if isinstance(value, int):  # math.isfinite would raise OverflowError past a float's range
        return 0 <= value <= 2**53
    return math.isfinite(value) and value >= 0


def _p95(values: list[float]) -> float | None:
    """Nearest rank: the smallest value at or above 95 % of them; None for none."""
    if not values:
        return None
    values.sort()
    return values[max(0, math.ceil(0.95 * len(values)) - 1)]


@attrs.frozen
class _Finished:
    finished_at: float
    canary: bool
    error: bool
    duration_ms: float
    node_id: str = ""
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    #: The LoRA adapter version it named (`UsageRecord.adapter`, `name:version`); "" for none.
    adapter: str = ""


@attrs.frozen(kw_only=True)
class MeterStatistics:
    """Requests finished since the controller started, all models and tenants together."""

    requests: int
    #: Of those, the ones whose status is not `ok`.
    errors: int
    #: Upper bounds (seconds) of the latency buckets, ascending, +Inf last (`LATENCY_BOUNDS_S`).
    bounds_s: tuple[float, ...]
    #: Requests finished within each bound (cumulative), from acceptance to the last byte.
    duration: tuple[int, ...]
    #: The same to the first output byte, of the requests that produced one.
    ttft: tuple[int, ...]


class Meter:
    """Usage records: metrics and windows at once, the store in batches."""

    def __init__(
        self, cfg: GatewayConfig, store: st.Store, metrics: Metrics, *, leading: Callable[[], bool] | None = None
    ) -> None:
        """`leading`: whether this controller leads now (it alone prunes); None: always (the only one)."""
        self._cfg = cfg
        self._store = store
        self._metrics = metrics
        self._leading = leading if leading is not None else lambda: True
        self._pending: list[UsageRecord] = []
        self._windows: dict[str, deque[_Finished]] = {}
        self._dropped = 0
        self._requests = 0
        self._errors = 0
        self._duration = [0] * len(LATENCY_BOUNDS_S)
        self._ttft = [0] * len(LATENCY_BOUNDS_S)
        # Bound once per label combination, not per request (`telemetry.Children`).
        self._by_status = Children(metrics.gateway_requests)
        self._tokens = Children(metrics.gateway_tokens)
        self._tenant_tokens = Children(metrics.gateway_tenant_tokens)
        self._seconds = Children(metrics.gateway_request_seconds)
        self._ttft_seconds = Children(metrics.gateway_ttft_seconds)
        self._refused = Children(metrics.usage_records_refused)
        self._invalid = Children(metrics.gateway_invalid_answers)

    # ---- the hot path --------------------------------------------------------------------------

    def record(self, rec: UsageRecord) -> None:
        """Account one finished request. Never blocks, never raises, never drops it for its figures.

        Token counts outside 0..MAX_TOKEN_COUNT are clamped into it and timings that are not finite
        and non-negative are zeroed (counted in `nexa_usage_records_refused_total`, logged without
        payload): a record the store or Prometheus would refuse must not be lost, nor stop the flush.
        """
        try:
            rec = self._checked(rec)
        except Exception:  # a record that cannot even be inspected: keep it as it is
            log.exception("could not check the usage record of request %s", rec.request_id)
        self._queue(rec)
        try:
            self._observe_request(rec)
        except Exception:
            # Accounting must never fail a request that has already been answered.
            log.exception("could not update the metrics of request %s", rec.request_id)

    def refused(self, reason: str) -> None:
        """Count one usage figure refused where it entered (the gateway replaced it with its own)."""
        self._refused(reason).inc()

    def invalid_answer(self, kind: str) -> None:
        """Count one runtime answer that was not the expected JSON (`unary`, `stream` or `batch`)."""
        self._invalid(kind).inc()

    def _checked(self, rec: UsageRecord) -> UsageRecord:
        bad = [n for n in ("prompt_tokens", "completion_tokens") if not token_count_ok(getattr(rec, n))]
        timings = [n for n in ("queue_ms", "duration_ms", "finished_at") if not _finite_non_negative(getattr(rec, n))]
        if rec.ttft_ms is not None and not _finite_non_negative(rec.ttft_ms):
            timings.append("ttft_ms")
        if not bad and not timings:
            return rec
        reason = REFUSED_TOKENS if bad else REFUSED_TIMING
        self.refused(reason)
        log.warning(
            "usage record of request %s: %s out of range, metered clamped (%s)",
            rec.request_id,
            ", ".join(bad + timings),
            reason,
        )

        def timing(name: str, value: float) -> float:
            return value if name not in timings else (time.time() if name == "finished_at" else 0.0)

        return attrs.evolve(
            rec,
            prompt_tokens=clamp_token_count(rec.prompt_tokens),
            completion_tokens=clamp_token_count(rec.completion_tokens),
            queue_ms=timing("queue_ms", rec.queue_ms),
            duration_ms=timing("duration_ms", rec.duration_ms),
            finished_at=timing("finished_at", rec.finished_at),
            ttft_ms=None if "ttft_ms" in timings else rec.ttft_ms,
        )

    def _queue(self, rec: UsageRecord) -> None:
        self._pending.append(rec)
        if len(self._pending) > MAX_PENDING:
            del self._pending[0]
            self._dropped += 1
            self.refused(REFUSED_BACKLOG)
            if self._dropped == 1 or self._dropped % 10_000 == 0:
                log.error("the store does not take usage records; %d dropped so far", self._dropped)
        self._metrics.metering_pending.set(len(self._pending))

    def _observe_request(self, rec: UsageRecord) -> None:
        model = rec.alias
        self._by_status(model, rec.tenant, rec.status).inc()
        if rec.prompt_tokens:
            self._tokens(model, "prompt").inc(rec.prompt_tokens)
            self._tenant_tokens(rec.tenant, "prompt").inc(rec.prompt_tokens)
        if rec.completion_tokens:
            self._tokens(model, "completion").inc(rec.completion_tokens)
            self._tenant_tokens(rec.tenant, "completion").inc(rec.completion_tokens)
        self._seconds(model).observe(rec.duration_ms / 1000)
        if rec.ttft_ms is not None:
            self._ttft_seconds(model).observe(rec.ttft_ms / 1000)
        self._requests += 1
        self._errors += rec.status != "ok"
        self._duration[bisect.bisect_left(LATENCY_BOUNDS_S, rec.duration_ms / 1000)] += 1
        if rec.ttft_ms is not None:
            self._ttft[bisect.bisect_left(LATENCY_BOUNDS_S, rec.ttft_ms / 1000)] += 1
        if rec.deployment:
            tpot = None
            if rec.ttft_ms is not None and rec.completion_tokens > 1:
                tpot = max(0.0, rec.duration_ms - rec.ttft_ms) / (rec.completion_tokens - 1)
            finished = _Finished(
                rec.finished_at,
                rec.canary,
                rec.status != "ok",
                rec.duration_ms,
                rec.node_id,
                rec.ttft_ms,
                tpot,
                rec.adapter,
            )
            self._observe(rec.deployment, finished)

    def attempt_failed(
        self, deployment: str, *, canary: bool, duration_ms: float, now: float, node_id: str = "", adapter: str = ""
    ) -> None:
        """An attempt on a replica that failed before any output and was retried elsewhere: no usage
        record (the request's own record names where it ended), but it counts against the replica's
        deployment in the windows a canary (and a rollout's new replica, by `node_id`, and a new
        adapter version, by `adapter`) is judged by."""
        self._observe(deployment, _Finished(now, canary, True, duration_ms, node_id, adapter=adapter))

    def _observe(self, deployment: str, finished: _Finished) -> None:
        window = self._windows.get(deployment)
        if window is None:
            window = self._windows[deployment] = deque(maxlen=WINDOW_MAX_RECORDS)
        window.append(finished)
        while window and window[0].finished_at < finished.finished_at - WINDOW_KEEP_S:
            window.popleft()

    # ---- writing behind ------------------------------------------------------------------------

    async def run(self, *, task_status: trio.TaskStatus[None] = trio.TASK_STATUS_IGNORED) -> None:
        """Flush every `metering_flush_s` until cancelled; then flush what is left (shielded, bounded).
        Prune past `usage_retention_s` every PRUNE_INTERVAL_S while this controller leads."""
        task_status.started()
        next_prune = trio.current_time() + FIRST_PRUNE_S
        try:
            while True:
                await trio.sleep(self._cfg.metering_flush_s)
                await self._flush_logged()
                if trio.current_time() >= next_prune:
                    if self._leading():
                        next_prune = trio.current_time() + PRUNE_INTERVAL_S
                        await self._prune()
                    else:  # a follower looks again soon: it may lead by then
                        next_prune = trio.current_time() + FIRST_PRUNE_S
        finally:
            with trio.move_on_after(SHUTDOWN_FLUSH_TIMEOUT_S, shield=True) as final:
                await self._flush_logged()
            if final.cancelled_caught:
                log.error("the last usage flush took over %.0f s and was cut short", SHUTDOWN_FLUSH_TIMEOUT_S)
            if self._pending:
                log.error("shutting down with %d usage records not written", len(self._pending))

    async def _prune(self) -> None:
        """Delete usage records past `usage_retention_s` (a failure is logged; the next hour retries)."""
        try:
            deleted = await self._store.prune(st.prune_usage, time.time() - self._cfg.usage_retention_s)
        except NexaError as exc:
            log.warning("pruning usage records failed (%s)", exc.code)
            return
        if deleted:
            log.info("pruned %d usage records older than %.0f days", deleted, self._cfg.usage_retention_s / 86400)

    async def _flush_logged(self) -> None:
        try:
            await self.flush()
        except NexaError as exc:
            log.warning("writing usage records failed (%s); they stay queued", exc.code)

    async def flush(self) -> int:
        """Write every pending record in one transaction; returns how many. On failure they stay queued."""
        batch, self._pending = self._pending, []
        if not batch:
            return 0
        start = trio.current_time()
        try:
            await self._store.run(st.insert_usage, batch)
        except BaseException:
            self._pending[:0] = batch
            raise
        finally:
            self._metrics.metering_pending.set(len(self._pending))
        self._metrics.metering_flush_seconds.observe(trio.current_time() - start)
        return len(batch)

    # ---- reading -------------------------------------------------------------------------------

    def statistics(self) -> MeterStatistics:
        return MeterStatistics(
            requests=self._requests,
            errors=self._errors,
            bounds_s=LATENCY_BOUNDS_S,
            duration=tuple(itertools.accumulate(self._duration)),
            ttft=tuple(itertools.accumulate(self._ttft)),
        )

    async def usage(
        self,
        *,
        since: float,
        until: float,
        tenant: str | None = None,
        model: str | None = None,
        after: st.UsageKey | None = None,
        limit: int | None = None,
    ) -> UsageReport:
        """Usage in [since, until) by tenant, model (`name:version`) and UTC day; flushes first.
        `after`/`limit`: at most `limit` groups after that (day, tenant, model) one; all by default."""
        await self.flush()
        rows = await self._store.run(st.usage_report, since, until, tenant, model, after, limit)
        return UsageReport(since=since, until=until, rows=rows)

    @staticmethod
    def to_csv(report: UsageReport) -> str:
        out = io.StringIO()
        writer = csv.writer(out, lineterminator="\r\n")
        writer.writerow(CSV_HEADER)
        for row in report.rows:
            writer.writerow(
                (row.tenant, row.model, row.day, row.requests, row.errors, row.prompt_tokens, row.completion_tokens)
            )
        return out.getvalue()

    def window(self, deployment: str, *, canary: bool | None, seconds: float, now: float) -> WindowStats:
        """Requests of `deployment` finished in (now - seconds, now]: all (canary None), or one group's."""
        since = now - seconds
        durations: list[float] = []
        errors = 0
        for f in self._windows.get(deployment, ()):
            if since < f.finished_at <= now and (canary is None or f.canary == canary):
                durations.append(f.duration_ms)
                errors += f.error
        if not durations:
            return WindowStats(requests=0, errors=0, p95_ms=None)
        durations.sort()
        # Nearest rank: the smallest duration at or above 95 % of the requests.
        p95 = durations[max(0, math.ceil(0.95 * len(durations)) - 1)]
        return WindowStats(requests=len(durations), errors=errors, p95_ms=p95)

    def nodes_window(self, deployment: str, nodes: Collection[str], *, since: float, now: float) -> WatchStats:
        """Requests of `deployment` served on `nodes` (attempts that failed there included) that
        finished in (since, now], wall clock: what a rollout's watch holds a new replica to."""
        picked = [f for f in self._windows.get(deployment, ()) if since < f.finished_at <= now and f.node_id in nodes]
        return _watch_stats(picked)

    def adapters_window(self, deployment: str, adapters: Collection[str], *, since: float, now: float) -> WatchStats:
        """Requests of `deployment` that named one of `adapters` (`name:version`; attempts that
        failed included) and finished in (since, now]: what an adapter rollout in place is held to."""
        window = self._windows.get(deployment, ())
        return _watch_stats([f for f in window if since < f.finished_at <= now and f.adapter in adapters])


def _watch_stats(picked: list[_Finished]) -> WatchStats:
    """The figures a rollout's watch judges, of the finished requests `picked`."""
    return WatchStats(
        requests=len(picked),
        errors=sum(f.error for f in picked),
        p95_ms=_p95([f.duration_ms for f in picked]),
        ttft_p95_ms=_p95([f.ttft_ms for f in picked if f.ttft_ms is not None]),
        tpot_p95_ms=_p95([f.tpot_ms for f in picked if f.tpot_ms is not None]),
    )
