"""Serving the app on hypercorn until told to stop, or until the parent process goes away."""

from __future__ import annotations

import logging
import os
from typing import Final

import hypercorn.config
import hypercorn.trio
import trio

from nexa.simruntime.app import Journal, SimApp
from nexa.simruntime.config import SimConfig, SimStarted

log = logging.getLogger(__name__)

#: On SIGTERM, in-flight requests get this long to finish (hung ones are then cut off).
GRACEFUL_TIMEOUT_S: Final = 2.0
#: How often `--exit-with-parent` checks that the parent process is still there.
PARENT_POLL_S: Final = 0.5


def _hypercorn_config(cfg: SimConfig) -> hypercorn.config.Config:
    hc = hypercorn.config.Config()
    host = "127.0.0.1" if cfg.host == "localhost" else cfg.host
    hc.bind = [f"[{host}]:{cfg.port}" if ":" in host else f"{host}:{cfg.port}"]
    hc.graceful_timeout = GRACEFUL_TIMEOUT_S
    hc.accesslog = None
    hc.errorlog = logging.getLogger("hypercorn.error")
    hc.include_server_header = False
    hc.backlog = 1024
    return hc


async def _stop_when_orphaned(stopping: trio.Event, parent: int) -> None:
    # Re-parented (to init or a subreaper): the agent that started us is gone.
    while os.getppid() == parent:  # noqa: ASYNC110 - nothing signals a re-parenting: poll
        await trio.sleep(PARENT_POLL_S)
    log.warning("the parent process went away; stopping")
    stopping.set()


async def serve_sim(
    cfg: SimConfig,
    *,
    stopping: trio.Event,
    task_status: trio.TaskStatus[SimStarted] = trio.TASK_STATUS_IGNORED,
) -> None:
    """Serve the simulated runtime until `stopping` is set (in-flight requests get GRACEFUL_TIMEOUT_S).

    Supports the nursery start protocol; call `check_config` first."""
    parent = os.getppid()
    journal = await trio.to_thread.run_sync(Journal.open, cfg.journal)
    try:
        app = SimApp(cfg, journal)
        async with trio.open_nursery() as nursery:

            async def serve(*, task_status: trio.TaskStatus[list[str]]) -> None:
                await hypercorn.trio.serve(
                    app,  # type: ignore[arg-type]  # a plain ASGI 3 callable
                    _hypercorn_config(cfg),
                    shutdown_trigger=stopping.wait,
                    task_status=task_status,
                )
                nursery.cancel_scope.cancel()  # drained: stop the parent watcher too

            if cfg.exit_with_parent:
                nursery.start_soon(_stop_when_orphaned, stopping, parent)
            urls: list[str] = await nursery.start(serve)
            task_status.started(SimStarted(urls=urls))
    finally:
        journal.close()
