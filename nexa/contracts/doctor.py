"""`nexa node doctor`'s report: one result per check. Pure data; `nexa node doctor --json` prints it
through `codec.api`."""

from __future__ import annotations

import enum

import attrs


class CheckStatus(enum.StrEnum):
    """`ok` passes; `warn` passes but wants a look (or the check could not apply); `fail` does not pass."""

    OK = "ok"
    WARN = "warn"
    FAIL = "fail"


@attrs.frozen(kw_only=True)
class CheckResult:
    #: `state_dir`, `engine`, `nvidia`, `cdi`, `disk`, `controller`, `fingerprint`, `clock`, `channel`.
    name: str
    status: CheckStatus
    #: What was found (local paths may appear: the report stays on the node).
    detail: str
    #: What to do about it; empty when there is nothing to do.
    fix: str = ""


@attrs.frozen(kw_only=True)
class DoctorReport:
    #: True when no check failed (warnings pass): the command's exit status is 0 exactly then.
    passed: bool
    #: The enrolled node's id; empty before enrollment.
    node_id: str
    checks: tuple[CheckResult, ...]


def report(checks: tuple[CheckResult, ...], *, node_id: str = "") -> DoctorReport:
    return DoctorReport(passed=all(c.status is not CheckStatus.FAIL for c in checks), node_id=node_id, checks=checks)
