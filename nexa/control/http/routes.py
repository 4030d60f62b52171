"""The management API's routes and the roles that may call each: the one table `api` serves,
`_authorize` checks before any handler runs, the console's actions mirror and `openapi` describes.

A route missing from it is refused for everyone (and a test fails). The inference routes have
their own table (`inference.INFERENCE_ROUTES`).
"""

from __future__ import annotations

from typing import Final

from nexa.contracts.domain import Role

_A, _O, _I, _AU, _M = Role.ADMIN, Role.OPERATOR, Role.INFERENCE, Role.AUDIT, Role.MONITORING
_R = Role.RETENTION_READER

#: Every route and the roles that may call it; `None` means no credential is needed.
#: A route missing from this table is refused for everyone (and a test fails).
ROUTE_ROLES: Final[dict[tuple[str, str], frozenset[Role] | None]] = {
    ("GET", "/healthz"): None,
    ("GET", "/readyz"): None,
    ("GET", "/version"): None,
    ("GET", "/api/v1/openapi.json"): None,  # shapes only, no state: SDK generators fetch it keyless
    ("GET", "/api/v1/cluster"): frozenset({_M, _O, _A}),  # each controller's role, epoch and lease age
    ("GET", "/metrics"): frozenset({_M, _A}),
    ("POST", "/api/v1/keys"): frozenset({_A}),
    ("GET", "/api/v1/keys"): frozenset({_A}),
    ("GET", "/api/v1/keys/<key_id>"): frozenset({_A}),
    ("DELETE", "/api/v1/keys/<key_id>"): frozenset({_A}),
    ("POST", "/api/v1/keys/<key_id>/rotate"): frozenset({_A}),
    ("POST", "/api/v1/enrollment-tokens"): frozenset({_A}),
    ("POST", "/api/v1/enroll"): None,  # authenticated by the one-time token in the body
    ("GET", "/api/v1/nodes"): frozenset({_O, _A}),
    ("GET", "/api/v1/nodes/<node_id>"): frozenset({_O, _A}),
    ("POST", "/api/v1/nodes/<node_id>/cordon"): frozenset({_O, _A}),
    ("POST", "/api/v1/nodes/<node_id>/uncordon"): frozenset({_O, _A}),
    ("POST", "/api/v1/nodes/<node_id>/drain"): frozenset({_O, _A}),
    ("POST", "/api/v1/nodes/<node_id>/revoke"): frozenset({_A}),
    ("POST", "/api/v1/nodes/<node_id>/rotate-keys"): frozenset({_A}),
    ("POST", "/api/v1/tenants"): frozenset({_A}),
    ("GET", "/api/v1/tenants"): frozenset({_A}),
    ("GET", "/api/v1/audit"): frozenset({_AU, _A}),
    ("POST", "/api/v1/audit/verify"): frozenset({_AU, _A}),
    ("GET", "/api/v1/audit/head"): frozenset({_AU, _A}),
    ("POST", "/api/v1/runtimes"): frozenset({_O, _A}),
    ("GET", "/api/v1/runtimes"): frozenset({_O, _A}),
    ("GET", "/api/v1/runtimes/<name>"): frozenset({_O, _A}),
    ("POST", "/api/v1/models"): frozenset({_O, _A}),
    ("GET", "/api/v1/models"): frozenset({_O, _A}),
    ("GET", "/api/v1/models/<name>/<version>"): frozenset({_O, _A}),
    ("POST", "/api/v1/models/<name>/<version>/license"): frozenset({_O, _A}),
    ("POST", "/api/v1/models/<name>/<version>/verify"): frozenset({_O, _A}),
    ("POST", "/api/v1/models/<name>/<version>/evaluations"): frozenset({_O, _A}),
    ("POST", "/api/v1/models/<name>/<version>/approve"): frozenset({_O, _A}),
    ("POST", "/api/v1/models/<name>/<version>/retire"): frozenset({_O, _A}),
    ("GET", "/api/v1/aliases"): frozenset({_O, _A}),
    ("GET", "/api/v1/aliases/<name>"): frozenset({_O, _A}),
    ("POST", "/api/v1/aliases/<name>/promote"): frozenset({_O, _A}),
    ("POST", "/api/v1/aliases/<name>/rollback"): frozenset({_O, _A}),
    ("POST", "/api/v1/deployments"): frozenset({_O, _A}),
    ("GET", "/api/v1/deployments"): frozenset({_O, _A}),
    ("GET", "/api/v1/deployments/<name>"): frozenset({_O, _A}),
    ("DELETE", "/api/v1/deployments/<name>"): frozenset({_O, _A}),
    ("GET", "/api/v1/deployments/<name>/placement"): frozenset({_O, _A}),
    ("POST", "/api/v1/deployments/<name>/scale"): frozenset({_O, _A}),
    ("POST", "/api/v1/deployments/<name>/routing"): frozenset({_O, _A}),
    ("POST", "/api/v1/deployments/<name>/canary"): frozenset({_O, _A}),
    ("POST", "/api/v1/deployments/<name>/promote"): frozenset({_O, _A}),
    ("POST", "/api/v1/deployments/<name>/rollback"): frozenset({_O, _A}),
    ("POST", "/api/v1/capacity/forecast"): frozenset({_O, _A}),
    ("GET", "/api/v1/usage"): frozenset({_AU, _A}),
    ("GET", "/api/v1/quotas"): frozenset({_A}),
    ("GET", "/api/v1/quotas/<tenant>"): frozenset({_A}),
    ("PUT", "/api/v1/quotas/<tenant>"): frozenset({_A}),
    ("GET", "/api/v1/receipts/public-key"): frozenset({_I, _AU, _O, _A}),
    ("GET", "/api/v1/recovery/plan"): frozenset({_O, _A}),
    ("POST", "/api/v1/recovery/finish"): frozenset({_A}),
    ("POST", "/api/v1/backups"): frozenset({_A}),
    ("GET", "/api/v1/backups"): frozenset({_A}),
    ("GET", "/api/v1/backups/<name>"): frozenset({_A}),
    ("POST", "/api/v1/controller/rotate-keys"): frozenset({_A}),
    ("POST", "/api/v1/deployments/<name>/objectives"): frozenset({_O, _A}),
    ("POST", "/api/v1/benchmarks"): frozenset({_O, _A}),
    ("GET", "/api/v1/benchmarks"): frozenset({_O, _A}),
    ("GET", "/api/v1/benchmarks/<run_id>"): frozenset({_O, _A}),
    ("POST", "/api/v1/jobs"): frozenset({_O, _A}),
    ("GET", "/api/v1/jobs"): frozenset({_O, _A}),
    ("GET", "/api/v1/jobs/<job_id>"): frozenset({_O, _A}),
    ("POST", "/api/v1/jobs/<job_id>"): frozenset({_O, _A}),
    ("POST", "/api/v1/evidence"): frozenset({_O, _A}),
    ("POST", "/api/v1/runtimes/<name>/qualify"): frozenset({_O, _A}),
    ("GET", "/api/v1/qualifications"): frozenset({_O, _A}),
    ("GET", "/api/v1/qualifications/<qualification_id>"): frozenset({_O, _A}),
    ("GET", "/api/v1/retention/policies"): frozenset({_A}),
    ("GET", "/api/v1/retention/policies/<name>"): frozenset({_A}),
    ("PUT", "/api/v1/retention/policies/<name>"): frozenset({_A}),
    ("DELETE", "/api/v1/retention/policies/<name>"): frozenset({_A}),
    ("GET", "/api/v1/retention/records"): frozenset({_R, _A}),  # ids, sizes, times: never a payload
    ("GET", "/api/v1/retention/records/<record_id>"): frozenset({_R}),  # the payload, decrypted; audited
    ("POST", "/api/v1/retention/purge"): frozenset({_A}),
}
