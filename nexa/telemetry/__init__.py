"""Metrics and logs. The only prometheus_client importer; log handlers are set up from cli.py only.

Logs are JSON lines on stderr carrying metadata (ids, sizes, timings, status), never request or
response bodies. A contextvar holds the current request id; a filter adds it to every record.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
from collections.abc import Callable, Iterable, Sequence
from typing import Final, Generic, TypeVar

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

from nexa.telemetry.fleet import FleetCollector, NodeFigures

#: The request (or workload) id of the task that is logging; trio tasks inherit it.
request_id: Final[contextvars.ContextVar[str | None]] = contextvars.ContextVar("nexa_request_id", default=None)

METRICS_CONTENT_TYPE: Final = CONTENT_TYPE_LATEST

_LATENCY_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: Inference takes from milliseconds (embeddings) to minutes (long generations, queueing); the
#: request histograms use them, and so do `Meter.statistics` (the console's charts).
INFERENCE_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
#: nexa's own time in one response (`x-nexa-overhead-ms`): from 50 µs to a second.
OVERHEAD_BUCKETS: Final = (5e-5, 1e-4, 2.5e-4, 5e-4, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


_M = TypeVar("_M", Counter, Gauge, Histogram)
#: Label combinations one `Children` keeps bound (beyond it, it starts over: a cache, never a leak).
MAX_CHILDREN: Final = 4096


class Children(Generic[_M]):
    """`metric.labels(*values)`, bound once per combination of label values and kept.

    prometheus_client's `labels` converts every value and looks the child up behind a lock on
    every call; on the request path the same few combinations (model, tenant, status, route) come
    back every time, so the child is kept here, in a plain dict of at most `MAX_CHILDREN`.
    """

    def __init__(self, metric: _M) -> None:
        self._metric: _M = metric
        self._bound: dict[tuple[str, ...], _M] = {}

    def __call__(self, *values: str) -> _M:
        child = self._bound.get(values)
        if child is None:
            if len(self._bound) >= MAX_CHILDREN:
                self._bound.clear()
            child = self._bound[values] = self._metric.labels(*values)
        return child


class Metrics:
    """Owns one CollectorRegistry and defines every metric nexa exports."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.fleet: FleetCollector | None = None
        r = self.registry
        self.build_info = Info("nexa_build", "Version of the running nexa binary.", registry=r)
        self.controller_epoch = Gauge(
            "nexa_controller_epoch", "Durable epoch this controller process took at start.", registry=r
        )
        self.controller_role = Gauge(
            "nexa_controller_role",
            "1 while this controller leads (reconciles and signs desired state), 0 while it follows;"
            " the embedded store's only controller always leads.",
            registry=r,
        )
        self.forwarded_requests = Counter(
            "nexa_forwarded_requests",
            "Management requests a follower passed to the leader, by result: ok (the leader's answer relayed,"
            " whatever its status), no_leader (no lease holder known), loop (forwarded already), leader_unreachable"
            " (not sent), leader_lost (sent, no answer), answer_cut (the answer stopped midway), too_large,"
            " client_gone, plain_http_refused (a leader on another host over plain http), leader_untrusted"
            " (its certificate did not verify).",
            ["result"],
            registry=r,
        )
        self.controller_recovering = Gauge(
            "nexa_controller_recovering",
            "1 while the controller is recovering (reconciliation only: writes refused, nothing pushed), else 0.",
            registry=r,
        )
        self.http_requests = Counter(
            "nexa_http_requests",
            "HTTP requests answered, by route template, method (GET, HEAD, POST, PUT, PATCH, DELETE, OPTIONS,"
            " other) and status.",
            ["route", "method", "status"],
            registry=r,
        )
        self.http_request_seconds = Histogram(
            "nexa_http_request_duration_seconds",
            "Time from request start to the last response byte handed to the server.",
            ["route", "method"],
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.http_in_flight = Gauge("nexa_http_requests_in_flight", "HTTP requests being handled.", registry=r)
        self.credential_reload_failures = Counter(
            "nexa_credential_reload_failures",
            "Credentials files that changed but could not be read; the last good credentials stay in use.",
            ["file"],
            registry=r,
        )
        self.auth_failures = Counter(
            "nexa_auth_failures", "Requests refused by authentication or role checks.", ["code"], registry=r
        )
        self.audit_events = Counter(
            "nexa_audit_events", "Audit events appended to the chain, by result.", ["result"], registry=r
        )
        self.audit_denied_suppressed = Counter(
            "nexa_audit_denied_suppressed",
            "Denied requests not written to the audit chain because the same key was denied the same"
            " route less than the rate-limit window ago; the next event written carries the count. By action.",
            ["action"],
            registry=r,
        )
        self.store_transaction_seconds = Histogram(
            "nexa_store_transaction_duration_seconds",
            "Time each store transaction took, queueing for the store lane included.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.api_keys = Gauge("nexa_api_keys", "Active API keys by role.", ["role"], registry=r)
        self.nodes = Gauge("nexa_nodes", "Enrolled nodes by state.", ["state"], registry=r)
        self.node_messages = Counter(
            "nexa_node_messages", "Verified messages received from nodes, by kind.", ["kind"], registry=r
        )
        self.node_messages_rejected = Counter(
            "nexa_node_messages_rejected",
            "Node channel messages refused, by reason: bad_signature, replayed, clock_skew, wrong_node,"
            " unknown_key, unauthenticated, rate_limited (signed messages above the node's rate), malformed"
            " (not the wire contract: bad JSON, depth, sizes, numbers, unknown kinds), stale_ack,"
            " control_backlog (the control loop that far behind), needs_reenrollment (a node that pins only"
            " a retired controller key), unproven_epoch (an epoch claim above what the controller issued,"
            " without the signed set behind it: the claim is ignored), and on the data path unknown_stream"
            " (no open stream of that node), oversized_chunk, stream_overflow; message_too_large (over the"
            " channel's size limit: dropped, the connection kept).",
            ["reason"],
            registry=r,
        )
        self.channel_disconnects = Counter(
            "nexa_channel_disconnects",
            "Node channel connections closed under an enrolled node: it left or went silent, or libzmq dropped"
            " it (a message over 4 times the channel's limit, a protocol error). By node: `nexa nodes show`.",
            registry=r,
        )
        self.node_store_writes_deferred = Counter(
            "nexa_node_store_writes_deferred",
            "Store writes a node's messages would have caused above its rate (channel.node_store_writes_per_s),"
            " by kind (inventory, ack): the newest state is kept in memory and written with a later message.",
            ["kind"],
            registry=r,
        )
        self.assignment_pushes = Counter("nexa_assignment_pushes", "Signed assignment sets sent to nodes.", registry=r)
        self.assignment_acks = Counter(
            "nexa_assignment_acks", "Node answers to assignment sets, by result.", ["result"], registry=r
        )
        self.group_ready = Gauge(
            "nexa_group_ready",
            "Each replica group (one model over several nodes; `group` is its replica id): 1 while it serves"
            " (its head Ready, its workers too), 0 while it is pending, starting or restarting.",
            ["deployment", "group"],
            registry=r,
        )
        self.group_restarts = Counter(
            "nexa_group_restarts",
            "Times a replica group was stopped whole and started again: a member failed, was restarted by"
            " its node, or its node was lost.",
            ["deployment", "group"],
            registry=r,
        )
        self._gateway_metrics(r)
        self.backup_last_success = Gauge(
            "nexa_backup_last_success_timestamp_seconds",
            "Unix time of the newest backup written to backup.dir (0: none yet).",
            registry=r,
        )
        self.backup_failures = Counter("nexa_backup_failures", "Scheduled backups that failed.", registry=r)
        self.backup_interval = Gauge(
            "nexa_backup_interval_seconds",
            "backup.interval_s: seconds between scheduled backups (0: none).",
            registry=r,
        )
        self.backup_size = Gauge("nexa_backup_size_bytes", "Size of the newest backup written.", registry=r)
        self.loop_failures = Counter(
            "nexa_loop_failures",
            "Failures of supervised long-running loops (each is logged and the loop restarted), by loop.",
            ["loop"],
            registry=r,
        )
        self.event_loop_stalls = Counter(
            "nexa_event_loop_stalls",
            "Times the controller's event loop ran no task for 1 s or more (each is logged with where it was).",
            registry=r,
        )
        self.retention_writes = Counter(
            "nexa_retention_writes",
            "Retained payloads: written (ok), given up (failed), or refused before running (busy), by result.",
            ["result"],
            registry=r,
        )
        self.retention_purged = Counter(
            "nexa_retention_purged", "Retained payloads purged, at their TTL or on demand.", registry=r
        )
        self.rollout_reverts = Counter(
            "nexa_rollout_reverts",
            "Rollouts reverted because a new replica broke the deployment's objectives, by deployment.",
            ["deployment"],
            registry=r,
        )

    def count_stall(self, _seconds: float) -> None:
        """`supervision.watch_event_loop`'s report of one stall of the event loop."""
        self.event_loop_stalls.inc()

    def _gateway_metrics(self, r: CollectorRegistry) -> None:
        # `model` is the alias (or `name:version`) the client asked for: stable across rollouts.
        # Only the requests counter and the tenant tokens carry `tenant` (tenants are few, made by
        # operators; they want their usage).
        self.gateway_requests = Counter(
            "nexa_gateway_requests",
            "Finished inference requests, by requested model, tenant and status (`ok` or the error code).",
            ["model", "tenant", "status"],
            registry=r,
        )
        self.gateway_tokens = Counter(
            "nexa_gateway_tokens",
            "Tokens of finished requests, by model and kind (prompt, completion).",
            ["model", "kind"],
            registry=r,
        )
        self.gateway_tenant_tokens = Counter(
            "nexa_gateway_tenant_tokens",
            "Tokens of finished requests, by tenant and kind (prompt, completion): the dashboard's tenants row.",
            ["tenant", "kind"],
            registry=r,
        )
        self.gateway_request_seconds = Histogram(
            "nexa_gateway_request_duration_seconds",
            "Time from acceptance to the last byte of the answer, queueing included.",
            ["model"],
            buckets=INFERENCE_BUCKETS,
            registry=r,
        )
        self.gateway_ttft_seconds = Histogram(
            "nexa_gateway_time_to_first_token_seconds",
            "Time from acceptance to the first output byte.",
            ["model"],
            buckets=INFERENCE_BUCKETS,
            registry=r,
        )
        self.gateway_queue_seconds = Histogram(
            "nexa_gateway_queue_seconds",
            "Time requests waited in admission for a slot (granted ones only).",
            ["model"],
            buckets=INFERENCE_BUCKETS,
            registry=r,
        )
        self.gateway_overhead_seconds = Histogram(
            "nexa_gateway_overhead_seconds",
            "nexa's own time in each inference response, as its x-nexa-overhead-ms header says: the"
            " controller's time outside admission queueing and the waits for the node, plus the node's"
            " time outside the runtime (streams: up to the response head). By model.",
            ["model"],
            buckets=OVERHEAD_BUCKETS,
            registry=r,
        )
        self.gateway_queue_depth = Gauge(
            "nexa_gateway_queue_depth",
            "Requests waiting in admission, by model and priority.",
            ["model", "priority"],
            registry=r,
        )
        self.gateway_quota_refusals = Counter(
            "nexa_gateway_quota_refusals", "Requests refused by a tenant quota, by limit.", ["limit"], registry=r
        )
        self.gateway_queue_displaced = Counter(
            "nexa_gateway_queue_displaced",
            "Queued requests that gave their place to another tenant's (their tenant held more than its share).",
            ["model"],
            registry=r,
        )
        self.metering_flush_seconds = Histogram(
            "nexa_metering_flush_duration_seconds",
            "Time each batch of usage records took to write.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.metering_pending = Gauge(
            "nexa_metering_pending", "Usage records waiting to be written to the store.", registry=r
        )
        self.usage_records_refused = Counter(
            "nexa_usage_records_refused",
            "Usage figures refused where they entered the controller (a token count outside 0..2^31, a"
            " timing that is not a finite number, a node's overhead figure outside 0..60000 ms: ignored),"
            " by reason. The call is still metered, with the controller's own estimate (from a node) or the"
            " figure clamped into range (in metering).",
            ["reason"],
            registry=r,
        )
        self.gateway_invalid_answers = Counter(
            "nexa_gateway_invalid_answers",
            "Runtime answers that were not the expected JSON, by kind (unary, stream, batch); each"
            " affected caller got runtime_failed.",
            ["kind"],
            registry=r,
        )
        self.wake_seconds = Histogram(
            "nexa_wake_seconds",
            "Time a sleeping deployment took to wake (asleep to a Ready replica), by deployment; requests"
            " for it waited as long (within their deadline).",
            ["deployment"],
            buckets=INFERENCE_BUCKETS,
            registry=r,
        )
        self.deployment_sleeps = Counter(
            "nexa_deployment_sleeps",
            "Deployments put to sleep, by deployment and reason (idle, operator, swap: swap on demand).",
            ["deployment", "reason"],
            registry=r,
        )
        self.wake_refused = Counter(
            "nexa_wake_refused",
            "Requests for a sleeping deployment refused with deadline_exceeded: their deadline was shorter"
            " than the wake (nothing charged).",
            ["deployment"],
            registry=r,
        )

    def export_fleet(self, figures: Callable[[], Iterable[NodeFigures]]) -> None:
        """Export the fleet's GPU, node and runtime series (`telemetry.fleet`), made from `figures()`."""
        self.fleet = FleetCollector(figures)
        self.registry.register(self.fleet)

    def render(self, fleet: Sequence[NodeFigures] | None = None) -> bytes:
        """The exposition text. `fleet`: a snapshot of the fleet's figures taken on the event loop,
        exported instead of asking for them, so this may run on a worker thread."""
        if fleet is None or self.fleet is None:
            return generate_latest(self.registry)
        with self.fleet.pinned(fleet):
            return generate_latest(self.registry)


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line. Extra fields come from `extra={"fields": {...}}` only, and from
    `stamped` (`stamp_logs`: on every line of the process)."""

    def __init__(self) -> None:
        super().__init__()
        self.stamped: dict[str, object] = {}

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **self.stamped,
        }
        rid = getattr(record, "request_id", None)
        if rid:
            out["request_id"] = rid
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, separators=(",", ":"))


def stamp_logs(**fields: object) -> None:
    """Put `fields` on every line this process logs from now on (after `setup_logging`): a gateway
    worker's `worker` and `pid`, since every worker writes to the stderr of `nexa control`."""
    for handler in logging.getLogger().handlers:
        if isinstance(handler.formatter, JsonFormatter):
            handler.formatter.stamped.update(fields)


def setup_logging(level: str) -> None:
    """Install the JSON stderr handler on the root logger. Called once, from cli.py."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    handler.addFilter(_RequestIdFilter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level.upper())
    # hypercorn's own access log would duplicate ours; its error log stays.
    logging.getLogger("hypercorn.access").disabled = True
    # httpx logs every request (podman, S3) at INFO: too loud for a node's journal.
    for noisy in ("httpx", "httpcore"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))
