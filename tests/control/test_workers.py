"""Several gateway workers on one host: `[http] reuse_port` and `extra_listen`, and the systemd
template unit that runs them (`units/nexa-control@.service`, `units/control-worker.toml`).

Two real controllers on one PostgreSQL database share one HTTP port: fresh connections to it reach
both, a write through it succeeds whichever answers (a follower forwards it to the leader's own
address), and each worker's own address reaches that worker alone. A config that cannot work with
several workers is refused when it is read; the default path binds exactly as before.
"""

from __future__ import annotations

import io
import json
import logging
import os
import socket
import subprocess
import sys
from collections import Counter
from functools import partial
from pathlib import Path
from typing import Any

import attrs
import httpx
import pytest
import trio

from nexa import config
from nexa.config import ChannelConfig, ClusterConfig, ControlConfig, HostPort, HttpConfig, Seconds, StoreConfig
from nexa.control import store as st
from nexa.control.cluster.forward import FORWARDED_HEADER
from nexa.control.service import hypercorn_config, shared_listener
from nexa.errors import ConfigError, NexaError, StoreUnusable
from tests.conftest import free_port, local_config, start_controller
from tests.support.postgres import pg_url_fixture, postgres_fixture  # noqa: F401

UNITS = Path(__file__).resolve().parent.parent.parent / "units"
WORKER_EXAMPLE = UNITS / "control-worker.toml"
PG = "postgresql://nexa@db.test:5432/nexa"
#: Fresh connections sent to the shared port; the chance that all reach one of two workers is 2**-31.
CONNECTIONS = 32


def _worker(**cluster: str) -> dict[str, Any]:
    """A valid worker's config as a TOML table would give it; `cluster` overrides its [cluster]."""
    return {
        "http": {"listen": "127.0.0.1:8470", "reuse_port": True, "extra_listen": ["127.0.0.1:8481"]},
        "store": {"url": PG},
        "cluster": {"controller_id": "w1", "address": "http://127.0.0.1:8481", **cluster},
    }


# ---- configuration ---------------------------------------------------------------------------------


def test_the_default_binds_listen_alone_as_before() -> None:
    cfg = ControlConfig()
    assert (cfg.http.reuse_port, cfg.http.extra_listen) == (False, ())
    assert hypercorn_config(cfg.http).bind == ["127.0.0.1:8470"]
    assert hypercorn_config(HttpConfig(listen=HostPort("[::1]:9000"))).bind == ["[::1]:9000"]


def test_a_worker_serves_the_shared_socket_and_its_own_addresses() -> None:
    cfg = config.structure_config(_worker(), ControlConfig)
    assert (cfg.http.reuse_port, cfg.http.extra_listen) == (True, ("127.0.0.1:8481",))
    assert hypercorn_config(cfg.http, shared_fd=7).bind == ["fd://7", "127.0.0.1:8481"]
    # extra_listen binds beside listen without reuse_port too.
    plain = HttpConfig(extra_listen=(HostPort("[::1]:8481"),))
    assert hypercorn_config(plain).bind == ["127.0.0.1:8470", "[::1]:8481"]


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"store": {"url": ""}}, "needs a shared store: set [store] url"),
        ({"http": {"listen": "127.0.0.1:0"}}, "needs a fixed port in http.listen"),
        ({"cluster": {"controller_id": ""}}, "needs [cluster] controller_id set"),
        ({"http": {"extra_listen": []}}, "needs an address of this worker's own in [http] extra_listen"),
        ({"cluster": {"address": ""}}, "needs [cluster] address set to this worker's own URL"),
        # The shared port reaches any worker: forwarded writes must reach the leader itself.
        ({"cluster": {"address": "http://127.0.0.1:8470"}}, "needs [cluster] address set"),
        ({"cluster": {"address": "http://127.0.0.1:port"}}, "needs [cluster] address set"),
    ],
)
def test_reuse_port_without_what_workers_need_is_refused(change: dict[str, dict[str, Any]], problem: str) -> None:
    data = _worker()
    for section, values in change.items():
        data[section] = {**data[section], **values}
    with pytest.raises(ConfigError) as refused:
        config.structure_config(data, ControlConfig)
    [line] = refused.value.problems
    assert f"http.reuse_port {problem}" in line, line
    assert "invalid configuration" in refused.value.message


def test_a_worker_config_built_in_code_is_checked_too() -> None:
    """As every config validator does, with ValueError; attrs.evolve runs the check again."""
    with pytest.raises(ValueError, match=r"http\.reuse_port needs a shared store"):
        ControlConfig(http=HttpConfig(reuse_port=True))
    worker = config.structure_config(_worker(), ControlConfig)
    with pytest.raises(ValueError, match=r"\[cluster\] controller_id"):
        attrs.evolve(worker, cluster=ClusterConfig(address="http://127.0.0.1:8481"))


def test_extra_listen_takes_host_port_only() -> None:
    with pytest.raises(ConfigError) as refused:
        config.structure_config({"http": {"extra_listen": ["127.0.0.1"]}}, ControlConfig)
    assert refused.value.problems == ("http.extra_listen[0]: expected HOST:PORT",)
    with pytest.raises(ValueError, match="HOST:PORT"):
        HttpConfig(extra_listen=(HostPort("nope"),))


def _check_config(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "nexa", "check-config", str(path)],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_the_worker_example_passes_check_config_and_sqlite_is_refused(tmp_path: Path) -> None:
    proc = _check_config(WORKER_EXAMPLE)
    assert proc.returncode == 0, proc.stderr
    cfg = config.load(WORKER_EXAMPLE, ControlConfig)
    assert cfg.http.reuse_port
    assert cfg.cluster.address == f"https://{cfg.http.extra_listen[0]}"
    # The same file without its PostgreSQL store: exit 2, naming what to set.
    text = WORKER_EXAMPLE.read_text(encoding="utf-8").replace(f'url = "{cfg.store.url}"', 'url = ""')
    (sqlite := tmp_path / "control-1.toml").write_text(text, encoding="utf-8")
    proc = _check_config(sqlite)
    assert proc.returncode == 2
    assert "http.reuse_port needs a shared store: set [store] url" in proc.stderr


def test_shared_listeners_share_a_port_that_a_plain_socket_cannot_take() -> None:
    first = shared_listener("127.0.0.1:0")
    try:
        port = first.getsockname()[1]
        assert first.getsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT) == 1
        with shared_listener(f"127.0.0.1:{port}") as second:
            assert second.getsockname()[1] == port
        with socket.socket() as plain, pytest.raises(OSError, match="in use"):
            plain.bind(("127.0.0.1", port))
    finally:
        first.close()


# ---- two workers on one port -------------------------------------------------------------------------


def _worker_config(tmp_path: Path, name: str, pg_url: str, shared_port: int) -> ControlConfig:
    own = free_port()
    return attrs.evolve(
        local_config(tmp_path),  # one state dir: the workers read the same controller keys
        http=HttpConfig(
            listen=HostPort(f"127.0.0.1:{shared_port}"),
            reuse_port=True,
            extra_listen=(HostPort(f"127.0.0.1:{own}"),),
        ),
        store=StoreConfig(url=pg_url),
        cluster=ClusterConfig(
            lease_s=Seconds(2.0),
            renew_s=Seconds(0.5),
            refresh_s=Seconds(0.1),
            controller_id=name,
            address=f"http://127.0.0.1:{own}",
        ),
    )


async def _fresh(url: str, method: str, path: str, key: str, **kwargs: Any) -> httpx.Response:
    """One request on a connection of its own: the kernel picks a worker per connection."""
    async with httpx.AsyncClient(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=10) as http:
        return await http.request(method, path, **kwargs)


@pytest.mark.slow
async def test_two_workers_share_one_port_and_writes_reach_the_leader(
    nursery: trio.Nursery, tmp_path: Path, pg_url: str
) -> None:
    shared = free_port()
    cfg_a, cfg_b = (_worker_config(tmp_path, name, pg_url, shared) for name in ("a", "b"))
    with trio.fail_after(90):
        a = await start_controller(nursery, cfg_a)
        b = await start_controller(nursery, cfg_b, admin_key=a.admin_key)
        key = a.admin_key
        assert a.url == b.url == f"http://127.0.0.1:{shared}"
        # Each worker's own address reaches it alone: the first took the lease.
        own_a, own_b = cfg_a.cluster.address, cfg_b.cluster.address
        assert (await _fresh(own_a, "GET", "/readyz", key)).json()["role"] == "leader"
        assert (await _fresh(own_b, "GET", "/readyz", key)).json()["role"] == "follower"

        seen: Counter[str] = Counter()
        for _ in range(CONNECTIONS):
            ready = await _fresh(a.url, "GET", "/readyz", key)
            assert ready.status_code == 200, ready.text
            seen[ready.json()["role"]] += 1
        assert set(seen) == {"leader", "follower"}, seen  # both workers answer on the shared port

        forwarded: Counter[str | None] = Counter()
        for i in range(CONNECTIONS):
            made = await _fresh(a.url, "POST", "/api/v1/tenants", key, json={"id": f"t{i}"})
            assert made.status_code == 201, made.text
            forwarded[made.headers.get(FORWARDED_HEADER)] += 1
        # Made by the leader either way: itself, or through the follower's forward to its own address.
        assert set(forwarded) == {None, "a"}, forwarded
        listed = await _fresh(own_a, "GET", "/api/v1/tenants", key, params={"limit": 100})
        assert sorted(t["id"] for t in listed.json()["tenants"]) == sorted(f"t{i}" for i in range(CONNECTIONS))
        b.stopping.set()
        a.stopping.set()


# ---- [http] workers: gateway worker processes on the embedded store ------------------------------------


def _processes(**http: Any) -> dict[str, Any]:
    """A valid `[http] workers = 2` config as a TOML table would give it; `http` overrides its [http]."""
    return {
        "http": {"listen": "127.0.0.1:8470", "workers": 2, **http},
        "channel": {"listen": "tcp://127.0.0.1:8471"},
    }


def test_workers_on_the_embedded_store_derive_each_workers_own_parts() -> None:
    from nexa.control.cluster.workers import channel_endpoints, worker_config

    cfg = config.structure_config(_processes(), ControlConfig)
    assert (cfg.http.workers, ControlConfig().http.workers) == (2, 1)
    assert channel_endpoints(cfg) == ["tcp://127.0.0.1:8471", "tcp://127.0.0.1:8473"]
    one = worker_config(cfg, 1, 40001)
    assert one.http.workers == 1 and not one.http.reuse_port
    assert one.cluster.address == "http://127.0.0.1:40001"
    assert one.cluster.controller_id.endswith(":8470/1")
    assert one.channel.endpoint(0) == ("tcp://127.0.0.1:8473", "")
    assert one.channel.endpoint(1) == ("tcp://127.0.0.1:8474", "")  # its key rotation endpoint
    named = config.structure_config({**_processes(), "cluster": {"controller_id": "gw"}}, ControlConfig)
    assert worker_config(named, 0, 40000).cluster.controller_id == "gw/0"


def test_a_workers_log_lines_name_the_worker_and_its_pid() -> None:
    """Every worker writes to the stderr of `nexa control`: `stamp_logs` (what `--worker` calls)
    puts its index and pid on each of its lines, beside the line's own fields."""
    from nexa.telemetry import JsonFormatter, stamp_logs

    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter())
    root = logging.getLogger()
    root.addHandler(handler)
    try:
        logging.getLogger("nexa.test").warning("before")
        stamp_logs(worker=1, pid=4242)
        logging.getLogger("nexa.test").warning("answered", extra={"fields": {"status": 503}})
    finally:
        root.removeHandler(handler)
    before, after = (json.loads(line) for line in out.getvalue().splitlines())
    assert "worker" not in before
    assert (after["msg"], after["worker"], after["pid"], after["status"]) == ("answered", 1, 4242, 503)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        ({"http": {"workers": 2}, "store": {"url": PG}}, "runs workers on the embedded SQLite store"),
        ({"http": {"workers": 2, "reuse_port": True}}, "remove [http] reuse_port and extra_listen"),
        ({"http": {"workers": 2, "extra_listen": ["127.0.0.1:8481"]}}, "remove [http] reuse_port and extra_listen"),
        ({"http": {"workers": 2, "listen": "127.0.0.1:0"}}, "needs a fixed port in http.listen"),
        (
            {"http": {"workers": 2}, "channel": {"listen": "tcp://127.0.0.1:*"}},
            "needs a fixed port in [channel] listen",
        ),
        ({"http": {"workers": 2}, "cluster": {"address": "http://127.0.0.1:1"}}, "remove [cluster] address"),
    ],
)
def test_workers_without_what_they_need_are_refused(change: dict[str, dict[str, Any]], problem: str) -> None:
    data = _processes()
    for section, values in change.items():
        data[section] = {**data.get(section, {}), **values}
    with pytest.raises(ConfigError) as refused:
        config.structure_config(data, ControlConfig)
    [line] = refused.value.problems
    assert line.startswith("(top level): http.workers = 2 ") and problem in line, line


@pytest.mark.parametrize("workers", [0, -1, 65])
def test_a_worker_count_out_of_range_is_refused(workers: int) -> None:
    with pytest.raises(ConfigError) as refused:
        config.structure_config(_processes(workers=workers), ControlConfig)
    [line] = refused.value.problems
    assert line.startswith("http: 'workers' must be"), line
    with pytest.raises(ValueError, match="workers"):
        HttpConfig(workers=workers)


def test_nexa_control_help_names_the_workers_and_recover_is_refused_with_them(tmp_path: Path) -> None:
    shown = subprocess.run(
        [sys.executable, "-m", "nexa", "control", "--help"], capture_output=True, text=True, timeout=60, check=True
    )
    assert "[http] workers = N" in shown.stdout
    assert "--worker" not in shown.stdout  # the supervisor's own flag
    path = tmp_path / "control.toml"
    path.write_text(
        f'state_dir = "{tmp_path / "state"}"\n[http]\nlisten = "127.0.0.1:{free_port()}"\nworkers = 2\n'
        '[channel]\nlisten = "tcp://127.0.0.1:28471"\n'
    )
    refused = subprocess.run(
        [sys.executable, "-m", "nexa", "control", "--config", str(path), "--recover"],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert refused.returncode == 2, refused.stderr
    assert "--recover runs one controller: set [http] workers = 1" in refused.stderr
    assert not (tmp_path / "state").exists()  # nothing was written


def test_a_shared_sqlite_writer_takes_the_write_lock_when_its_transaction_begins(tmp_path: Path) -> None:
    """Gateway workers write one file: a transaction that read before another process committed
    must not fail when it then writes (SQLITE_BUSY_SNAPSHOT), so each takes the lock first."""
    from nexa.control.store import sqlite
    from nexa.errors import StoreBusy

    sqlite.apply_best_practice()
    path = tmp_path / "control.db"
    first, _ = sqlite.open_db(path, shared=True)
    second, _ = sqlite.open_db(path, shared=True)
    try:
        second.connection.set_busy_timeout(0)
        with first:
            first.execute("SELECT value FROM meta WHERE key = 'epoch'").fetchall()  # a read, then
            with pytest.raises(StoreBusy), second:  # another worker's write waits (here: gives up)
                second.execute("UPDATE meta SET value = value WHERE key = 'epoch'")
            first.execute("UPDATE meta SET value = value + 1 WHERE key = 'epoch'")  # the write goes through
        assert not first.connection.in_transaction and not second.connection.in_transaction
        with second:  # the lock is free again
            second.execute("UPDATE meta SET value = value + 1 WHERE key = 'epoch'")
    finally:
        first.close()
        second.close()


# ---- the supervisor of gateway workers, with stand-in worker programs (fault injection) -----------------

#: A stand-in for `nexa control --worker I`: appends its run to RUNS, prints the line a worker prints
#: once it serves (unless told to fail first), then exits with the status EXITS names for that run.
_STAND_IN = """
import json, pathlib, sys, time
index = int(sys.argv[-1]); runs = pathlib.Path(sys.argv[1]); plan = json.loads(sys.argv[2])
runs.open("a").write(f"{index}\\n")
run = runs.read_text().split().count(str(index))
step = plan.get(f"{index}:{run}", plan.get("default"))
if step == "fail-start":
    sys.exit(1)
print("nexa control test listening on http://127.0.0.1:1", flush=True)
if step == "serve":
    time.sleep(600)
sys.exit(int(step))
"""


def _stand_in(tmp_path: Path, plan: dict[str, str]) -> tuple[list[str], Path]:
    runs = tmp_path / "runs"
    return [sys.executable, "-c", _STAND_IN, str(runs), json.dumps(plan)], runs


def _supervised(tmp_path: Path, workers: int = 2) -> ControlConfig:
    return attrs.evolve(
        local_config(tmp_path),
        http=HttpConfig(listen=HostPort("127.0.0.1:18470"), workers=workers),
        channel=ChannelConfig(listen="tcp://127.0.0.1:28471"),
    )


async def test_a_worker_that_never_serves_fails_the_start_and_frees_the_state_dir(tmp_path: Path) -> None:
    from nexa.control.cluster.workers import serve_workers

    command, runs = _stand_in(tmp_path, {"default": "serve", "1:1": "fail-start"})
    cfg = _supervised(tmp_path)
    with trio.fail_after(60), pytest.raises(NexaError, match="gateway worker 1 exited with status 1 before it served"):
        await serve_workers(cfg, command, stopping=trio.Event())
    assert runs.read_text().split() == ["0", "1"]  # worker 0 first, alone; then 1, which failed
    fd = st.lock_state_dir(Path(cfg.state_dir))  # released: a next start may take it
    os.close(fd)


async def test_a_worker_that_exits_is_started_again_and_one_exiting_3_stops_them_all(tmp_path: Path) -> None:
    from nexa.control.cluster import workers

    # Worker 1 exits 0 once it served, is started again and then exits 3: the store is unusable.
    command, runs = _stand_in(tmp_path, {"default": "serve", "1:1": "0", "1:2": "3"})
    cfg = _supervised(tmp_path)
    stopping = trio.Event()
    seen: list[workers.WorkersStarted] = []

    async def supervise() -> None:
        async with trio.open_nursery() as nursery:
            seen.append(await nursery.start(partial(workers.serve_workers, cfg, command, stopping=stopping)))

    with trio.fail_after(60), pytest.raises(ExceptionGroup) as caught:  # from supervise's nursery
        await supervise()
    [error] = caught.value.exceptions
    assert isinstance(error, StoreUnusable) and "exit 3" in error.message, error
    assert seen[0].channels == ["tcp://127.0.0.1:28471", "tcp://127.0.0.1:28473"]
    assert runs.read_text().split() == ["0", "1", "1"]
    assert stopping.is_set()  # worker 0 was stopped with them (SIGTERM)
