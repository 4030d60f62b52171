"""`serve_control`: the controller's composition root. The only hypercorn importer.

Start order: store (lock, migrate, new epoch) → registry → background loops → HTTP.
Shutdown is the reverse: HTTP stops accepting and drains in-flight requests for
`http.graceful_timeout_s`, then the background loops are cancelled (bounded by
their own shielded timeouts), then the store closes last.
"""

from __future__ import annotations

import logging
import time
from functools import partial

import attrs
import hypercorn.config
import hypercorn.trio
import trio

from nexa import __version__
from nexa.config import ControlConfig, HttpConfig, parse_host_port
from nexa.control.api import AppState, create_app
from nexa.control.registry import Registry
from nexa.control.store import open_store
from nexa.telemetry import Metrics

log = logging.getLogger(__name__)


@attrs.frozen(kw_only=True)
class ControlStarted:
    """What `nursery.start(serve_control, ...)` returns once the controller answers HTTP."""

    urls: list[str]
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
    inline_store: bool = False,
    task_status: trio.TaskStatus[ControlStarted] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Run the controller until `stopping` is set; supports the nursery start protocol."""
    metrics = Metrics()
    metrics.build_info.info({"version": __version__})
    async with open_store(cfg.state_dir, inline=inline_store) as store:
        metrics.controller_epoch.set(store.epoch)
        registry = await Registry.load(store, metrics)
        admin_key = await registry.ensure_admin_key(cfg.bootstrap.admin_key_file)
        state = AppState(registry=registry, store=store, metrics=metrics, started_at=time.time())
        app = create_app(cfg.http, state)

        async with trio.open_nursery() as loops:
            # Later issues start the node channel, scheduler and gateway loops here, with
            # `await loops.start(component.run)`, before HTTP begins to answer.
            async with trio.open_nursery() as http:
                binds: list[str] = await http.start(
                    partial(hypercorn.trio.serve, app, hypercorn_config(cfg.http), shutdown_trigger=stopping.wait)
                )
                state.ready = True
                http.start_soon(_unready_on, stopping, state)
                log.info(
                    "controller serving",
                    extra={"fields": {"urls": binds, "epoch": store.epoch, "version": __version__}},
                )
                task_status.started(ControlStarted(urls=binds, epoch=store.epoch, admin_key=admin_key))
            # hypercorn returned: in-flight requests have drained. Stop the loops; the store
            # closes when `open_store` exits, last.
            loops.cancel_scope.cancel()
    log.info("controller stopped")


async def _unready_on(stopping: trio.Event, state: AppState) -> None:
    await stopping.wait()
    state.ready = False
    log.info("controller stopping: draining in-flight HTTP requests")
