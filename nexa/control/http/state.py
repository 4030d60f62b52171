"""What the management API's handlers read: the app state the composition root hands `api.create_app`."""

from __future__ import annotations

import attrs

from nexa import security
from nexa.control import store as st
from nexa.control.access.accounts import Accounts
from nexa.control.cluster.leadership import Leadership
from nexa.control.datapath.admission import Admission
from nexa.control.datapath.metering import Meter
from nexa.control.datapath.quotas import Quotas
from nexa.control.datapath.retention import Retention
from nexa.control.deployments import Deployments
from nexa.control.fleet.keyring import KeyRotation
from nexa.control.fleet.nodes import Fleet
from nexa.control.operations.backup import Backups
from nexa.control.operations.benchmarks import Benchmarks
from nexa.control.operations.evals import Evals
from nexa.control.operations.evidence import Evidence
from nexa.control.operations.jobs import Jobs
from nexa.control.operations.qualification import Qualifications
from nexa.control.operations.recovery import Recovery
from nexa.control.registry.models import ModelRegistry
from nexa.security import SigningKey
from nexa.telemetry import Metrics


@attrs.frozen(kw_only=True)
class ControllerPublicKeys:
    """What nodes pin at enrollment: Ed25519 (base64) and CurveZMQ (Z85) public keys."""

    signing: str
    curve: str

    @property
    def fingerprint(self) -> str:
        """What enrollment tokens carry and nodes check (`security.controller_fingerprint`)."""
        return security.controller_fingerprint(self.signing, self.curve)


@attrs.define(kw_only=True)
class AppState:
    """What the app needs from the composition root."""

    accounts: Accounts
    fleet: Fleet
    models: ModelRegistry
    deployments: Deployments
    store: st.Store
    metrics: Metrics
    started_at: float
    controller_keys: ControllerPublicKeys
    #: The controller's Ed25519 key (the private half of `controller_keys.signing`): signs audit checkpoints.
    signing_key: SigningKey
    quotas: Quotas
    meter: Meter
    admission: Admission
    ready: bool = False
    #: This controller's role in its cluster (`control.cluster.leadership`); None: the only one (tests).
    leadership: Leadership | None = None
    #: `GET /api/v1/openapi.json`'s answer (`control/http/openapi.py`, built by the composition root).
    openapi: bytes = b""
    #: `nodes.max_clock_skew_s`, reported by `GET /version` for `nexa node doctor`.
    max_clock_skew_s: float = 30.0
    #: The controller's recovery (`control.operations.recovery`); None: it never recovers (tests).
    recovery: Recovery | None = None
    #: `/api/v1/backups` (nexa.control.operations.backup); None: refused as backup_not_configured.
    backups: Backups | None = None
    key_rotation: KeyRotation | None = None  # `control.fleet.keyring`; None: keys never rotate (tests)
    benchmarks: Benchmarks | None = (
        None  # `control.operations.benchmarks`, `.jobs`, `.evidence`: None (tests) answers 404
    )
    jobs: Jobs | None = None
    evidence: Evidence | None = None
    #: `control.operations.qualification`; None (tests): its routes answer 404.
    qualifications: Qualifications | None = None
    #: `control.datapath.retention`; None (tests): its routes answer 404.
    retention: Retention | None = None
    #: `control.operations.evals`; None (tests): its routes answer 404.
    evals: Evals | None = None

    def epoch(self) -> int:
        """The epoch this controller signs with: its leadership's (leased: the lease's; solo: the store's)."""
        return self.leadership.epoch if self.leadership is not None else self.store.epoch
