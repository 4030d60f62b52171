"""Metrics and logs. The only prometheus_client importer; log handlers are set up from cli.py only.

Logs are JSON lines on stderr carrying metadata (ids, sizes, timings, status), never request or
response bodies. A contextvar holds the current request id; a filter adds it to every record.
"""

from __future__ import annotations

import contextvars
import json
import logging
import sys
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info
from prometheus_client.exposition import CONTENT_TYPE_LATEST, generate_latest

#: The request (or workload) id of the task that is logging; trio tasks inherit it.
request_id: Final[contextvars.ContextVar[str | None]] = contextvars.ContextVar("nexa_request_id", default=None)

METRICS_CONTENT_TYPE: Final = CONTENT_TYPE_LATEST

_LATENCY_BUCKETS: Final = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
#: Inference takes from milliseconds (embeddings) to minutes (long generations, queueing).
_INFERENCE_BUCKETS: Final = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class Metrics:
    """Owns one CollectorRegistry and defines every metric nexa exports."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.build_info = Info("nexa_build", "Version of the running nexa binary.", registry=r)
        self.controller_epoch = Gauge(
            "nexa_controller_epoch", "Durable epoch this controller process took at start.", registry=r
        )
        self.http_requests = Counter(
            "nexa_http_requests",
            "HTTP requests answered, by route template, method and status.",
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
        self.auth_failures = Counter(
            "nexa_auth_failures", "Requests refused by authentication or role checks.", ["code"], registry=r
        )
        self.audit_events = Counter(
            "nexa_audit_events", "Audit events appended to the chain, by result.", ["result"], registry=r
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
            "Node channel messages refused (bad signature, replay, clock skew, wrong or unknown node).",
            ["reason"],
            registry=r,
        )
        self.assignment_pushes = Counter("nexa_assignment_pushes", "Signed assignment sets sent to nodes.", registry=r)
        self.assignment_acks = Counter(
            "nexa_assignment_acks", "Node answers to assignment sets, by result.", ["result"], registry=r
        )
        self._gateway_metrics(r)

    def _gateway_metrics(self, r: CollectorRegistry) -> None:
        # `model` is the alias (or `name:version`) the client asked for: stable across rollouts.
        # Only the requests counter carries `tenant` (tenants are few; operators want their usage).
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
        self.gateway_request_seconds = Histogram(
            "nexa_gateway_request_duration_seconds",
            "Time from acceptance to the last byte of the answer, queueing included.",
            ["model"],
            buckets=_INFERENCE_BUCKETS,
            registry=r,
        )
        self.gateway_ttft_seconds = Histogram(
            "nexa_gateway_time_to_first_token_seconds",
            "Time from acceptance to the first output byte.",
            ["model"],
            buckets=_INFERENCE_BUCKETS,
            registry=r,
        )
        self.gateway_queue_seconds = Histogram(
            "nexa_gateway_queue_seconds",
            "Time requests waited in admission for a slot (granted ones only).",
            ["model"],
            buckets=_INFERENCE_BUCKETS,
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
        self.metering_flush_seconds = Histogram(
            "nexa_metering_flush_duration_seconds",
            "Time each batch of usage records took to write.",
            buckets=_LATENCY_BUCKETS,
            registry=r,
        )
        self.metering_pending = Gauge(
            "nexa_metering_pending", "Usage records waiting to be written to the store.", registry=r
        )

    def render(self) -> bytes:
        return generate_latest(self.registry)


class _RequestIdFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = request_id.get()
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object per line. Extra fields come from `extra={"fields": {...}}` only."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
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
