"""What the gateway reports of its use: usage groups (`GET /api/v1/usage`), the windows of finished
requests that canaries and rollouts are watched by, and tenants' quotas with their use.

Pure data and validation; no I/O. Counts and timings only, never payloads. The per-request record
these are made of (`UsageRecord`) lives beside the call's outcome in `contracts.gateway`.
"""

from __future__ import annotations

from typing import Final

import attrs

from nexa.contracts.domain import KeyId, TenantId
from nexa.contracts.models import name_problem

#: The most adapters one tenant's quota may name (`QuotaLimits.adapter_tokens_per_day`).
MAX_ADAPTER_QUOTAS: Final = 256


@attrs.frozen(kw_only=True)
class WindowStats:
    """Finished requests of one deployment (its canary replicas, or the others) over a recent window."""

    requests: int
    errors: int
    #: None when there were no requests.
    p95_ms: float | None

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


@attrs.frozen(kw_only=True)
class WatchStats:
    """Finished requests served on some nodes of one deployment over a window (a rollout's watch of
    its new replicas); the p95s are None where no request measured them."""

    requests: int
    errors: int
    p95_ms: float | None = None
    ttft_p95_ms: float | None = None
    #: Time per output token after the first: (duration - TTFT) / (completion tokens - 1).
    tpot_p95_ms: float | None = None

    @property
    def error_rate(self) -> float:
        return self.errors / self.requests if self.requests else 0.0


@attrs.frozen(kw_only=True)
class UsageRow:
    """`GET /api/v1/usage`: one (tenant, model, UTC day) group."""

    tenant: TenantId
    model: str
    day: str
    requests: int
    errors: int
    prompt_tokens: int
    completion_tokens: int
    #: Media use (`MEDIA_UNITS`): seconds of audio transcribed or translated, characters spoken, images made.
    audio_seconds: float = 0.0
    speech_characters: int = 0
    images: int = 0


@attrs.frozen(kw_only=True)
class UsageReport:
    since: float
    until: float
    #: A page of groups, by day, tenant and model (`contracts.pages`); the CSV form has them all.
    rows: list[UsageRow]
    #: The cursor of the next page; None at the end.
    next_cursor: str | None = None


@attrs.frozen(kw_only=True)
class QuotaLimits:
    """`PUT /api/v1/quotas/{tenant}`. None: no limit of that kind. A tenant with no record has none."""

    concurrent_requests: int | None = None
    requests_per_minute: int | None = None
    tokens_per_minute: int | None = None
    tokens_per_day: int | None = None
    #: Media use per UTC day, in each capability's unit (`MEDIA_UNITS`).
    audio_seconds_per_day: int | None = None
    speech_characters_per_day: int | None = None
    images_per_day: int | None = None
    #: Tokens per UTC day of each LoRA adapter, by its registry model name (all its versions),
    #: on top of the limits above; 0 refuses the adapter. An adapter left out: no limit of its own.
    adapter_tokens_per_day: dict[str, int] = attrs.Factory(dict)


@attrs.frozen(kw_only=True)
class QuotaUse:
    concurrent_requests: int
    #: Over the last 60 s (sliding), and since 00:00 UTC.
    requests_last_minute: int
    tokens_last_minute: int
    tokens_today: int
    #: Media use since 00:00 UTC (`MEDIA_UNITS`), reservations of running requests included.
    audio_seconds_today: float = 0.0
    speech_characters_today: int = 0
    images_today: int = 0
    #: Tokens since 00:00 UTC by LoRA adapter name, reservations of running requests included:
    #: every adapter used today or limited (`QuotaLimits.adapter_tokens_per_day`).
    adapter_tokens_today: dict[str, int] = attrs.Factory(dict)


@attrs.frozen(kw_only=True)
class QuotaView:
    tenant: TenantId
    limits: QuotaLimits
    use: QuotaUse
    updated_at: float | None = None
    updated_by: KeyId | None = None


@attrs.frozen(kw_only=True)
class QuotaList:
    quotas: list[QuotaView]


def quota_problems(limits: QuotaLimits) -> list[str]:
    problems = [
        f"{name}: a positive integer, or null for no limit"
        for name, value in attrs.asdict(limits).items()
        if name != "adapter_tokens_per_day" and value is not None and (isinstance(value, bool) or value < 1)
    ]
    adapters = limits.adapter_tokens_per_day
    if len(adapters) > MAX_ADAPTER_QUOTAS:
        problems.append(
            f"adapter_tokens_per_day: at most {MAX_ADAPTER_QUOTAS} adapters, not {len(adapters)};"
            " limit the tenant's total with tokens_per_day instead"
        )
    for name, value in sorted(adapters.items()):
        field = f"adapter_tokens_per_day[{name!r}]"
        if problem := name_problem(field, name):
            problems.append(f"{problem} (the adapter's registry model name, without a version)")
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            problems.append(f"{field}: an integer >= 0 (0 refuses the adapter); leave the adapter out for no limit")
    return problems
