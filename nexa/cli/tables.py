"""The list and show commands that share a shape, as one table: (path, view type, columns).

A `View` says how one contract type prints as a table row. A `Listing` is `nexa RESOURCE list`:
GET a path, decode the page, print its items as a view (`--json`: the page as the server sent
it); one that can grow takes `--cursor` and `--limit` and says on stderr how to get the next page.
A `Show` is one resource GET by name and printed as one row.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, Final, Generic, TypeVar

import attrs

from nexa import adapters
from nexa.cli import common
from nexa.cli.output import Cells, emit, gib, print_more, ref, size_text
from nexa.contracts.api import AuditPage, KeyList, KeyView, NodeList, NodeView, TenantList, TenantView
from nexa.contracts.backup import BackupList, BackupView
from nexa.contracts.deployments import DeploymentList, DeploymentView
from nexa.contracts.domain import AuditEvent
from nexa.contracts.evidence import BenchRun, BenchRunList, Job, JobList
from nexa.contracts.gateway import WorkloadList, WorkloadView
from nexa.contracts.groups import FabricAccess
from nexa.contracts.models import AliasList, AliasRecord, ModelList, ModelRecord, RuntimeList, RuntimeRecord
from nexa.contracts.node import NodeInventory
from nexa.contracts.usage import QuotaList, QuotaView, UsageRow

T = TypeVar("T")
P = TypeVar("P")

EXIT_OK: Final = 0


@attrs.frozen(kw_only=True)
class View(Generic[T]):
    """How one contract type prints: its columns, and the cells of one value."""

    columns: tuple[str, ...]
    row: Callable[[T], Cells]

    def rows(self, items: Iterable[T]) -> list[Cells]:
        return [self.row(item) for item in items]

    def emit(self, args: argparse.Namespace, answer: object, items: Iterable[T]) -> None:
        emit(args, answer, self.rows(items), self.columns)

    def wider(self, *columns: str, row: Callable[[T], Cells]) -> View[T]:
        """This view with more columns, their cells from `row`."""
        base = self.row
        return View(columns=(*self.columns, *columns), row=lambda v: {**base(v), **row(v)})


@attrs.frozen(kw_only=True)
class Listing(Generic[P, T]):
    """`nexa RESOURCE list`: GET `path`, decoded as `page`, whose `items` print as `view`."""

    path: str
    page: type[P]
    items: Callable[[P], Sequence[T]]
    view: View[T]
    #: Flags (argparse dests) sent as query parameters of the same name, when given.
    query: tuple[str, ...] = ()
    #: A list that can grow (`contracts.pages`): the page's `next_cursor`, None at the end. Such
    #: a list takes `--cursor` and `--limit` (`?cursor=&limit=`) and prints the next page's flag.
    next_cursor: Callable[[P], str | None] | None = None
    #: `--limit`'s default (None: the server's).
    limit: int | None = None
    #: Lines that say what to do about some of the items, printed on stderr after the table.
    notes: Callable[[P], Iterable[str]] | None = None

    def add(
        self, verbs: Any, common_flags: argparse.ArgumentParser, *, help_text: str | None = None
    ) -> argparse.ArgumentParser:
        """Add the `list` verb to `verbs` (listed in its command's help with `help_text`); return its
        parser, for the flags of `query`."""
        named = {} if help_text is None else {"help": help_text, "description": help_text}
        s: argparse.ArgumentParser = verbs.add_parser("list", parents=[common_flags], **named)
        if self.next_cursor is not None:
            common.page_flags(s, limit=self.limit)
        s.set_defaults(handler=self.run)
        return s

    def run(self, args: argparse.Namespace) -> int:
        params: dict[str, str | None] = {}
        for name in self.query:
            value = getattr(args, name)
            params[name] = None if value is None else str(value)
        if self.next_cursor is not None:
            params.update(common.page_params(args))
        with common.client(args) as c:
            page = c.get(self.path, self.page, params=params)
        self.view.emit(args, page, self.items(page))
        if self.notes is not None and not args.json:
            for line in self.notes(page):
                print(line, file=sys.stderr)
        if self.next_cursor is not None and not args.json:
            print_more(self.next_cursor(page))
        return EXIT_OK


@attrs.frozen(kw_only=True)
class Show(Generic[T]):
    """`nexa RESOURCE show NAME`: GET `path` (`{name}` filled from the flag of that dest) as one row."""

    path: str
    answer: type[T]
    view: View[T]
    #: Lines printed below the row (not with `--json`).
    after: Callable[[T], None] | None = None

    def run(self, args: argparse.Namespace) -> int:
        with common.client(args) as c:
            value = c.get(self.path.format_map(vars(args)), self.answer)
        self.view.emit(args, value, [value])
        if self.after is not None and not args.json:
            self.after(value)
        return EXIT_OK


# ---- keys and tenants ----------------------------------------------------------------------------


def _key_state(k: KeyView) -> str:
    if k.revoked_at:
        return "revoked"
    if k.expires_at is not None and k.expires_at <= time.time():
        return "expired"
    return "rotated" if k.rotated_to else "active"


KEY: Final = View[KeyView](
    columns=("id", "role", "tenant", "name", "state", "created_at", "expires_at"),
    row=lambda k: {
        "id": k.id,
        "role": k.role,
        "tenant": k.tenant,
        "name": k.name,
        "state": _key_state(k),
        "created_at": k.created_at,
        "revoked_at": k.revoked_at,
        "expires_at": k.expires_at,
        "rotated_to": k.rotated_to,
        "created_by": k.created_by,
        "priorities": ",".join(k.priorities),
    },
)
KEY_REVOKED: Final = attrs.evolve(KEY, columns=("id", "role", "revoked_at"))
KEY_DETAIL: Final = attrs.evolve(KEY, columns=(*KEY.columns, "revoked_at", "rotated_to", "created_by", "priorities"))
TENANT: Final = View[TenantView](
    columns=("id", "display_name", "created_at"),
    row=lambda t: {"id": t.id, "display_name": t.display_name, "created_at": t.created_at},
)
KEYS: Final = Listing(
    path="/api/v1/keys", page=KeyList, items=lambda p: p.keys, view=KEY, next_cursor=lambda p: p.next_cursor
)
TENANTS: Final = Listing(
    path="/api/v1/tenants", page=TenantList, items=lambda p: p.tenants, view=TENANT, next_cursor=lambda p: p.next_cursor
)


# ---- nodes ---------------------------------------------------------------------------------------


def accelerators(inventory: NodeInventory | None) -> str:
    if not inventory or not inventory.gpus:
        return "-"
    names: dict[str, int] = {}
    for gpu in inventory.gpus:
        name = gpu.name + (" (unified)" if gpu.unified_memory else "")
        names[name] = names.get(name, 0) + 1
    return ", ".join(f"{n}x {name}" for name, n in names.items())


def _node_row(n: NodeView) -> Cells:
    age = n.last_heartbeat_age_s
    return {
        "id": n.id,
        "state": "NeedsReenrollment" if n.needs_reenrollment else n.state,
        "heartbeat": "never" if age is None else f"{age:.1f}s ago",
        "labels": ",".join(f"{k}={v}" for k, v in sorted(n.labels.items())) or "-",
        "accelerators": accelerators(n.inventory),
        "free_memory": gib(n.free_memory_bytes) if n.inventory else "-",
        "assignments": f"{len(n.assignments)} (gen {n.acked_generation}/{n.desired_generation})",
    }


NODE: Final = View[NodeView](
    columns=("id", "state", "heartbeat", "labels", "accelerators", "free_memory", "assignments"), row=_node_row
)
NODES: Final = Listing(
    path="/api/v1/nodes",
    page=NodeList,
    items=lambda p: p.nodes,
    view=NODE,
    next_cursor=lambda p: p.next_cursor,
    notes=lambda p: [f"node {n.id} needs re-enrollment: {n.hint}" for n in p.nodes if n.needs_reenrollment],
)


# ---- the registry: runtimes, models, aliases -----------------------------------------------------


#: How `runtimes show` says what a replica group's containers get (`RuntimeRecord.fabric`).
_FABRIC_WORDS: Final = {
    FabricAccess.NONE: "none (groups keep a namespace of their own)",
    FabricAccess.TCP: "tcp (opt-in: groups get the node's network namespace, a larger /dev/shm)",
    FabricAccess.RDMA: "rdma (opt-in: groups get the node's network namespace, RDMA devices, IPC_LOCK, "
    "unlimited memlock, a larger /dev/shm)",
}


def platforms(runtime: RuntimeRecord) -> str:
    """`linux/amd64, linux/arm64/v8`, or `unknown` for records that name none."""
    return ", ".join(str(p) for p in runtime.platforms) or "unknown (no node is filtered)"


RUNTIME: Final = View[RuntimeRecord](
    columns=("name", "kind", "version", "image", "registered_at"),
    row=lambda r: {
        "name": r.name,
        "kind": r.kind,
        "version": r.version,
        "image": r.image,
        "registered_at": r.registered_at,
    },
)
RUNTIME_DETAIL: Final = RUNTIME.wider(
    "network",
    "platforms",
    "media_type",
    "registered_by",
    "fabric",
    row=lambda r: {
        "network": "host (opt-in)" if r.host_network else "private",
        "fabric": _FABRIC_WORDS[r.fabric],
        "platforms": platforms(r),
        "media_type": r.media_type,
        "registered_by": r.registered_by,
    },
)
RUNTIMES: Final = Listing(path="/api/v1/runtimes", page=RuntimeList, items=lambda p: p.runtimes, view=RUNTIME)


def print_image_configs(runtime: RuntimeRecord) -> None:
    """Below `runtimes show`: each platform's image config, and the process a replica runs there."""
    if not runtime.image_configs:
        print("image config: unknown (registered before configs were read); the adapter's program is set as is")
    for config in runtime.image_configs:
        words = {
            "entrypoint": " ".join(config.entrypoint) or "-",
            "cmd": " ".join(config.cmd) or "-",
            "user": config.user or "-",
            "workdir": config.working_dir or "-",
            "ports": ", ".join(config.exposed_ports) or "-",
        }
        print(f"{config.platform}: " + "; ".join(f"{k} {v}" for k, v in words.items()))
        for variant, process in adapters.image_runs(runtime.kind, config):
            print(f"  runs ({variant}): {' '.join(process)}")


RUNTIME_SHOW: Final = Show(
    path="/api/v1/runtimes/{name}", answer=RuntimeRecord, view=RUNTIME_DETAIL, after=print_image_configs
)

MODEL: Final = View[ModelRecord](
    columns=("name", "version", "state", "format", "size", "memory", "license", "registered_at"),
    row=lambda m: {
        "name": m.name,
        "version": m.version,
        "state": m.state,
        "format": m.format,
        "size": size_text(m.artifact.size_bytes),
        "memory": size_text(m.memory_bytes),
        "license": (m.license.spdx_id or "custom") if m.license else "-",
        "registered_at": m.registered_at,
    },
)
MODELS: Final = Listing(
    path="/api/v1/models", page=ModelList, items=lambda p: p.models, view=MODEL, query=("name", "state")
)

ALIAS: Final = View[AliasRecord](
    columns=("alias", "target", "generation", "updated_at"),
    row=lambda a: {
        "alias": a.name,
        "target": ref(a.target) + (f"+{ref(a.adapter)}" if a.adapter else ""),
        "generation": a.generation,
        "updated_at": a.updated_at,
    },
)
ALIASES: Final = Listing(path="/api/v1/aliases", page=AliasList, items=lambda p: p.aliases, view=ALIAS)


# ---- deployments ---------------------------------------------------------------------------------


def _deployment_row(view: DeploymentView) -> Cells:
    dep = view.deployment
    return {
        "name": dep.name,
        "model": f"{dep.model.model}:{dep.model.version}",
        "runtime": dep.runtime,
        "replicas": f"{len(dep.placed)}/{dep.replicas}",
        "nodes": ",".join(sorted(n for r in dep.placed for n in r.node_ids)) or "-",
        "problem": view.problem or "-",
    }


DEPLOYMENT: Final = View[DeploymentView](
    columns=("name", "model", "runtime", "replicas", "nodes", "problem"), row=_deployment_row
)
DEPLOYMENTS: Final = Listing(
    path="/api/v1/deployments",
    page=DeploymentList,
    items=lambda p: p.deployments,
    view=DEPLOYMENT,
    next_cursor=lambda p: p.next_cursor,
)


# ---- quotas, usage and workloads -----------------------------------------------------------------


def _quota_row(q: QuotaView) -> Cells:
    limits, use = q.limits, q.use
    return {
        "tenant": q.tenant,
        "concurrent": limits.concurrent_requests,
        "rpm": limits.requests_per_minute,
        "tpm": limits.tokens_per_minute,
        "tpd": limits.tokens_per_day,
        "in_flight": use.concurrent_requests,
        "req_1m": use.requests_last_minute,
        "tok_1m": use.tokens_last_minute,
        "tok_today": use.tokens_today,
        "audio_s_today": use.audio_seconds_today,
        "speech_chars_today": use.speech_characters_today,
        "images_today": use.images_today,
        "adapter_tok_today": _adapter_cell(limits.adapter_tokens_per_day, use.adapter_tokens_today),
    }


def _adapter_cell(limits: dict[str, int], today: dict[str, int]) -> str | None:
    """Each LoRA adapter's tokens today and its limit: `ner=1200/5000,tone=30/-`; None for none."""
    names = sorted(limits.keys() | today.keys())
    return ",".join(f"{n}={today.get(n, 0)}/{limits.get(n, '-')}" for n in names) or None


QUOTA: Final = View[QuotaView](
    columns=(
        "tenant",
        "concurrent",
        "rpm",
        "tpm",
        "tpd",
        "in_flight",
        "req_1m",
        "tok_1m",
        "tok_today",
        "audio_s_today",
        "speech_chars_today",
        "images_today",
        "adapter_tok_today",
    ),
    row=_quota_row,
)
QUOTAS: Final = Listing(path="/api/v1/quotas", page=QuotaList, items=lambda p: p.quotas, view=QUOTA)
QUOTA_SHOW: Final = Show(path="/api/v1/quotas/{tenant}", answer=QuotaView, view=QUOTA)

USAGE: Final = View[UsageRow](
    columns=(
        "day",
        "tenant",
        "model",
        "requests",
        "errors",
        "prompt_tokens",
        "completion_tokens",
        "audio_seconds",
        "speech_characters",
        "images",
    ),
    row=lambda r: {
        "day": r.day,
        "tenant": r.tenant,
        "model": r.model,
        "requests": r.requests,
        "errors": r.errors,
        "prompt_tokens": r.prompt_tokens,
        "completion_tokens": r.completion_tokens,
        "audio_seconds": r.audio_seconds,
        "speech_characters": r.speech_characters,
        "images": r.images,
    },
)

WORKLOAD: Final = View[WorkloadView](
    columns=("workload_id", "state", "model", "priority", "error", "accepted_at", "finished_at"),
    row=lambda w: {
        "workload_id": w.workload_id,
        "state": w.state,
        "model": w.model,
        "priority": w.priority,
        "error": w.error,
        "accepted_at": w.accepted_at,
        "finished_at": w.finished_at,
    },
)
WORKLOADS: Final = Listing(
    path="/api/v1/workloads",
    page=WorkloadList,
    items=lambda p: p.workloads,
    view=WORKLOAD,
    next_cursor=lambda p: p.next_cursor,
)


# ---- audit ---------------------------------------------------------------------------------------

AUDIT_EVENT: Final = View[AuditEvent](
    columns=("seq", "time", "action", "target", "actor_key_id", "actor_role", "result"),
    row=lambda e: {
        "seq": e.seq,
        "time": e.time,
        "action": e.action,
        "target": e.target,
        "actor_key_id": e.actor_key_id,
        "actor_role": e.actor_role,
        "result": e.result,
    },
)
AUDIT: Final = Listing(
    path="/api/v1/audit",
    page=AuditPage,
    items=lambda p: p.events,
    view=AUDIT_EVENT,
    query=("action", "actor", "target", "since", "until", "after"),
    next_cursor=lambda p: p.next_cursor,
    limit=100,
)


# ---- backups -------------------------------------------------------------------------------------

BACKUP: Final = View[BackupView](
    columns=("name", "created_at", "epoch", "audit_head_seq", "size"),
    row=lambda b: {
        "name": b.name,
        "created_at": b.created_at,
        "epoch": b.epoch,
        "audit_head_seq": b.audit_head_seq,
        "size": size_text(b.size),
    },
)
BACKUPS: Final = Listing(
    path="/api/v1/backups", page=BackupList, items=lambda p: p.backups, view=BACKUP, next_cursor=lambda p: p.next_cursor
)


# ---- benchmark runs and jobs (issue 19) ----------------------------------------------------------


def _verdict(r: BenchRun) -> str:
    return "meets objectives" if r.verdict.meets_objectives else f"broke {len(r.verdict.broken)}"


BENCH_RUN: Final = View[BenchRun](
    columns=("id", "deployment", "kind", "steps", "verdict", "max_conc_per_replica", "recorded_at"),
    row=lambda r: {
        "id": r.id,
        "deployment": r.run.deployment,
        "kind": r.run.kind,
        "steps": len(r.run.points),
        "verdict": _verdict(r),
        "max_conc_per_replica": r.verdict.recommended_concurrency,
        "recorded_at": r.recorded_at,
    },
)
BENCH_RUNS: Final = Listing(
    path="/api/v1/benchmarks",
    page=BenchRunList,
    items=lambda p: p.runs,
    view=BENCH_RUN,
    query=("deployment",),
    next_cursor=lambda p: p.next_cursor,
)
JOB: Final = View[Job](
    columns=("id", "kind", "state", "progress", "title", "started_at", "duration", "summary"),
    row=lambda j: {
        "id": j.id,
        "kind": j.kind,
        "state": j.state,
        "progress": "-" if j.progress is None else f"{j.progress:.0%}",
        "title": j.title,
        "started_at": j.started_at,
        "duration": f"{(j.finished_at or time.time()) - j.started_at:.1f}s",
        "summary": j.summary or "-",
        "link": j.link,
    },
)
JOBS: Final = Listing(
    path="/api/v1/jobs",
    page=JobList,
    items=lambda p: p.jobs,
    view=JOB,
    query=("kind", "state"),
    next_cursor=lambda p: p.next_cursor,
)
JOB_SHOW: Final = Show(path="/api/v1/jobs/{job_id}", answer=Job, view=JOB.wider("link", row=lambda j: {"link": j.link}))
