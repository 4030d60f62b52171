"""`serve_control`: the controller's composition root. The only hypercorn importer.

Start order: store (lock, migrate, new epoch) → accounts, keys (their fingerprint checked against
the store's), leadership, fleet → outbound clients and the model registry → deployments, quotas,
metering, workloads, gateway → recovery (begins before the node channel serves when the store was
restored or `recover` is set) → the leadership's first lease round → node channel → (a shared
store: the change feed, `control.cluster.follow`) → the loops that decide desired state (on a shared
store only while this controller leads, `cluster.leading`) → HTTP (the inference routes in front of the
management app, which `control.cluster.forward` wraps: a follower passes writes to the leader). The store owns the
epoch; receipts, `/version` and the node channel read it through the leadership (solo, on SQLite: the
store's, so the one advance a recovery's end makes reaches them all at once; leased: the lease's).
Shutdown is the reverse: HTTP stops accepting and drains in-flight requests for
`http.graceful_timeout_s`, then the background loops are cancelled (bounded by
their own shielded timeouts; metering writes what is pending), then the store closes last.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Final

import attrs
import hypercorn.config
import hypercorn.trio
import trio

from nexa import __version__, security, tls
from nexa.config import ControlConfig, HttpConfig, NodesConfig, parse_host_port
from nexa.control import store as st
from nexa.control.access.accounts import Accounts
from nexa.control.cluster import leading
from nexa.control.cluster.follow import LIVE_LEASES, ChangeFeed, other_live_controllers
from nexa.control.cluster.forward import Forwarder
from nexa.control.cluster.leadership import Leadership
from nexa.control.cluster.workers import own_listener, worker_config
from nexa.control.datapath.admission import Admission
from nexa.control.datapath.gateway import Gateway
from nexa.control.datapath.inference import InferenceApp
from nexa.control.datapath.metering import Meter
from nexa.control.datapath.pins import Pins
from nexa.control.datapath.quotas import Quotas
from nexa.control.datapath.retention import Retention, load_retention_key
from nexa.control.datapath.routing import Router
from nexa.control.datapath.workloads import Workloads
from nexa.control.deployments import Deployments
from nexa.control.deployments.rollout import RolloutWatcher
from nexa.control.fleet.keyring import ControllerKeys, KeyRotation, load_or_create_keys, retired_signing_key
from nexa.control.fleet.nodes import Fleet
from nexa.control.fleet.southbound import Southbound
from nexa.control.http import openapi
from nexa.control.http.api import create_app
from nexa.control.http.state import AppState, ControllerPublicKeys
from nexa.control.operations.backup import Backups, load_key
from nexa.control.operations.benchmarks import Benchmarks
from nexa.control.operations.evals import Evals
from nexa.control.operations.evidence import Evidence
from nexa.control.operations.jobs import Jobs, RolloutJobs
from nexa.control.operations.qualification import Qualifications
from nexa.control.operations.recovery import Recovery, refuse_forced
from nexa.control.operations.suitegate import GateRuns
from nexa.control.registry.models import ModelRegistry
from nexa.control.registry.outbound import Outbound
from nexa.control.store import Store, StoreOpener, open_store
from nexa.errors import ControllerKeysDiffer
from nexa.oci import registry_credentials
from nexa.s3.client import S3Client
from nexa.s3.credentials import s3_credentials
from nexa.supervision import Supervision, supervised, watch_event_loop
from nexa.telemetry import Metrics

log = logging.getLogger(__name__)


KEYS_DIR: Final = "keys"


def _public(keys: ControllerKeys) -> ControllerPublicKeys:
    # The Curve key new nodes pin: a rotation's new one from the rotation on (served beside the old).
    return ControllerPublicKeys(signing=keys.signing.public.b64, curve=keys.newest_curve.public)


@attrs.frozen(kw_only=True)
class ControlStarted:
    """What `nursery.start(serve_control, ...)` returns once the controller answers HTTP."""

    urls: list[str]
    #: The node channel endpoint nodes are told to dial.
    channel: str
    epoch: int
    #: The bootstrap admin key, present only on the first start when it was generated here.
    admin_key: str | None


def _bind(listen: str) -> str:
    host, port = parse_host_port(listen)
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class _HttpsConfig(hypercorn.config.Config):
    """hypercorn serving https with nexa's context (`tls.ServerTls`: re-read when its files change)
    instead of one hypercorn would make once from file names."""

    def __init__(self, context: ssl.SSLContext) -> None:
        super().__init__()
        self._context = context

    @property
    def ssl_enabled(self) -> bool:
        return True

    def create_ssl_context(self) -> ssl.SSLContext:
        return self._context


def hypercorn_config(
    cfg: HttpConfig,
    *,
    shared_fd: int | None = None,
    server_tls: tls.ServerTls | None = None,
    own_fd: int | None = None,
) -> hypercorn.config.Config:
    """hypercorn's settings for `cfg`: it binds `listen` itself, or serves `shared_fd` there (a
    socket `shared_listener` made, which hypercorn then owns and closes), and binds `extra_listen`;
    every address serves https with `server_tls` when it is given, but `own_fd` (a gateway worker's
    own loopback address, `workers.own_listener`), always plain http."""
    hc = hypercorn.config.Config() if server_tls is None else _HttpsConfig(server_tls.context)
    hc.bind = [_bind(cfg.listen) if shared_fd is None else f"fd://{shared_fd}", *map(_bind, cfg.extra_listen)]
    if own_fd is not None:
        (hc.bind if server_tls is None else hc.insecure_bind).append(f"fd://{own_fd}")
    hc.graceful_timeout = cfg.graceful_timeout_s
    hc.keep_alive_timeout = cfg.keep_alive_timeout_s
    hc.accesslog = None  # nexa.control.http.api writes one structured line per request
    hc.errorlog = logging.getLogger("hypercorn.error")
    hc.include_server_header = False
    return hc


def shared_listener(listen: str) -> socket.socket:
    """A TCP socket bound to `listen` with SO_REUSEPORT and SO_REUSEADDR, not yet listening: every
    worker on this host binds one the same way and the kernel spreads new connections over them
    (Linux lets only sockets of the same user into one port's group)."""
    host, port = parse_host_port(listen)
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.bind((host, port))
    except BaseException:
        sock.close()
        raise
    return sock


async def _serve_http(
    app: InferenceApp,
    cfg: HttpConfig,
    *,
    shutdown_trigger: Callable[[], Awaitable[None]],
    server_tls: tls.ServerTls | None = None,
    own: socket.socket | None = None,
    task_status: trio.TaskStatus[list[str]] = trio.TASK_STATUS_IGNORED,
) -> None:
    """hypercorn on `cfg`'s addresses. With `reuse_port` (or as a gateway worker: `own`, its own
    address, kept open and handed over as a duplicate) the shared socket is made afresh at each
    (re)start of this loop and handed over (`fd://`): while a restart waits, the kernel sends new
    connections to the other workers instead of a backlog nobody accepts from."""
    shared_fd = shared_listener(cfg.listen).detach() if cfg.reuse_port or own is not None else None
    own_fd = None if own is None else os.dup(own.fileno())
    hc = hypercorn_config(cfg, shared_fd=shared_fd, server_tls=server_tls, own_fd=own_fd)
    await hypercorn.trio.serve(app, hc, shutdown_trigger=shutdown_trigger, task_status=task_status)


async def serve_control(
    cfg: ControlConfig,
    *,
    stopping: trio.Event,
    open_store: StoreOpener = open_store,
    recover: bool = False,
    worker: int | None = None,
    task_status: trio.TaskStatus[ControlStarted] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the controller until `stopping` is set; supports the nursery start protocol.

    `worker`: run as gateway worker `worker` of `[http] workers` (`control.cluster.workers`: its
    `open_store` opens the shared SQLite file, `open_store(worker=True)`).

    `recover` starts it in recovery whatever the store says (`nexa control --recover`; see
    `control.operations.recovery`).

    `open_store` opens the state dir's store (a test passes a variant, e.g. one whose store runs its
    transactions inline for autojump_clock).

    A failure before it answers HTTP (a failed start) is raised; afterwards only `StoreUnusable`
    ends it (the CLI exits 3). Every other failure of a loop is logged, counted in
    `nexa_loop_failures_total{loop}` and the loop restarted.
    """
    metrics = Metrics()
    metrics.build_info.info({"version": __version__})
    failures = metrics.loop_failures
    with Supervision(on_failure=lambda loop: failures.labels(loop).inc()).installed():
        await _serve_control(
            cfg,
            metrics,
            stopping=stopping,
            open_store=open_store,
            recover=recover,
            worker=worker,
            task_status=task_status,
        )


@attrs.define(kw_only=True)
class _Controller:
    """The controller's parts, built in start order by the builders below (each one step of the
    module docstring's order); `_run` then starts their loops and HTTP."""

    cfg: ControlConfig
    store: Store
    metrics: Metrics
    accounts: Accounts
    admin_key: str | None
    keys: ControllerKeys
    keys_dir: Path
    leadership: Leadership
    fleet: Fleet
    #: Set by `_planes`.
    models: ModelRegistry = attrs.field(init=False)
    southbound: Southbound = attrs.field(init=False)
    deployments: Deployments = attrs.field(init=False)
    router: Router = attrs.field(init=False)
    recovery: Recovery = attrs.field(init=False)
    retention: Retention = attrs.field(init=False)
    #: Set by `_data_path`.
    quotas: Quotas = attrs.field(init=False)
    meter: Meter = attrs.field(init=False)
    owner: str | None = attrs.field(init=False)
    alone: bool = attrs.field(init=False)
    workloads: Workloads = attrs.field(init=False)
    admission: Admission = attrs.field(init=False)
    gateway: Gateway = attrs.field(init=False)
    pins: Pins = attrs.field(init=False)
    #: Set by `_app_state` and `_front`.
    state: AppState = attrs.field(init=False)
    feed: ChangeFeed | None = attrs.field(init=False)
    forwarder: Forwarder = attrs.field(init=False)
    app: InferenceApp = attrs.field(init=False)
    #: A gateway worker's own address (`workers.own_listener`); None: not a worker.
    own: socket.socket | None = None


async def _serve_control(
    cfg: ControlConfig,
    metrics: Metrics,
    *,
    stopping: trio.Event,
    open_store: StoreOpener,
    recover: bool,
    worker: int | None = None,
    task_status: trio.TaskStatus[ControlStarted],
) -> None:
    refuse_forced(recover, "postgresql" if cfg.store.url else "sqlite")  # before anything is written
    own = None if worker is None else own_listener()
    if own is not None:
        cfg = worker_config(cfg, worker or 0, own.getsockname()[1])
    # https's files, and the CA that verifies the other controllers, are checked before anything is
    # written too: a bad certificate or key stops the start with what to fix (ConfigError).
    server_tls, peer_tls = await trio.to_thread.run_sync(partial(_tls, cfg, metrics))
    async with open_store(cfg.state_dir, cfg.store) as store, contextlib.AsyncExitStack() as stack:
        if own is not None:
            stack.callback(own.close)
        c = await _core(cfg, store, metrics)
        c.own = own
        outbound = await _outbound(cfg, metrics)
        await stack.enter_async_context(outbound)
        c.retention = await stack.enter_async_context(_retention(cfg, store, metrics, c.accounts))
        await _planes(c, outbound, recover=recover)
        await _data_path(c)
        await _app_state(c)
        await _keep_records(
            c.state, c.gateway, controller=c.owner, unowned=c.alone, report_keys=cfg.evidence.trusted_report_keys
        )
        await _key_rotation(c)
        _front(c, peer_tls)
        await _run(c, stopping=stopping, server_tls=server_tls, task_status=task_status)
    log.info("controller stopped")


async def _core(cfg: ControlConfig, store: Store, metrics: Metrics) -> _Controller:
    """API keys (the bootstrap admin key made on a first start), the controller keys, who leads
    (once the keys are known to be the store's) and the fleet."""
    accounts = await Accounts.load(store, metrics)
    admin_key = await accounts.ensure_admin_key(cfg.bootstrap.admin_key_file)
    keys_dir = Path(cfg.state_dir) / KEYS_DIR
    keys = await trio.to_thread.run_sync(partial(load_or_create_keys, keys_dir, overlap_s=cfg.nodes.key_overlap_s))
    await _check_keys(store, keys, keys_dir)
    leadership = leading.leadership(cfg, store, metrics)
    fleet = await _load_fleet(cfg.nodes, store, metrics, leadership)
    return _Controller(
        cfg=cfg,
        store=store,
        metrics=metrics,
        accounts=accounts,
        admin_key=admin_key,
        keys=keys,
        keys_dir=keys_dir,
        leadership=leadership,
        fleet=fleet,
    )


async def _outbound(cfg: ControlConfig, metrics: Metrics) -> Outbound:
    """The clients of OCI registries and the S3 store. Their credentials are re-read when their
    files change; a bad rewrite keeps the last good (and is counted)."""
    registry = await trio.to_thread.run_sync(
        partial(
            registry_credentials,
            cfg.oci.credentials_file,
            on_invalid=metrics.credential_reload_failures.labels("registry").inc,
        )
    )
    s3 = await trio.to_thread.run_sync(
        partial(
            s3_credentials,
            cfg.artifacts.s3_credentials_file,
            profile=cfg.artifacts.s3_profile,
            environ=os.environ,
            on_invalid=metrics.credential_reload_failures.labels("s3").inc,
        )
    )
    return Outbound(cfg.oci, cfg.artifacts, registry_credentials=registry, s3_credentials=s3)


async def _planes(c: _Controller, outbound: Outbound, *, recover: bool) -> None:
    """The model registry, the node protocol, deployments, and recovery (begun before the node
    channel serves when the store was restored or `recover` is set)."""
    cfg, leadership, keys = c.cfg, c.leadership, c.keys
    c.models = await ModelRegistry.load(cfg.models, c.store, c.metrics, outbound)
    c.southbound = Southbound(
        cfg.channel,
        cfg.nodes,
        c.fleet,
        c.metrics,
        curve=keys.curve,
        signing_key=keys.signing,
        epoch=lambda: leadership.epoch,
        stream_window_chunks=cfg.gateway.stream_window_chunks,
        retired_key_ids=[r.key_id for r in keys.retired],
        keys=keys,
        leading=lambda: leadership.is_leader,
    )
    c.router = Router(cfg.gateway, load=c.fleet.replica_load)
    c.deployments = Deployments(
        cfg.nodes,
        c.store,
        c.metrics,
        c.fleet,
        models=c.models,
        southbound=c.southbound,
        placement=cfg.placement,
        router=c.router,
        leadership=leadership,
        tenant_exists=c.accounts.tenant_exists,
    )
    await c.deployments.load()
    c.recovery = Recovery(c.store, c.fleet, c.deployments, c.southbound, c.metrics)
    await c.recovery.begin(forced=recover)


async def _data_path(c: _Controller) -> None:
    """Quotas, metering, workloads, admission and the gateway that runs each inference call."""
    cfg, leadership = c.cfg, c.leadership
    c.quotas = await Quotas.load(c.store, c.metrics, c.accounts.tenant_exists)
    c.meter = Meter(cfg.gateway, c.store, c.metrics, leading=lambda: leadership.is_leader)
    c.owner, c.alone = await leading.owner(cfg, c.store, leadership)
    c.workloads = await Workloads.load(
        c.store, c.keys.signing, controller=c.owner, epoch=lambda: leadership.epoch, unowned=c.alone
    )
    c.admission = Admission(cfg.gateway, c.metrics)
    c.gateway = Gateway(
        cfg.gateway,
        models=c.models,
        deployments=c.deployments,
        relay=c.southbound.relay,
        quotas=c.quotas,
        admission=c.admission,
        router=c.router,
        meter=c.meter,
        idle=c.deployments.idle,
    )
    c.pins = Pins(c.store)


async def _app_state(c: _Controller) -> None:
    """What the management API and the console read and act on."""
    cfg = c.cfg
    backups = Backups(
        cfg=cfg.backup,
        state_dir=Path(cfg.state_dir),
        store=c.store,
        accounts=c.accounts,
        metrics=c.metrics,
        signing_key=c.keys.signing,
        key=await trio.to_thread.run_sync(load_key, cfg.backup.key_file),
    )
    c.state = AppState(
        accounts=c.accounts,
        fleet=c.fleet,
        models=c.models,
        deployments=c.deployments,
        store=c.store,
        metrics=c.metrics,
        started_at=time.time(),
        leadership=c.leadership,
        controller_keys=_public(c.keys),
        signing_key=c.keys.signing,
        quotas=c.quotas,
        meter=c.meter,
        admission=c.admission,
        openapi=openapi.document_json(),
        max_clock_skew_s=cfg.nodes.max_clock_skew_s,
        recovery=c.recovery,
        backups=backups,
        retention=c.retention,
    )


async def _key_rotation(c: _Controller) -> None:
    """The controller keys' rotation (`nexa keys rotate-controller`). Restarted within a rotation's
    overlap, nodes that say hello are still told of it."""
    cfg, keys, state, southbound = c.cfg, c.keys, c.state, c.southbound
    if (prev := keys.previous) is not None and prev.overlap_until > time.time():
        old = await trio.to_thread.run_sync(retired_signing_key, c.keys_dir, prev.key_id)
        await southbound.announce_keys(keys, old, prev.overlap_until, now=False)
    workloads, owner, store = c.workloads, c.owner, c.store
    state.key_rotation = KeyRotation(
        c.keys_dir,
        keys,
        overlap_s=cfg.nodes.key_overlap_s,
        accounts=c.accounts,
        announce=southbound.announce_keys,
        serve_next_curve=southbound.serve_next_curve,
        on_rotated=[lambda k: workloads.use_signing_key(k.signing), partial(_use_keys, state)],
        lock=Backups.of(state.backups).lock,
        switch=southbound.switch_curve,
        others=None if owner is None else partial(other_live_controllers, store, owner, cfg.cluster.lease_s),
        others_gone_after_s=LIVE_LEASES * cfg.cluster.lease_s,
    )


def _front(c: _Controller, peer_tls: tls.ClientTls) -> None:
    """The HTTP front: the inference routes in front of the management app. Several controllers on
    one store: each keeps its caches up with the store (the change feed), and a follower passes
    management writes to the leader (the forwarder). Neither on the embedded store."""
    cfg = c.cfg
    c.feed = leading.change_feed(
        cfg,
        c.store,
        c.leadership,
        accounts=c.accounts,
        models=c.models,
        fleet=c.fleet,
        deployments=c.deployments,
        quotas=c.quotas,
    )
    c.forwarder = Forwarder(
        create_app(cfg.http, c.state),
        c.leadership,
        controller_id=c.leadership.controller_id,
        max_body_bytes=cfg.http.max_body_bytes,
        after_write=c.feed.catch_up if c.feed is not None else None,
        trusted_proxies=cfg.http.trusted_proxies,
        metrics=c.metrics,
        peer_tls=peer_tls,
        allow_plain_http_peers=cfg.cluster.allow_plain_http_peers,
    )
    c.app = InferenceApp(
        c.forwarder,
        cfg=cfg.gateway,
        gateway=c.gateway,
        workloads=c.workloads,
        accounts=c.accounts,
        metrics=c.metrics,
        pins=c.pins,
        max_body_bytes=cfg.http.max_body_bytes,
        body_timeout_s=cfg.http.body_timeout_s,
        retention=c.retention,
    )


_Loops = list[tuple[str, Callable[..., Awaitable[object]]]]


def _leader_loops(c: _Controller) -> _Loops:
    """The loops that decide desired state: on a shared store they run only while this one leads."""
    state = c.state
    return [
        ("deployments", c.deployments.run),
        ("idle", c.deployments.idle.run),
        ("recovery", c.recovery.run),
        ("rollout", RolloutWatcher(c.deployments, c.meter).run),
        ("rollout-watch", c.deployments.change_watcher(c.meter).run),
        ("workloads", partial(c.workloads.run, c.cfg.gateway.workload_retention_s)),
        ("stored-responses", c.pins.run),
        ("backup", Backups.of(state.backups).run),
        ("keys", KeyRotation.of(state.key_rotation).run),
        ("qualifications", Qualifications.of(state.qualifications).run),
        ("eval-replicas", Evals.of(state.evals).run_sweeps),
        ("suite-gates", _gate_runs(c).run),
        ("retention-purge", c.retention.run_purges),
        *leading.orphans(c.cfg, c.store, c.owner, c.workloads, Jobs.of(state.jobs)),
    ]


def _gate_runs(c: _Controller) -> GateRuns:
    """The suite gates' runs the controller makes itself, through its own gateway (`suitegate`)."""
    state = c.state
    return GateRuns(
        c.deployments,
        Evals.of(state.evals),
        Jobs.of(state.jobs),
        c.gateway,
        tenant_exists=c.accounts.tenant_exists,
        audit=c.accounts.record,
        deadline_s=c.cfg.gateway.default_deadline_s,
    )


def _always_loops(c: _Controller) -> _Loops:
    """The loops every controller runs, leading or not."""
    return [
        ("gateway", c.gateway.run),
        ("disconnects", c.app.disconnects.run),
        ("watchdog", partial(watch_event_loop, c.metrics.count_stall)),
        ("forward", c.forwarder.run),
        ("retention", c.retention.run),
    ]


async def _run(
    c: _Controller,
    *,
    stopping: trio.Event,
    server_tls: tls.ServerTls | None,
    task_status: trio.TaskStatus[ControlStarted],
) -> None:
    """Every loop runs supervised (nexa.supervision): a failure is logged, counted and the loop
    restarted; only an unusable store or a failed start ends the process. Metering has its own
    nursery, outside the other loops: it stops last, so the usage of every call those loops end
    (embedding batches, streams cut at shutdown) is written."""
    async with trio.open_nursery() as metering:
        await metering.start(supervised, "metering", c.meter.run)
        async with trio.open_nursery() as loops:
            # First: the role is known before the node channel serves (a lease round).
            await loops.start(supervised, "leadership", c.leadership.run)
            channel = await loops.start(supervised, "southbound", c.southbound.run)
            await leading.start_leading(loops, c.leadership, c.feed, c.southbound, _leader_loops(c))
            for name, loop in _always_loops(c):
                await loops.start(supervised, name, loop)
            log.info("node channel bound", extra={"fields": {"endpoint": channel}})
            await _serve_until_stopped(c, channel, stopping=stopping, server_tls=server_tls, task_status=task_status)
            # hypercorn returned: in-flight requests have drained. Stop the loops; the store
            # closes when `open_store` exits, last.
            loops.cancel_scope.cancel()
        metering.cancel_scope.cancel()


async def _serve_until_stopped(
    c: _Controller,
    channel: str,
    *,
    stopping: trio.Event,
    server_tls: tls.ServerTls | None,
    task_status: trio.TaskStatus[ControlStarted],
) -> None:
    """HTTP until `stopping` is set and in-flight requests have drained."""
    leadership = c.leadership
    async with trio.open_nursery() as http:
        serve = partial(
            _serve_http, c.app, c.cfg.http, shutdown_trigger=stopping.wait, server_tls=server_tls, own=c.own
        )
        binds: list[str] = await http.start(supervised, "http", serve)
        c.state.ready = True
        http.start_soon(_unready_on, stopping, c.state)
        fields = {
            "urls": binds,
            "epoch": leadership.epoch,
            "role": leadership.role,
            "version": __version__,
            "recovering": c.recovery.active,
        }
        log.info("controller serving", extra={"fields": fields})
        task_status.started(ControlStarted(urls=binds, channel=channel, epoch=leadership.epoch, admin_key=c.admin_key))


def _tls(cfg: ControlConfig, metrics: Metrics) -> tuple[tls.ServerTls | None, tls.ClientTls]:
    """The https listener's certificate (None: plain http), re-read when its files change (a bad
    rewrite keeps the last good pair and is counted); how the leader's certificate is verified."""
    server = None
    if cfg.http.tls_cert_file:
        server = tls.ServerTls(cfg.http, on_invalid=metrics.credential_reload_failures.labels("tls").inc)
    peer = tls.ClientTls.load(cfg.cluster.peer_ca_file, named_by="cluster.peer_ca_file", fix=tls.PEER_FIX)
    return server, peer


@contextlib.asynccontextmanager
async def _retention(
    cfg: ControlConfig, store: Store, metrics: Metrics, accounts: Accounts
) -> AsyncIterator[Retention]:
    """Payload retention (`control.datapath.retention`): its policies, and with `[retention] key_file` its
    master key (a bad key file fails the start, saying what to do) and a client of the `[artifacts]`
    store; without one, every retention but `ephemeral` is refused."""
    policies = await store.run(st.load_retention_policies)
    rc = cfg.retention
    if not rc.key_file:
        yield Retention(
            rc, store, metrics, s3=None, master_key=None, policies=policies, tenant_exists=accounts.tenant_exists
        )
        return
    master = await trio.to_thread.run_sync(load_retention_key, rc.key_file)
    art = cfg.artifacts
    credentials = await trio.to_thread.run_sync(
        partial(
            s3_credentials,
            art.s3_credentials_file,
            profile=art.s3_profile,
            environ=os.environ,
            on_invalid=metrics.credential_reload_failures.labels("s3").inc,
        )
    )
    client = S3Client(
        art.s3_endpoint, region=art.s3_region, credentials=credentials, tls_verify=art.s3_tls_verify, trust_env=False
    )
    async with client:
        yield Retention(
            rc, store, metrics, s3=client, master_key=master, policies=policies, tenant_exists=accounts.tenant_exists
        )


async def _check_keys(store: Store, keys: ControllerKeys, keys_dir: Path) -> None:
    """Every controller on one store shares the controller keys: the first stores their
    fingerprint, a later one with other keys is refused (ControllerKeysDiffer). Keys this directory
    rotated away from (`nexa keys rotate-controller`) are replaced by the current ones."""
    replaced = tuple(security.controller_fingerprint(r.signing_public_key, r.curve_public_key) for r in keys.retired)
    try:
        await store.run(st.check_keys_fingerprint, _public(keys).fingerprint, replaced)
    except ControllerKeysDiffer as exc:
        raise ControllerKeysDiffer(stored=exc.stored, got=exc.got, keys_dir=str(keys_dir)) from None


async def _load_fleet(cfg: NodesConfig, store: Store, metrics: Metrics, leadership: Leadership) -> Fleet:
    """The fleet as the store holds it, its GPU, node and runtime series on `metrics`' registry: made
    from the heartbeats at each scrape, so a node that goes leaves no stale series."""
    fleet = Fleet(cfg, store, metrics, leadership=leadership)
    await fleet.load()
    metrics.export_fleet(fleet.figures)
    return fleet


async def _keep_records(
    state: AppState, gateway: Gateway, *, controller: str | None, unowned: bool, report_keys: Sequence[str] = ()
) -> None:
    """Jobs (each backup and rollout recorded as one, named by `controller` on a shared store),
    benchmark runs, evidence signing (trusting sim and gate reports signed by `report_keys`) and
    runtime qualifications (which answer through `gateway`)."""
    jobs = state.jobs = Jobs(state.store, state.metrics, controller=controller)
    if interrupted := await jobs.fail_interrupted(unowned=unowned):
        log.warning("%d backup job(s) left running by the previous controller process: failed", interrupted)
    state.deployments.on_commit(RolloutJobs(jobs).observe)
    if state.backups is not None:
        state.backups.jobs = jobs
    state.benchmarks = Benchmarks(state.store, state.metrics, state.deployments, jobs)
    state.evals = Evals(state.store, state.metrics, state.deployments, state.models, jobs)
    state.evidence = Evidence(
        state.store,
        state.metrics,
        state.deployments,
        state.benchmarks,
        signing_key=lambda: state.signing_key,
        fingerprint=lambda: state.controller_keys.fingerprint,
        report_keys=report_keys,
    )
    state.qualifications = Qualifications(
        state.store,
        state.metrics,
        fleet=state.fleet,
        models=state.models,
        deployments=state.deployments,
        gateway=gateway,
        jobs=jobs,
        signing_key=lambda: state.signing_key,
    )
    await state.qualifications.load()


def _use_keys(state: AppState, keys: ControllerKeys) -> None:
    """After a rotation: the API signs audit heads and backups with the new key, enrolls with it."""
    state.signing_key, state.controller_keys = keys.signing, _public(keys)
    if state.backups is not None:
        state.backups.signing_key = keys.signing


async def _unready_on(stopping: trio.Event, state: AppState) -> None:
    await stopping.wait()
    state.ready = False
    log.info("controller stopping: draining in-flight HTTP requests")
