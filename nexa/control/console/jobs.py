"""Jobs: the long-running work an operator follows (benchmark runs, sim campaigns, backups, rollouts),
newest first, filtered by kind and state, paged, updating live; each row links to its record.

Mirrors `GET /api/v1/jobs` (its roles decide who may see it). Titles, summaries and links of client
jobs came from a client: the templates escape them, and a link becomes a console link only when it
is one of the API paths below (`record_link`); anything else is shown as text.
"""

from __future__ import annotations

import re
from typing import Final, TypeVar

import attrs
from quart import Blueprint, request

from nexa.contracts import pages
from nexa.contracts.evidence import Job, JobKind, JobState
from nexa.control.console.pages import Console, Context, View
from nexa.control.console.sessions import Session
from nexa.errors import ContractError

E = TypeVar("E", JobKind, JobState)

#: Jobs on one page of the list.
PAGE_SIZE: Final = 50
#: The list's cursor: the API's (`Jobs.page` continues after a job's sort key).
CURSOR_KIND: Final = "jobs"
CURSOR_SHAPE: Final = (float, str)

#: A name or id in a record's API path: what the console's own routes accept.
_SEGMENT: Final = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
#: API path of a job's record → the console page that shows it (None: the API path, shown as text).
_RECORDS: Final = (
    (re.compile(rf"/api/v1/benchmarks/({_SEGMENT})"), "/console/benchmarks/{}"),
    (re.compile(rf"/api/v1/deployments/({_SEGMENT})"), "/console/deployments/{}"),
    (re.compile(rf"/api/v1/backups(?:/({_SEGMENT}))?"), None),  # admin-only API, no console page
    # A runtime qualification: its line beside the runtime on the Models page.
    (re.compile(rf"/api/v1/qualifications/({_SEGMENT})"), "/console/models#qualification-{}"),
)


@attrs.frozen(kw_only=True)
class Record:
    """Where a job's record is: a console page (`href`), or only its API path (`text`)."""

    href: str | None = None
    text: str = ""


def record_link(link: str | None) -> Record | None:
    """The console link of a job's record (`Job.link`, an API path the job's reporter set)."""
    if not link:
        return None
    for pattern, page in _RECORDS:
        match = pattern.fullmatch(link)
        if match:
            return Record(href=page.format(match.group(1)), text=link) if page else Record(text=link)
    return Record(text=link)


def _choice(name: str, enum: type[E]) -> E | None:
    """Query `name` as one of `enum`'s values; None when left out; a typed 400 otherwise."""
    raw = request.args.get(name) or ""
    if not raw:
        return None
    try:
        return enum(raw)
    except ValueError:
        choices = ", ".join(e.value for e in enum)
        raise ContractError(f"{name} must be one of {choices}, or left out", problems=(f"{name}: unknown",)) from None


def register(bp: Blueprint, console: Console) -> None:
    state = console.state

    async def context(session: Session, now: float) -> Context:
        kind, job_state = _choice("kind", JobKind), _choice("state", JobState)
        cursor = request.args.get("cursor")
        after = None if cursor is None else pages.decode_cursor(CURSOR_KIND, cursor, CURSOR_SHAPE)
        jobs: list[Job] = []
        last = None
        if state.jobs is not None:
            jobs, last = await state.jobs.page(kind, job_state, after, PAGE_SIZE)
        return {
            "jobs": [
                {"j": j, "record": record_link(j.link), "took": (j.finished_at or now) - j.started_at} for j in jobs
            ],
            "kinds": list(JobKind),
            "states": list(JobState),
            "kind": kind,
            "state": job_state,
            "next_cursor": None if last is None else pages.encode_cursor(CURSOR_KIND, last),
        }

    console.add_view(bp, View("jobs", "Jobs", ("GET", "/api/v1/jobs"), context))
