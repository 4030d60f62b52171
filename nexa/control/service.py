"""`serve_control`: the controller's composition root. The only hypercorn importer.

Start order: store (lock, migrate, new epoch) → registry, fleet, keys → outbound clients and the
model registry → deployments, quotas, metering, workloads, gateway → node channel → HTTP (the
inference routes in front of the management app).
Shutdown is the reverse: HTTP stops accepting and drains in-flight requests for
`http.graceful_timeout_s`, then the background loops are cancelled (bounded by
their own shielded timeouts; metering writes what is pending), then the store closes last.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Final, TypeVar

import attrs
import hypercorn.config
import hypercorn.trio
import trio

from nexa import __version__
from nexa.config import ControlConfig, HttpConfig, parse_host_port
from nexa.control import openapi
from nexa.control.admission import Admission
from nexa.control.api import AppState, ControllerPublicKeys, create_app
from nexa.control.deployments import Deployments
from nexa.control.fleet import Fleet
from nexa.control.gateway import Gateway
from nexa.control.inference import InferenceApp
from nexa.control.metering import Meter
from nexa.control.models import ModelRegistry
from nexa.control.outbound import Outbound
from nexa.control.quotas import Quotas
from nexa.control.registry import Registry
from nexa.control.rollout import RolloutWatcher
from nexa.control.routing import Router
from nexa.control.southbound import Southbound
from nexa.control.store import StoreOpener, open_store
from nexa.control.workloads import Workloads
from nexa.messaging import CurveKeyPair, generate_curve_keypair, load_curve_keypair, save_curve_keypair
from nexa.oci import load_registry_credentials
from nexa.s3 import load_s3_credentials
from nexa.security import SigningKey, generate_signing_key, load_signing_key, save_signing_key
from nexa.supervision import Supervision, supervised
from nexa.telemetry import Metrics

log = logging.getLogger(__name__)

T = TypeVar("T")


KEYS_DIR: Final = "keys"
_SIGNING_FILE: Final = "controller-signing.pem"
_CURVE_NAME: Final = "controller-curve"


@attrs.frozen(kw_only=True)
class ControllerKeys:
    """The controller's Ed25519 key (signs assignment sets) and CurveZMQ server key pair."""

    signing: SigningKey
    curve: CurveKeyPair

    def public(self) -> ControllerPublicKeys:
        return ControllerPublicKeys(signing=self.signing.public.b64, curve=self.curve.public)


def load_or_create_keys(directory: Path) -> ControllerKeys:
    """Read the controller's keys, creating them (private files mode 0600) on the first start."""
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    signing_path = directory / _SIGNING_FILE
    if not signing_path.exists():
        save_signing_key(generate_signing_key(), signing_path)
    if not (directory / f"{_CURVE_NAME}.key").exists():
        save_curve_keypair(generate_curve_keypair(), directory, name=_CURVE_NAME)
    return ControllerKeys(signing=load_signing_key(signing_path), curve=load_curve_keypair(directory, name=_CURVE_NAME))


@attrs.frozen(kw_only=True)
class ControlStarted:
    """What `nursery.start(serve_control, ...)` returns once the controller answers HTTP."""

    urls: list[str]
    #: The node channel endpoint nodes are told to dial.
    channel: str
    epoch: int
    #: The bootstrap admin key, present only on the first start when it was generated here.
    admin_key: str | None


def hypercorn_config(cfg: HttpConfig) -> hypercorn.config.Config:
    hc = hypercorn.config.Config()
    host, port = parse_host_port(cfg.listen)
    hc.bind = [f"[{host}]:{port}" if ":" in host else f"{host}:{port}"]
    hc.graceful_timeout = cfg.graceful_timeout_s
    hc.keep_alive_timeout = cfg.keep_alive_timeout_s
    hc.accesslog = None  # nexa.control.api writes one structured line per request
    hc.errorlog = logging.getLogger("hypercorn.error")
    hc.include_server_header = False
    return hc


async def serve_control(
    cfg: ControlConfig,
    *,
    stopping: trio.Event,
    open_store: StoreOpener = open_store,
    task_status: trio.TaskStatus[ControlStarted] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the controller until `stopping` is set; supports the nursery start protocol.

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
        await _serve_control(cfg, metrics, stopping=stopping, open_store=open_store, task_status=task_status)


async def _serve_control(
    cfg: ControlConfig,
    metrics: Metrics,
    *,
    stopping: trio.Event,
    open_store: StoreOpener,
    task_status: trio.TaskStatus[ControlStarted],
) -> None:
    async with open_store(cfg.state_dir) as store:
        metrics.controller_epoch.set(store.epoch)
        registry = await Registry.load(store, metrics)
        admin_key = await registry.ensure_admin_key(cfg.bootstrap.admin_key_file)
        keys = await trio.to_thread.run_sync(load_or_create_keys, Path(cfg.state_dir) / KEYS_DIR)
        fleet = Fleet(cfg.nodes, store, metrics)
        await fleet.load()
        outbound = Outbound(
            cfg.oci,
            cfg.artifacts,
            registry_credentials=await _maybe(load_registry_credentials, cfg.oci.credentials_file),
            s3_credentials=await _maybe(load_s3_credentials, cfg.artifacts.s3_credentials_file),
        )
        async with outbound:
            models = await ModelRegistry.load(cfg.models, store, metrics, outbound)
            southbound = Southbound(
                cfg.channel,
                cfg.nodes,
                fleet,
                metrics,
                curve=keys.curve,
                signing_key=keys.signing,
                epoch=store.epoch,
                stream_window_chunks=cfg.gateway.stream_window_chunks,
            )
            deployments = Deployments(
                cfg.nodes, store, metrics, fleet, models=models, southbound=southbound, placement=cfg.placement
            )
            await deployments.load()
            quotas = await Quotas.load(store, metrics, registry.tenant_exists)
            meter = Meter(cfg.gateway, store, metrics)
            workloads = await Workloads.load(store, keys.signing, store.epoch)
            admission = Admission(cfg.gateway, metrics)
            gateway = Gateway(
                cfg.gateway,
                models=models,
                deployments=deployments,
                relay=southbound.relay,
                quotas=quotas,
                admission=admission,
                router=Router(cfg.gateway),
                meter=meter,
            )
            state = AppState(
                registry=registry,
                fleet=fleet,
                models=models,
                deployments=deployments,
                store=store,
                metrics=metrics,
                started_at=time.time(),
                controller_keys=keys.public(),
                signing_key=keys.signing,
                quotas=quotas,
                meter=meter,
                admission=admission,
                openapi=openapi.document_json(),
                max_clock_skew_s=cfg.nodes.max_clock_skew_s,
            )
            app = InferenceApp(
                create_app(cfg.http, state),
                cfg=cfg.gateway,
                gateway=gateway,
                workloads=workloads,
                registry=registry,
                metrics=metrics,
                max_body_bytes=cfg.http.max_body_bytes,
                epoch=store.epoch,
            )
            # Every loop runs supervised (nexa.supervision): a failure is logged, counted and the loop
            # restarted; only an unusable store or a failed start ends the process.
            # Metering has its own nursery, outside the other loops: it stops last, so the usage of
            # every call those loops end (embedding batches, streams cut at shutdown) is written.
            async with trio.open_nursery() as metering:
                await metering.start(supervised, "metering", meter.run)
                async with trio.open_nursery() as loops:
                    channel = await loops.start(supervised, "southbound", southbound.run)
                    await loops.start(supervised, "deployments", deployments.run)
                    await loops.start(supervised, "rollout", RolloutWatcher(deployments, meter).run)
                    await loops.start(supervised, "gateway", gateway.run)
                    await loops.start(supervised, "workloads", partial(workloads.run, cfg.gateway.workload_retention_s))
                    log.info("node channel bound", extra={"fields": {"endpoint": channel}})
                    async with trio.open_nursery() as http:
                        serve = partial(
                            hypercorn.trio.serve, app, hypercorn_config(cfg.http), shutdown_trigger=stopping.wait
                        )
                        binds: list[str] = await http.start(supervised, "http", serve)
                        state.ready = True
                        http.start_soon(_unready_on, stopping, state)
                        log.info(
                            "controller serving",
                            extra={"fields": {"urls": binds, "epoch": store.epoch, "version": __version__}},
                        )
                        task_status.started(
                            ControlStarted(urls=binds, channel=channel, epoch=store.epoch, admin_key=admin_key)
                        )
                    # hypercorn returned: in-flight requests have drained. Stop the loops; the store
                    # closes when `open_store` exits, last.
                    loops.cancel_scope.cancel()
                metering.cancel_scope.cancel()
    log.info("controller stopped")


async def _maybe(load: Callable[[str], T], path: str) -> T | None:
    """Read a credentials file named in config (off the event loop); None when none is named."""
    return await trio.to_thread.run_sync(load, path) if path else None


async def _unready_on(stopping: trio.Event, state: AppState) -> None:
    await stopping.wait()
    state.ready = False
    log.info("controller stopping: draining in-flight HTTP requests")
