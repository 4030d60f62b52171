"""Deployment records: what an operator asks to run, what the controller keeps, what the API shows.

Pure data and validation; no I/O. A deployment's name is its id. It names its model either by
alias (which it follows: when the alias moves, the deployment rolls to the new version) or by a
pinned version, and its runtime by the name it was registered under. `control/deployments.py`
validates a request against the model registry and the fleet, places it (`control/deployments/scheduler.py`)
and keeps the result.

A new version rolls out as a canary (`CanaryCreate`: extra replicas and a share of traffic,
watched against a `CanaryObjective`), then is promoted: its replicas join the deployment and the
old version's replicas are replaced one at a time (`Rollout`).
"""

from __future__ import annotations

import enum
from typing import ClassVar, Final

import attrs

from nexa.contracts.bounds import MAX_BYTES
from nexa.contracts.evidence import ServiceObjectives
from nexa.contracts.gateway import Capability
from nexa.contracts.models import AliasReceipt, ModelRef, name_problem, version_problem
from nexa.contracts.node import DataClassName, LabelKey, LabelValue, data_class_problem
from nexa.contracts.placement import PlacementDecision, PlacementPolicy

#: The most replicas one deployment may ask for.
MAX_REPLICAS: Final = 256
#: The longest window a canary objective may cover (seconds).
MAX_WINDOW_S: Final = 3600.0
#: The largest routing weight (`RoutingWeights`); weights are from 0 to this.
MAX_ROUTING_WEIGHT: Final = 100.0
#: The most nodes one replica may span (`DeploymentCreate.nodes_per_replica`).
MAX_NODES_PER_REPLICA: Final = 16
#: The longest `idle_after_s` a deployment may set (seconds: a week).
MAX_IDLE_AFTER_S: Final = 7 * 24 * 3600.0
#: A deployment's replicas as the idle keeper sees them (`DeploymentSleep.state`).
AWAKE: Final = "awake"
ASLEEP: Final = "asleep"
WAKING: Final = "waking"
#: The state of a group replica that cannot start: placed and reserved, held back from every node's
#: signed set (`GroupStatus`; the detail says why).
GROUP_PENDING: Final = "pending"
#: The names of evaluation replicas (`EvalBinding`) start with this; no other deployment may.
EVAL_PREFIX: Final = "nexa-eval-"
#: The model name that reaches only deployment D's canary replicas is this plus D
#: (`nexa eval run SUITE --deployment D --canary`).
CANARY_EVAL_PREFIX: Final = EVAL_PREFIX + "canary."
#: The model name that reaches only the new replicas of deployment D's rollout (those that run its
#: spec now) is this plus D (`nexa eval run SUITE --deployment D --rollout`: a suite gate's run).
ROLLOUT_EVAL_PREFIX: Final = EVAL_PREFIX + "rollout."


@attrs.frozen(kw_only=True)
class Resources:
    """What each replica is given."""

    #: Discrete GPUs (exclusive) or shared unified-memory GPUs; 0 runs on the host's memory.
    accelerators: int = 0
    #: Memory reserved per replica; None: the model's own `memory_bytes`.
    memory_bytes: int | None = None
    cpus: float = 1.0
    #: The engine's own memory beyond `memory_bytes` (CUDA context, graphs, activations), reserved
    #: by placement on top of it; None: the runtime adapter's figure (`nexa.adapters.base.ENGINE_OVERHEAD_BYTES`).
    overhead_bytes: int | None = None


@attrs.frozen(kw_only=True)
class RuntimeOptions:
    """How each replica's container is started.

    For every runtime kind but `sim`, the runtime adapter (`nexa.adapters`) builds the command
    line, readiness probe and /dev/shm size from `settings`, checked against its schema when the
    deployment is created (an unknown name or a bad value is refused, 400), then appends
    `extra_args`: any other flag of the runtime, passed as given, except the flags nexa owns
    (refused, 422 `runtime_flag_owned` naming each). `command`, when not empty, replaces the
    adapter's command line entirely and drops the unified-memory bound (then `settings` and
    `extra_args` must be empty): prefer settings and extra_args. A `sim` runtime takes its
    flags from `command` and no settings.
    """

    #: The first loopback port to try; each replica on a node gets the lowest port from here not in use there.
    port: int = 18000
    command: list[str] = attrs.Factory(list)
    #: Plain settings only, never secrets (the node agent refuses known secret names).
    env: dict[str, str] = attrs.Factory(dict)
    #: The node agent's readiness probe, run inside the container; empty: the adapter's (`sim`: `true`).
    health_command: list[str] = attrs.Factory(list)
    #: The runtime adapter's settings (JSON scalars), e.g. {"max_model_len": 8192}; see `nexa.adapters`.
    settings: dict[str, object] = attrs.Factory(dict)
    #: More arguments for the runtime, after the adapter's and the settings' (`--flag value` or `--flag=value`).
    extra_args: list[str] = attrs.Factory(list)


@attrs.frozen(kw_only=True)
class PlacementSpec:
    policy: PlacementPolicy = PlacementPolicy.SPREAD
    #: Labels every chosen node must carry with exactly these values.
    node_selector: dict[LabelKey, LabelValue] = attrs.Factory(dict)
    #: Data classes every chosen node must be allowed to process.
    data_classes: list[DataClassName] = attrs.Factory(list)
    #: `amd64` or `arm64`; None: any.
    arch: str | None = None
    #: Taint keys tolerated.
    tolerations: list[LabelKey] = attrs.Factory(list)


@attrs.frozen(kw_only=True)
class RoutingWeights:
    """How the gateway's router weighs a replica's load terms (`control/datapath/routing.py`); each 0..100.

    A replica's score (lower wins) is `queue * (reported queue depth + requests in flight to it)
    + kv_cache * kv/(1 - kv)` (the KV-cache term grows sharply near full: 0.5 → 1, 0.9 → 9, at
    most 100), less `prefix * gateway.affinity_slack` for the replica the request's prefix hashes
    to. The defaults (1, 1, 1) weigh a queued request, a half-full KV cache and one request of
    affinity slack alike.
    """

    queue: float = 1.0
    kv_cache: float = 1.0
    prefix: float = 1.0


@attrs.frozen(kw_only=True)
class DeploymentCreate:
    """A deployment to create, or (for `POST /api/v1/capacity/forecast`) one to try."""

    name: str
    runtime: str
    #: Exactly one of `alias` and `model`.
    alias: str | None = None
    model: ModelRef | None = None
    replicas: int = 1
    resources: Resources = Resources()
    options: RuntimeOptions = RuntimeOptions()
    placement: PlacementSpec = PlacementSpec()
    routing: RoutingWeights = RoutingWeights()
    #: What `nexa bench` runs are judged against (`POST /api/v1/deployments/{name}/objectives` changes it).
    objectives: ServiceObjectives = attrs.Factory(ServiceObjectives)
    #: The nodes each replica spans (1..`MAX_NODES_PER_REPLICA`): above 1, a replica is a group of
    #: that many ranks, one per node, all on nodes that share one fabric. Each rank gets
    #: `resources.accelerators` GPUs on its own node and an even share of the replica's memory
    #: (plus the engine's overhead); the tensor and pipeline parallel sizes are runtime settings.
    nodes_per_replica: int = 1
    #: How its rollouts are watched; None: a new version (promote, alias) is watched for breaches
    #: without holding each step, a change of runtime or settings with `RolloutPolicy()`.
    rollout_policy: RolloutPolicy | None = None
    #: Sleep when idle (`IdleSettings`): after this many seconds without requests its replicas
    #: sleep (needs `min_replicas` 0); None: always awake.
    idle_after_s: float | None = None
    #: 0: it may sleep when idle (with `idle_after_s`); None: it never sleeps.
    min_replicas: int | None = None
    #: Swap on demand may put it to sleep, while idle, to make room for another deployment that must wake.
    evictable: bool = False


@attrs.frozen(kw_only=True)
class IdleSettings:
    """`POST /api/v1/deployments/{name}/idle`: when it sleeps, and whether swap on demand may put it to sleep."""

    idle_after_s: float | None = None
    min_replicas: int | None = None
    evictable: bool = False


@attrs.frozen(kw_only=True)
class ScaleRequest:
    replicas: int


@attrs.frozen(kw_only=True)
class Replica:
    """One replica of a deployment on one node: the id of its assignment there, its GPUs, its version."""

    id: str
    node_id: str
    gpus: list[str] = attrs.Factory(list)
    #: The model version it runs; None only in records written before rollouts existed (the
    #: deployment's `model` then; the controller fills it in when it loads them).
    model: ModelRef | None = None
    #: A group replica's ranks (`nodes_per_replica` above 1), by rank; rank 0 is the head, on
    #: `node_id` with `gpus`. Empty for a replica on one node.
    members: list[ReplicaMember] = attrs.Factory(list)
    #: The runtime and settings it was started with (`records.spec_key`); None: the deployment's own
    #: now (a change of runtime or settings stamps every replica with what it runs first).
    spec: str | None = None

    @property
    def node_ids(self) -> list[str]:
        """The nodes it runs on: its members' by rank, else its one node."""
        return [m.node_id for m in self.members] or [self.node_id]


@attrs.frozen(kw_only=True)
class ReplicaMember:
    """One rank of a group replica: the node it runs on and the GPUs it is given there."""

    rank: int
    node_id: str
    gpus: list[str] = attrs.Factory(list)


@attrs.frozen(kw_only=True)
class CanaryObjective:
    """What a canary must hold over a sliding window, else it is rolled back automatically."""

    #: Failed share of the canary's finished requests (0..1) above which it is rolled back.
    max_error_rate: float = 0.05
    #: p95 latency of the canary's requests (ms) above which it is rolled back; None: not checked.
    max_p95_ms: float | None = None
    #: The window the figures cover (seconds; never reaching back before the canary started).
    window_s: float = 60.0
    #: Fewer requests than this in the window decide nothing.
    min_requests: int = 20


class SuiteRunBy(enum.StrEnum):
    """Who runs a suite gate's measured run (`CanarySuite.run_by`)."""

    #: The leading controller, itself, through the gateway as the gate's `tenant`
    #: (`control.operations.suitegate`).
    CONTROLLER = "controller"
    #: An operator, with `nexa eval run SUITE --deployment D --rollout|--canary` and an inference key.
    OPERATOR = "operator"


@attrs.frozen(kw_only=True)
class CanarySuite:
    """A suite gate: a canary is promoted (a rollout's new replica passes) only once a measured run
    of `suite` against its own replicas was recorded since it started (became Ready), with every
    metric's pass rate at least `min_pass_rate`.

    The run is the controller's (`run_by` `controller`, the default: it starts the run itself, as
    tenant `tenant`, whose quotas and limits apply and whose usage it is) or an operator's
    (`operator`: `nexa eval run SUITE --deployment D --canary|--rollout`); either way the newest
    run recorded decides, an operator's run included. A gate kept before `run_by` existed names no
    tenant: its runs are the operator's (`by_controller`)."""

    suite: str
    min_pass_rate: float = 1.0
    run_by: SuiteRunBy = SuiteRunBy.CONTROLLER
    #: The tenant the controller's run calls the gateway as; required when the controller runs it.
    tenant: str | None = None

    @property
    def by_controller(self) -> bool:
        """Whether the controller runs the gate's suite itself (else an operator does)."""
        return self.run_by is SuiteRunBy.CONTROLLER and self.tenant is not None


@attrs.frozen(kw_only=True)
class CanaryCreate:
    """`POST /api/v1/deployments/{name}/canary`: run `model` beside the deployment on extra replicas."""

    model: ModelRef
    #: Extra replicas for the canary (placed beside the deployment's own, which stay).
    replicas: int = 1
    #: Share of the deployment's requests (strictly between 0 and 1) sent to the canary.
    weight: float
    objective: CanaryObjective = CanaryObjective()
    #: A suite to pass before promotion (else 409 `canary_suite_unmet`); None: none.
    suite: CanarySuite | None = None


@attrs.frozen(kw_only=True)
class Canary:
    """A canary running on a deployment."""

    model: ModelRef
    weight: float
    objective: CanaryObjective
    #: How many canary replicas were asked for; `placed` are where they run.
    replicas: int
    placed: list[Replica]
    started_at: float
    started_by: str | None
    suite: CanarySuite | None = None


#: The most steps a rollout keeps (the oldest go first).
MAX_ROLLOUT_STEPS: Final = 100
#: The longest soak a rollout policy may ask for (seconds).
MAX_SOAK_S: Final = 86_400.0


@attrs.frozen(kw_only=True)
class RolloutPolicy:
    """How a rollout watches each new replica before it replaces the next one.

    Each new replica, once Ready, soaks for `soak_s`: its requests (those served on its nodes since
    it became Ready) are held against the deployment's `objectives` (error rate; TTFT, TPOT and
    end-to-end p95 where set and measured) once there are at least `min_requests` of them. A breach
    reverts the changed replicas to the last good spec. A replica that soaked its time unbroken
    lets the next step go (with fewer than `min_requests` requests it keeps soaking).

    With `suite` (the canary's gate, `CanarySuite`), a replica that soaked its time unbroken is
    held further until a measured run of that suite against the rollout's new replicas is recorded
    since it became Ready (the controller's own run, or `nexa eval run SUITE --deployment D
    --rollout` where the gate is run by an operator): every metric's pass rate at least
    `suite.min_pass_rate` passes it, anything less reverts the rollout as a breach does."""

    soak_s: float = 30.0
    min_requests: int = 20
    #: A suite each new replica must pass after its soak; None: none.
    suite: CanarySuite | None = None
    #: An adapter rollout in place (`Rollout.in_place`): the share of the moved aliases' requests
    #: that their new adapter versions take while they soak, from 0.01 to 1.
    adapter_weight: float = 0.1


@attrs.frozen(kw_only=True)
class ReplicaSpec:
    """What a deployment's replicas are started with: the runtime, the model version, the settings."""

    runtime: str
    model: ModelRef
    options: RuntimeOptions
    #: The LoRA adapters its replicas load, by the alias that serves each (`Deployment.loras`).
    loras: dict[str, ModelRef] = attrs.Factory(dict)


@attrs.frozen(kw_only=True)
class Soak:
    """One new replica under watch: since when it is Ready (wall clock) and whether it passed."""

    replica_id: str
    node_ids: list[str]
    ready_at: float
    passed: bool = False
    #: It soaked its time unbroken and now waits for a run of the policy's suite (`RolloutPolicy.suite`).
    suite_wait: bool = False


@attrs.frozen(kw_only=True)
class RolloutStep:
    """One thing that happened in a rollout (`Rollout.steps`)."""

    at: float
    #: `started`, `replaced`, `soaking`, `suite` (a soak waits for its suite), `passed`, `breach`,
    #: `paused`, `resumed`, `undo`, `done`.
    what: str
    detail: str = ""


@attrs.frozen(kw_only=True)
class DeploymentChange:
    """`POST /api/v1/deployments/{name}/change`: a new runtime (image) or settings, rolled out under
    watch; unset fields stay as they are."""

    runtime: str | None = None
    options: RuntimeOptions | None = None
    #: The deployment's rollout policy from now on (None: as it is).
    rollout_policy: RolloutPolicy | None = None


@attrs.frozen(kw_only=True)
class Rollout:
    """A replacement in progress: the deployment's replicas of `from` are replaced, one at a
    time, by replicas of `to` (the deployment's `model` now). In JSON `from_` is `from`."""

    JSON_NAMES: ClassVar[dict[str, str]] = {"from_": "from"}

    from_: ModelRef
    to: ModelRef
    #: What started it: `promote` (a canary promoted), `rollback`, `alias` (the alias moved),
    #: `change` (runtime or settings changed), `adapter` (the LoRA adapters its aliases serve on
    #: the model changed: a new adapter, or a new version of one), `revert` (a watched rollout broke an objective),
    #: `undo` (an operator undid a rollout).
    reason: str
    started_at: float
    #: How each new replica is watched (`RolloutPolicy`); None: not held (a revert).
    policy: RolloutPolicy | None = None
    #: The last good spec: what a breach or `undo` returns the changed replicas to; None for a revert.
    good: ReplicaSpec | None = None
    #: Paused by an operator: no further replica is replaced until resumed (watching goes on).
    paused: bool = False
    #: Each new replica's watch, from the moment it reported Ready.
    soaks: list[Soak] = attrs.Factory(list)
    #: What happened, oldest first (the rollout's job shows them; at most `MAX_ROLLOUT_STEPS`, latest kept).
    steps: list[RolloutStep] = attrs.Factory(list)
    #: An adapter rollout on the same replicas (reason `adapter`, a runtime that loads adapters at
    #: run time, aliases moved to other versions of their adapters): no replica is replaced; they
    #: load the new versions beside the earlier ones (`good.loras`), the new versions take
    #: `policy.adapter_weight` of those aliases' requests and soak as one (the soak `adapters`),
    #: and once passed the earlier versions are unloaded; a breach returns every request to them.
    in_place: bool = False


@attrs.frozen(kw_only=True)
class EvalBinding:
    """What makes a deployment an evaluation replica (`nexa eval run SUITE --model NAME@VERSION`):
    a short-lived deployment of a model version not yet Approved perhaps, named `EVAL_PREFIX`
    plus a random part, that no alias points at and that the gateway serves only to requests naming
    it as their model and authenticated by `key_id`. The controller removes it when `job` is no
    longer running or at `expires_at`, whichever comes first."""

    job: str
    key_id: str
    suite: str
    expires_at: float


@attrs.frozen(kw_only=True)
class Deployment:
    """A deployment as the controller keeps it (desired state plus where its replicas are)."""

    name: str
    runtime: str
    #: The alias it was created from, if any; `model` is what that alias pointed at then.
    alias: str | None
    model: ModelRef
    replicas: int
    resources: Resources
    options: RuntimeOptions
    placement: PlacementSpec
    created_at: float
    created_by: str | None
    updated_at: float
    #: Bumped on every change of the record (scale, re-placement).
    generation: int = 1
    #: The deployment's replicas (during a rollout, of both versions); a canary's are in `canary`.
    placed: list[Replica] = attrs.Factory(list)
    canary: Canary | None = None
    rollout: Rollout | None = None
    #: The version a deployment `rollback` returns to: what ran before the last promotion.
    previous: ModelRef | None = None
    routing: RoutingWeights = RoutingWeights()
    #: Its service objectives (benchmark runs are judged against them); the defaults check errors only.
    objectives: ServiceObjectives = attrs.Factory(ServiceObjectives)
    #: The nodes each replica spans (`DeploymentCreate.nodes_per_replica`).
    nodes_per_replica: int = 1
    #: How its rollouts are watched (`DeploymentCreate.rollout_policy`).
    rollout_policy: RolloutPolicy | None = None
    #: A version a watched rollout reverted: the alias pointing there is not followed again until
    #: it moves elsewhere (or an operator rolls out by hand).
    held_model: ModelRef | None = None
    #: The LoRA adapters its replicas of `model` are started with, by the alias that serves each:
    #: what the registry's aliases served on `model` when the last rollout started. When the aliases
    #: serve another set, the reconciler rolls the replicas to it under watch (`reason` `adapter`).
    loras: dict[str, ModelRef] = attrs.Factory(dict)
    #: A set of adapters a watched rollout reverted: not rolled out again while the aliases serve it.
    held_loras: dict[str, ModelRef] | None = None
    #: Sleep when idle (`DeploymentCreate.idle_after_s`, `min_replicas`, `evictable`).
    idle_after_s: float | None = None
    min_replicas: int | None = None
    evictable: bool = False
    #: Asleep: its replicas are in no node's set (their containers stopped, the artifact and the
    #: runtime cache kept on the node) and their memory is free for placement; `placed` is empty
    #: until a request or `nexa deployments wake` places them again.
    asleep: bool = False
    #: Set on an evaluation replica (`nexa eval run --model`): hidden from clients, see `EvalBinding`.
    eval: EvalBinding | None = None

    def moved_loras(self) -> dict[str, ModelRef]:
        """While an adapter rollout in place soaks (`Rollout.in_place`), by alias, the earlier
        version of each alias it moves (its new one is in `loras`); {} otherwise."""
        rollout = self.rollout
        if rollout is None or not rollout.in_place or rollout.good is None:
            return {}
        return {alias: was for alias, was in rollout.good.loras.items() if self.loras.get(alias, was) != was}


@attrs.frozen(kw_only=True)
class ServingReplica:
    """One replica the gateway may route to: Ready on a Ready node (see `Deployments.serving`)."""

    replica_id: str
    node_id: str
    deployment: str
    model: ModelRef
    #: Serves the deployment's canary version (gets the canary's share of traffic).
    canary: bool = False
    #: Its deployment's routing weights.
    routing: RoutingWeights = RoutingWeights()
    #: The gated capabilities (`Capability.gated`: rerank, score, tokenize, detokenize) its runtime
    #: serves, as its adapter records them (`adapters.serves`); only these reach it.
    serves: frozenset[Capability] = frozenset()
    #: Its runtime keeps Responses API responses in its memory (`adapters.keeps_responses`): a
    #: request continuing one (`previous_response_id`) is routed to this replica alone.
    keeps_responses: bool = False


@attrs.frozen(kw_only=True)
class ServingSet:
    """Where requests for one alias (or pinned version) may go now."""

    #: The model version the alias points at (what stable replicas serve).
    model: ModelRef
    replicas: list[ServingReplica]
    #: Share of requests (0..1) for canary replicas while a canary runs; 0 otherwise.
    canary_weight: float = 0.0
    #: Deployments serving it, Ready or not (empty: nothing deployed at all).
    deployments: list[str] = attrs.Factory(list)


@attrs.frozen(kw_only=True)
class ReplicaScore:
    """One replica's routing score terms now (`control/datapath/routing.py`; lower wins), in `deployments show`."""

    replica_id: str
    node_id: str
    canary: bool = False
    #: The runtime's load report: `fresh`, `stale` (older than gateway.load_max_age_s: ignored),
    #: `none` (none sent, or the node unreachable) or `failing` (its metrics endpoint fails).
    report: str
    #: How old the report is (seconds); None without one.
    report_age_s: float | None = None
    #: Why the runtime's metrics endpoint fails (`report` is `failing`); readiness is not affected.
    metrics_error: str | None = None
    #: What the runtime reported (used only while `fresh`).
    queue_reported: float | None = None
    running_reported: float | None = None
    kv_cache_ratio: float | None = None
    #: The gateway's own requests in flight to it (always fresh).
    in_flight: int = 0
    #: The weighted terms and their sum (`score`); `affinity_bonus` is taken off the score of the
    #: replica a request's prefix hashes to.
    queue_term: float = 0.0
    kv_term: float = 0.0
    affinity_bonus: float = 0.0
    score: float = 0.0


@attrs.frozen(kw_only=True)
class ReplicaMeasured:
    """What one replica's node measured it to hold (`wire.ReplicaMemory.measured_bytes`)."""

    replica_id: str
    node_id: str
    measured_bytes: int


@attrs.frozen(kw_only=True)
class DeploymentMemory:
    """A deployment's memory, declared against measured (`deployments show`)."""

    #: Per replica: `resources.memory_bytes` (else the model's), what the runtime's own setting bounds.
    declared_bytes: int
    #: The engine's own memory beyond it (the deployment's `resources.overhead_bytes`, else its adapter's).
    overhead_bytes: int
    #: The most any replica of this runtime, model and settings was measured to hold; None: never measured.
    measured_bytes: int | None
    #: What placement reserves per replica: declared plus overhead, or the measured figure when larger.
    reserved_bytes: int
    #: What each replica reported in its node's last heartbeat.
    replicas: list[ReplicaMeasured] = attrs.Factory(list)


@attrs.frozen(kw_only=True)
class DeploymentView:
    deployment: Deployment
    #: Replicas placed now; fewer than `deployment.replicas` while nodes cannot take the rest.
    ready_to_run: int
    #: Why the last placement attempt fell short; None when every replica is placed.
    problem: str | None = None
    #: Of `deployment.placed`, those whose node reports them Ready.
    ready: int = 0
    #: Of the canary's replicas, those whose node reports them Ready.
    canary_ready: int = 0
    #: During a rollout: replicas of the new version placed, and of the old version left.
    rollout_new: int = 0
    rollout_old: int = 0
    #: Each placed replica's routing score terms (canary's too); filled by `GET /api/v1/deployments/{name}`.
    replica_scores: list[ReplicaScore] = attrs.Factory(list)
    #: Declared against measured memory; filled by `GET /api/v1/deployments/{name}`.
    memory: DeploymentMemory | None = None
    #: Each group replica's state (a deployment with `nodes_per_replica` above 1), the canary's too.
    groups: list[GroupStatus] = attrs.Factory(list)
    #: Awake or asleep, its last request and its last wake (`control.deployments.idle`).
    sleep: DeploymentSleep | None = None


@attrs.frozen(kw_only=True)
class DeploymentSleep:
    """Where a deployment stands with sleep when idle (`deployments show`, the console)."""

    #: `awake`, `asleep` or `waking`.
    state: str
    #: When its last request arrived (Unix seconds); None: none since the controller started.
    last_request_at: float | None = None
    #: How long its last wake took (seconds, from asleep to Ready); None: not woken since the controller started.
    last_wake_s: float | None = None
    #: Seconds left before it sleeps when idle; None: it does not sleep (or sleeps already).
    sleeps_in_s: float | None = None


@attrs.frozen(kw_only=True)
class GroupStatus:
    """Where one group replica stands (its members are the replica's `members`)."""

    replica_id: str
    #: `pending` (placed and reserved, not sent to its nodes: `detail` says why), `starting` (its
    #: workers sent), `starting-head`, `ready` or `restarting` (`control.deployments.grouprun`).
    state: str
    #: Why, in words.
    detail: str = ""
    canary: bool = False
    #: Each member's runtime state as its node reports it, by rank.
    members: list[GroupMemberStatus] = attrs.Factory(list)


@attrs.frozen(kw_only=True)
class GroupMemberStatus:
    """One member of a group replica as its node reports it."""

    rank: int
    node_id: str
    #: The runtime's state (`wire.RuntimeState`); "" while the node reports none (not sent, or not yet).
    state: str = ""


@attrs.frozen(kw_only=True)
class RolloutResult:
    """What `promote` and `rollback` of a deployment did: the deployment after, and the alias
    receipt when its alias moved (None for a pinned deployment or a canary merely removed)."""

    deployment: DeploymentView
    alias: AliasReceipt | None = None


@attrs.frozen(kw_only=True)
class DeploymentList:
    """`GET /api/v1/deployments`: a page, by name (`contracts.pages`)."""

    deployments: list[DeploymentView]
    #: The cursor of the next page; None at the end (and from controllers that did not page).
    next_cursor: str | None = None


@attrs.frozen(kw_only=True)
class PlacementView:
    """`GET /api/v1/deployments/{id}/placement`: the last decision taken for the deployment."""

    deployment: str
    decision: PlacementDecision | None
    #: What its first placed replica runs, as signed: the container's entrypoint and command
    #: (`{runtime_host}` where the node puts its runtime address); empty before a replica is placed.
    process: list[str] = attrs.Factory(list)


def deployment_problems(req: DeploymentCreate) -> list[str]:
    """Everything wrong with a request's shape (not whether the registry or the fleet allow it)."""
    problems = [p for p in (name_problem("name", req.name), name_problem("runtime", req.runtime)) if p]
    if req.name.startswith(EVAL_PREFIX):
        problems.append(f"name: {EVAL_PREFIX}* is kept for evaluation replicas (`nexa eval run --model`)")
    if (req.alias is None) == (req.model is None):
        problems.append("alias, model: give exactly one (an alias, or a pinned model version)")
    if req.alias is not None and (p := name_problem("alias", req.alias)):
        problems.append(p)
    if req.model is not None:
        problems += [
            p
            for p in (name_problem("model.model", req.model.model), version_problem("model.version", req.model.version))
            if p
        ]
    if not 1 <= req.replicas <= MAX_REPLICAS:
        problems.append(f"replicas: from 1 to {MAX_REPLICAS}")
    if not 1 <= req.nodes_per_replica <= MAX_NODES_PER_REPLICA:
        problems.append(f"nodes_per_replica: from 1 to {MAX_NODES_PER_REPLICA}")
    problems += resources_problems(req.resources)
    if not 1 <= req.options.port <= 65535:
        problems.append("options.port: from 1 to 65535")
    problems += [f"placement.data_classes: {p}" for d in req.placement.data_classes if (p := data_class_problem(d))]
    problems += routing_problems(req.routing, "routing.")
    if req.rollout_policy is not None:
        problems += rollout_policy_problems(req.rollout_policy)
    problems += idle_problems(
        IdleSettings(idle_after_s=req.idle_after_s, min_replicas=req.min_replicas, evictable=req.evictable)
    )
    if req.idle_after_s is not None and req.nodes_per_replica > 1:
        problems.append("idle_after_s: a deployment whose replicas span nodes (nodes_per_replica above 1) never sleeps")
    return problems


def resources_problems(r: Resources) -> list[str]:
    """Every field of a replica's resources out of its range."""
    problems = []
    if r.accelerators < 0:
        problems.append("resources.accelerators: 0 or more")
    if r.memory_bytes is not None and r.memory_bytes <= 0:
        problems.append("resources.memory_bytes: a positive number of bytes")
    if r.overhead_bytes is not None and not 0 <= r.overhead_bytes <= MAX_BYTES:
        problems.append("resources.overhead_bytes: 0 or more bytes")
    if not r.cpus > 0:
        problems.append("resources.cpus: more than 0")
    return problems


def rollout_policy_problems(policy: RolloutPolicy) -> list[str]:
    """Every field of a rollout policy out of its range."""
    problems = []
    if not 0 <= policy.soak_s <= MAX_SOAK_S:  # also False for NaN
        problems.append(f"rollout_policy.soak_s: from 0 to {MAX_SOAK_S:g}")
    if not 1 <= policy.min_requests <= 1_000_000:
        problems.append("rollout_policy.min_requests: from 1 to 1000000")
    if policy.suite is not None:
        problems += suite_gate_problems(policy.suite, "rollout_policy.suite")
    if not 0.01 <= policy.adapter_weight <= 1:  # also False for NaN
        problems.append("rollout_policy.adapter_weight: from 0.01 to 1")
    return problems


def suite_gate_problems(gate: CanarySuite, where: str = "suite") -> list[str]:
    """Everything wrong with a suite gate's shape (not whether the suite is registered)."""
    problems = []
    if p := name_problem(f"{where}.suite", gate.suite):
        problems.append(p)
    if not 0 <= gate.min_pass_rate <= 1:  # also False for NaN
        problems.append(f"{where}.min_pass_rate: from 0 to 1")
    if gate.run_by is SuiteRunBy.CONTROLLER and gate.tenant is None:
        problems.append(
            f"{where}.tenant: the tenant the controller runs the suite as (its quotas and limits apply, "
            f"the usage is its own), or {where}.run_by operator"
        )
    elif gate.tenant is not None and (p := name_problem(f"{where}.tenant", gate.tenant)):
        problems.append(p)
    return problems


def idle_problems(s: IdleSettings) -> list[str]:
    """Everything wrong with sleep-when-idle settings (`IdleSettings`)."""
    problems = []
    if s.idle_after_s is not None and not 0 < s.idle_after_s <= MAX_IDLE_AFTER_S:  # also NaN
        problems.append(f"idle_after_s: more than 0 seconds, at most {MAX_IDLE_AFTER_S:g} (or null: never sleeps)")
    if s.min_replicas not in {None, 0}:
        problems.append("min_replicas: 0 (sleeps when idle, with idle_after_s) or null (never sleeps)")
    elif (s.idle_after_s is None) != (s.min_replicas is None):
        problems.append("idle_after_s, min_replicas: give both (idle_after_s and min_replicas 0) or neither")
    if s.evictable and s.min_replicas != 0:
        problems.append("evictable: only a deployment that may sleep (min_replicas 0, with idle_after_s)")
    return problems


def routing_problems(w: RoutingWeights, where: str = "") -> list[str]:
    """Every routing weight outside 0..MAX_ROUTING_WEIGHT (or not a finite number)."""
    return [
        f"{where}{name}: from 0 to {MAX_ROUTING_WEIGHT:g}"
        for name, value in (("queue", w.queue), ("kv_cache", w.kv_cache), ("prefix", w.prefix))
        if not 0.0 <= value <= MAX_ROUTING_WEIGHT  # also False for NaN
    ]


def canary_problems(req: CanaryCreate) -> list[str]:
    """Everything wrong with a canary request's shape (not whether the registry or the fleet allow it)."""
    problems = [
        p
        for p in (name_problem("model.model", req.model.model), version_problem("model.version", req.model.version))
        if p
    ]
    if not 1 <= req.replicas <= MAX_REPLICAS:
        problems.append(f"replicas: from 1 to {MAX_REPLICAS}")
    if not 0 < req.weight < 1:
        problems.append("weight: strictly between 0 and 1")
    o = req.objective
    if not 0 <= o.max_error_rate <= 1:
        problems.append("objective.max_error_rate: from 0 to 1")
    if o.max_p95_ms is not None and not o.max_p95_ms > 0:
        problems.append("objective.max_p95_ms: more than 0 (or null)")
    if not 0 < o.window_s <= MAX_WINDOW_S:
        problems.append(f"objective.window_s: more than 0, at most {MAX_WINDOW_S:g}")
    if o.min_requests < 1:
        problems.append("objective.min_requests: 1 or more")
    if req.suite is not None:
        problems += suite_gate_problems(req.suite)
    return problems


@attrs.frozen(kw_only=True)
class RolloutStatus:
    """`GET /api/v1/deployments/{name}/rollout`: the rollout in progress, if any, and its counts."""

    deployment: str
    rollout: Rollout | None
    #: Replicas that run the deployment's spec now, and those left to replace.
    new: int = 0
    old: int = 0
    #: The runtime and settings the deployment runs now.
    runtime: str = ""
    #: The version a watched rollout reverted (its alias is not followed there).
    held_model: ModelRef | None = None
    #: The rollout's suite gate (`RolloutPolicy.suite`) now: what it waits for and who runs it (the
    #: controller as its tenant, or an operator with the command to run), or that it waits for the
    #: soak first; None without a gate.
    suite: str | None = None
