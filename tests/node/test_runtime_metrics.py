"""`nexa.node.runtime_metrics` against a real hypercorn "runtime" on loopback: good, broken and
hostile metrics endpoints become loads (`ok` False with a reason), never a crash or a state change."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import hypercorn.config
import hypercorn.trio
import trio

from nexa.contracts import wire
from nexa.contracts.node import RuntimeKind
from nexa.contracts.runtime import HealthProbe, RuntimeSpec
from nexa.node.runtime_metrics import RuntimeMetrics

TIMEOUT_S = 30
_GOOD = b'vllm:num_requests_waiting{model_name="m"} 4\nvllm:num_requests_running{model_name="m"} 2\n'
#: path -> (status, body); "/hang" never answers.
_ANSWERS = {
    "/good": (200, _GOOD),
    "/error": (500, b"oops"),
    "/garbage": (200, b"<html>not { metrics"),
    "/huge": (200, b"#" * (5 * 2**20)),
}


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:
    if scope["type"] == "lifespan":
        while (await receive())["type"] != "lifespan.shutdown":
            await send({"type": "lifespan.startup.complete"})
        await send({"type": "lifespan.shutdown.complete"})
        return
    if scope["path"] == "/hang":
        await trio.sleep_forever()
    status, body = _ANSWERS[scope["path"]]
    await send({"type": "http.response.start", "status": status, "headers": []})
    await send({"type": "http.response.body", "body": body})


async def _serve(*, task_status: trio.TaskStatus[int] = trio.TASK_STATUS_IGNORED) -> None:
    config = hypercorn.config.Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = config.errorlog = None
    async with trio.open_nursery() as nursery:
        binds = await nursery.start(partial(hypercorn.trio.serve, _app, config, shutdown_trigger=trio.sleep_forever))
        task_status.started(int(binds[0].rsplit(":", 1)[1]))


@attrs.define
class _Replicas:
    port: int
    updates: list[int] = attrs.Factory(list)

    def update(self, generation: int, assignments: Sequence[wire.Assignment]) -> None:
        self.updates.append(generation)

    def statuses(self) -> list[wire.AssignmentStatus]:
        return [wire.AssignmentStatus(assignment_id=a, state=wire.RuntimeState.READY) for a in _ANSWERS] + [
            wire.AssignmentStatus(assignment_id="/hang", state=wire.RuntimeState.READY)
        ]

    def endpoint(self, assignment_id: str) -> int | None:
        return self.port


@attrs.define
class _Stats:
    cache_bytes: int


@attrs.define
class _Cache:
    directory: Path

    def statistics(self) -> _Stats:
        return _Stats(cache_bytes=1234)


def _assignment(path: str) -> wire.Assignment:
    # The replica id doubles as the path its fake "adapter" serves (sim: vLLM names at /metrics).
    spec = RuntimeSpec(
        kind=RuntimeKind.SIM,
        image="r/sim@sha256:" + "0" * 64,
        command=[],
        port=1,
        memory_bytes=1,
        cpus=1.0,
        health=HealthProbe(command=["true"]),
    )
    return wire.Assignment(id=path, deployment="d", runtime=spec)


async def test_each_failure_is_a_load_with_a_reason_and_good_figures_are_kept(
    nursery: trio.Nursery, tmp_path: Path, monkeypatch: Any
) -> None:
    port = await nursery.start(_serve)
    replicas = _Replicas(port=port)
    metrics = RuntimeMetrics(replicas, _Cache(tmp_path), 0.2, host="127.0.0.1")
    metrics.update(3, [_assignment(p) for p in [*_ANSWERS, "/hang"]])
    assert replicas.updates == [3]
    # Every replica reads its own path (the sim adapter's is /metrics): point each at its id.
    monkeypatch.setattr(metrics, "_specs", {aid: attrs.evolve(spec, path=aid) for aid, spec in metrics._specs.items()})
    monkeypatch.setattr("nexa.node.runtime_metrics.SCRAPE_TIMEOUT_S", 0.5)
    await nursery.start(metrics.run)
    with trio.fail_after(TIMEOUT_S):
        while len({s.assignment_id for s in metrics.statuses() if s.load is not None}) < 5:  # noqa: ASYNC110
            await trio.sleep(0.05)
    loads = {s.assignment_id: s.load for s in metrics.statuses()}
    assert all(s.state is wire.RuntimeState.READY for s in metrics.statuses())  # readiness untouched
    good = loads["/good"]
    assert good is not None
    assert (good.ok, good.queue_depth, good.running) == (True, 4.0, 2.0)
    reasons = {aid: load.error for aid, load in loads.items() if load is not None and not load.ok}
    assert set(reasons) == {"/error", "/garbage", "/huge", "/hang"}
    assert "HTTP 500" in reasons["/error"]
    assert "not Prometheus text" in reasons["/garbage"]
    assert "over" in reasons["/huge"]
    assert "no whole answer" in reasons["/hang"]
    assert all(len(r) <= wire.METRICS_ERROR_MAX for r in reasons.values())
    disk = metrics.cache_disk()
    assert disk is not None
    assert disk.used_bytes == 1234
    assert 0 < disk.free_bytes <= disk.total_bytes


async def test_off_sends_no_load_but_still_the_disk(nursery: trio.Nursery, tmp_path: Path) -> None:
    replicas = _Replicas(port=1)
    metrics = RuntimeMetrics(replicas, _Cache(tmp_path), 0.0, host="127.0.0.1")
    metrics.update(1, [_assignment("/good")])
    assert metrics.cache_disk() is None  # not measured yet
    await nursery.start(metrics.run)
    with trio.fail_after(TIMEOUT_S):
        while metrics.cache_disk() is None:  # noqa: ASYNC110
            await trio.sleep(0.05)
    assert all(s.load is None for s in metrics.statuses())
