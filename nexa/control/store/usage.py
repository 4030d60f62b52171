"""The gateway's tenant quotas and metered usage (metadata only, never payloads)."""

from __future__ import annotations

from typing import Final

import attrs

from nexa.contracts import codec
from nexa.contracts.domain import AuditDraft, AuditEvent, KeyId, TenantId
from nexa.contracts.gateway import UsageRecord
from nexa.contracts.usage import QuotaLimits, UsageRow
from nexa.control.store.audit import append_audit
from nexa.control.store.sql import PRUNE_BATCH, Db, as_float, as_int, is_postgres, txn


@attrs.frozen(kw_only=True)
class QuotaRecord:
    tenant: TenantId
    limits: QuotaLimits
    updated_at: float
    updated_by: KeyId | None


def load_quotas(db: Db) -> list[QuotaRecord]:
    with txn(db):
        rows = db.execute("SELECT tenant, body, updated_at, updated_by FROM quota ORDER BY tenant").fetchall()
    return [
        QuotaRecord(
            tenant=TenantId(str(tenant)),
            limits=codec.loads(codec.store, str(body), QuotaLimits),
            updated_at=as_float(updated_at),
            updated_by=None if updated_by is None else KeyId(str(updated_by)),
        )
        for tenant, body, updated_at, updated_by in rows
    ]


def save_quota(db: Db, record: QuotaRecord, draft: AuditDraft) -> AuditEvent:
    with txn(db):
        db.execute(
            "INSERT INTO quota(tenant, body, updated_at, updated_by) VALUES (?,?,?,?)"
            " ON CONFLICT(tenant) DO UPDATE SET body = excluded.body, updated_at = excluded.updated_at,"
            " updated_by = excluded.updated_by",
            (record.tenant, codec.dumps(codec.store, record.limits), record.updated_at, record.updated_by),
        )
        event = append_audit(db, draft)
    return event


# ---- gateway: usage ----------------------------------------------------------------------------

_USAGE_COLUMNS: Final = (
    "request_id, workload_id, api, tenant, key_id, capability, alias, model, model_version, deployment, node_id,"
    " status, prompt_tokens, completion_tokens, queue_ms, ttft_ms, duration_ms, finished_at, canary, units, adapter"
)
_USAGE_VALUES: Final = ",".join("?" * len(_USAGE_COLUMNS.split(",")))
#: The media units of a usage group, one sum per unit (`MEDIA_UNITS`), in `UsageRow`'s order.
_MEDIA_SUMS: Final = (
    ("audio", "sum(CASE WHEN capability IN ('transcription', 'translation') THEN units ELSE 0 END)"),
    ("speech", "sum(CASE WHEN capability = 'speech' THEN units ELSE 0 END)"),
    ("images", "sum(CASE WHEN capability = 'image' THEN units ELSE 0 END)"),
)
_MEDIA_SELECT: Final = ", ".join(f"{expr} AS {name}" for name, expr in _MEDIA_SUMS)
#: Usage rows of requests a quota refused: they never took a request slot, so a rebuild skips them.
QUOTA_REFUSED_STATUS: Final = "quota_exceeded"


def insert_usage(db: Db, records: list[UsageRecord]) -> None:
    """Write one batch of usage records in one transaction (metadata only: never payloads)."""
    with txn(db):
        db.executemany(
            f"INSERT INTO usage({_USAGE_COLUMNS}) VALUES ({_USAGE_VALUES})",  # noqa: S608
            [
                (
                    r.request_id,
                    r.workload_id,
                    r.api.value,
                    r.tenant,
                    r.key_id,
                    r.capability.value,
                    r.alias,
                    r.model,
                    r.model_version,
                    r.deployment,
                    r.node_id,
                    r.status,
                    r.prompt_tokens,
                    r.completion_tokens,
                    r.queue_ms,
                    r.ttft_ms,
                    r.duration_ms,
                    r.finished_at,
                    int(r.canary),
                    r.units,
                    r.adapter,
                )
                for r in records
            ],
        )


def usage_by_second(db: Db, since: float) -> list[tuple[TenantId, int, int, int]]:
    """(tenant, whole second, requests, tokens) of the usage finished at or after `since`.

    What quotas rebuild their sliding minute from; quota refusals are not requests there.
    """
    # SQLite's CAST truncates; PostgreSQL's rounds, so it takes the floor (times are positive).
    second = "floor(finished_at)::bigint" if is_postgres(db) else "CAST(finished_at AS INTEGER)"
    with txn(db):
        rows = db.execute(
            f"SELECT tenant, {second} AS second, count(*),"  # noqa: S608
            " sum(prompt_tokens + completion_tokens) FROM usage WHERE finished_at >= ? AND status != ?"
            " GROUP BY tenant, second ORDER BY second",
            (since, QUOTA_REFUSED_STATUS),
        ).fetchall()
    return [(TenantId(str(t)), as_int(s), as_int(n), as_int(tok)) for t, s, n, tok in rows]


def usage_tokens_since(db: Db, since: float) -> dict[tuple[TenantId, str], int]:
    """Tokens per (tenant, LoRA adapter name) finished at or after `since` (the quota's day window);
    the adapter name is the model name of `UsageRecord.adapter` (all its versions), "" for none."""
    with txn(db):
        rows = db.execute(
            "SELECT tenant, adapter, sum(prompt_tokens + completion_tokens) FROM usage WHERE finished_at >= ?"
            " GROUP BY tenant, adapter",
            (since,),
        ).fetchall()
    tokens: dict[tuple[TenantId, str], int] = {}
    for tenant, adapter, n in rows:
        # `name:version`: neither a model name nor a version holds a colon (`contracts.models`).
        key = (TenantId(str(tenant)), str(adapter).rpartition(":")[0])
        tokens[key] = tokens.get(key, 0) + as_int(n)
    return tokens


def usage_units_since(db: Db, since: float) -> dict[tuple[TenantId, str], float]:
    """Media use per (tenant, capability) finished at or after `since` (the quota's day window)."""
    with txn(db):
        rows = db.execute(
            "SELECT tenant, capability, sum(units) FROM usage WHERE finished_at >= ? AND units > 0"
            " GROUP BY tenant, capability",
            (since,),
        ).fetchall()
    return {(TenantId(str(t)), str(c)): as_float(n) for t, c, n in rows}


#: Where a page of `usage_report` continues: after the group (day, tenant, model).
UsageKey = tuple[str, str, str]


#: A usage group's model: `name:version`, `+adapter` when one served it, the alias when it never resolved.
_GROUP: Final = (
    "CASE WHEN model = '' THEN alias ELSE model || ':' || model_version"
    " || CASE WHEN adapter = '' THEN '' ELSE '+' || adapter END END"
)


def usage_report(  # noqa: PLR0917 - one transaction function, called through Store.run(fn, *args)
    db: Db,
    since: float,
    until: float,
    tenant: str | None,
    model: str | None,
    after: UsageKey | None = None,
    limit: int | None = None,
) -> list[UsageRow]:
    """Usage grouped by tenant, model (`name:version`, with `+adapter:version` when a LoRA adapter
    served it; the alias when it never resolved) and UTC day, ordered by (day, tenant, model); with
    `after`, only the groups after that one, and at most `limit`.

    `model` filters on `name:version`, the model name, the alias the client asked for, or the
    adapter's `name:version` or name.
    """
    where = ["finished_at >= ?", "finished_at < ?"]
    args: list[str | float] = [since, until]
    if tenant is not None:
        where.append("tenant = ?")
        args.append(tenant)
    if model is not None:
        where.append(
            "(model || ':' || model_version = ? OR model = ? OR alias = ? OR adapter = ?"
            " OR substr(adapter, 1, length(?) + 1) = ? || ':')"
        )
        args.extend((model, model, model, model, model, model))
    if is_postgres(db):
        sql = _usage_report_pg(where, after)
    else:
        sql = (
            f"SELECT tenant, {_GROUP} AS m,"  # noqa: S608
            " strftime('%Y-%m-%d', finished_at, 'unixepoch') AS day, count(*), sum(status != 'ok'),"
            f" sum(prompt_tokens), sum(completion_tokens), {_MEDIA_SELECT}"
            f" FROM usage WHERE {' AND '.join(where)} GROUP BY tenant, m, day"
        )
        if after is not None:  # keyset: a group already given out is never given again
            sql += " HAVING (day, tenant, m) > (?, ?, ?)"
    if after is not None:
        args.extend(after)
    sql += " ORDER BY day, tenant, m"
    if limit is not None:
        sql += " LIMIT ?"
        args.append(limit)
    with txn(db):
        rows = db.execute(sql, args).fetchall()
    return [
        UsageRow(
            tenant=TenantId(str(t)),
            model=str(m),
            day=str(day),
            requests=as_int(n),
            errors=as_int(errors),
            prompt_tokens=as_int(prompt),
            completion_tokens=as_int(completion),
            audio_seconds=round(as_float(audio), 3),
            speech_characters=round(as_float(speech)),
            images=round(as_float(images)),
        )
        for t, m, day, n, errors, prompt, completion, audio, speech, images in rows
    ]


def _usage_report_pg(where: list[str], after: UsageKey | None) -> str:
    """`usage_report`'s query on PostgreSQL, without its ORDER BY and LIMIT: the UTC day by
    `to_char`, errors counted by a filter, and the keyset in an outer WHERE (HAVING cannot name
    the select list's columns there)."""
    sql = (
        "SELECT tenant, m, day, n, errors, prompt, completion, audio, speech, images FROM (SELECT tenant,"  # noqa: S608
        f" {_GROUP} AS m,"
        " to_char(to_timestamp(finished_at) AT TIME ZONE 'UTC', 'YYYY-MM-DD') AS day, count(*) AS n,"
        " count(*) FILTER (WHERE status != 'ok') AS errors, sum(prompt_tokens) AS prompt,"
        " sum(completion_tokens) AS completion,"
        f" {_MEDIA_SELECT}"
        f" FROM usage WHERE {' AND '.join(where)} GROUP BY 1, 2, 3) AS g"
    )
    if after is not None:  # keyset: a group already given out is never given again
        sql += " WHERE (day, tenant, m) > (?, ?, ?)"
    return sql


def prune_usage(db: Db, before: float) -> int:
    """Delete up to PRUNE_BATCH usage records that finished before `before`; how many went."""
    with txn(db):
        db.execute(
            "DELETE FROM usage WHERE seq IN (SELECT seq FROM usage WHERE finished_at < ? LIMIT ?)",
            (before, PRUNE_BATCH),
        )
        return db.changes()
