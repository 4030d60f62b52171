"""The processes `nexa` runs: `control`, `node` (and `node enroll | inventory | doctor | rotate-keys`), `demo`
and `sim-runtime`, each under trio until SIGTERM/SIGINT.

Each role is imported lazily, so that `nexa version` and the operator commands start fast; and this module
imports no operator command, so that `nexa node` (whose parser `entry` builds from this module alone) does
not load them either: the node agent's memory is what the agent uses (`perf/node_memory.py`).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable
from functools import partial
from pathlib import Path
from typing import Any, Final

from nexa import __version__, config
from nexa.cli.output import gib
from nexa.errors import ConfigError, Conflict, NexaError, Unavailable

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
#: How often `nexa node rotate-keys` looks whether the agent has switched to the new keys.
_ROTATE_POLL_S: Final = 0.2

#: Optional parts of the HTTP libraries the node agent never uses: httpcore's HTTP/2 (h2, hpack,
#: hyperframe) and SOCKS support, and its asyncio backend (anyio). `nexa node` marks them absent
#: before it imports the agent (`None` in sys.modules), so httpcore takes its not-installed path and
#: the agent's memory holds none of them. The controller, in its own process, serves HTTP/2 with h2.
NODE_ABSENT_MODULES: Final = ("h2", "socksio", "anyio")

#: The controller's young-generation GC threshold, in allocations (CPython's default is 700).
CONTROLLER_GC_GEN0: Final = 10_000


def controller_gc() -> None:
    """Set the collector as `nexa control` runs it: a raised gen-0 threshold (`announce` then freezes).

    A placement decision over 1,000 nodes allocates about a thousand short-lived objects (one
    explanation per node). At the default threshold every decision ran young collections over
    the decision being built, and what they promoted made full collections, which walk the
    whole heap, frequent: up to 0.5 ms of a decision's p50 and most of its p99
    (`perf/placement.py --gc on` against `--gc controller`). At 10,000 most of those objects are
    freed by their reference count before a collection sees them; cyclic garbage waits a little
    longer (a few MB at most). `gc.freeze()` once started moves what start-up built (modules,
    configuration, the loaded state) out of every later collection's walk.
    """
    gc.set_threshold(CONTROLLER_GC_GEN0, *gc.get_threshold()[1:])


def _role_parser(sub: Any, name: str, help_text: str) -> argparse.ArgumentParser:
    """The parser of a long-running role, with the flags every role takes."""
    s: argparse.ArgumentParser = sub.add_parser(name, help=help_text)
    s.add_argument("--config", default=os.environ.get("NEXA_CONFIG"), help="TOML config file ($NEXA_CONFIG)")
    s.add_argument("--state-dir", help="overrides state_dir")
    s.add_argument("--log-level", default=os.environ.get("NEXA_LOG_LEVEL"), help="overrides log.level")
    return s


def add_commands(sub: Any) -> None:
    s = _role_parser(sub, "control", "run the controller")
    s.add_argument("--listen", help="HOST:PORT, overrides http.listen")
    s.add_argument("--channel", help="HOST:PORT (or tcp://HOST:PORT) of the node channel, overrides channel.listen")
    s.add_argument(
        "--recover",
        action="store_true",
        help="start in recovery (reads and inference only, nothing pushed) whatever the state says; "
        "`nexa recovery plan` shows what ending it changes, `nexa recovery finish` ends it",
    )
    # `nexa control` with [http] workers = N above 1 supervises N gateway worker processes on the
    # shared port and the state dir's database (`control.cluster.workers`); it starts each with this.
    s.add_argument("--worker", type=int, default=None, help=argparse.SUPPRESS)
    s.epilog = (
        "With [http] workers = N above 1 (the embedded SQLite store), it runs N gateway worker processes "
        "sharing the HTTP port and restarts one that dies; worker i serves nodes on [channel] listen's port + 2i "
        "(`nexa docs config`)."
    )
    s.set_defaults(handler=_cmd_control)

    node = _role_parser(sub, "node", "run the node agent, or enroll this node (`nexa node enroll`)")
    node.add_argument("--inventory", help="overrides inventory_path")
    node.add_argument("--source-address", help="local address to dial the controller from")
    node.set_defaults(handler=_cmd_node)
    verbs = node.add_subparsers(metavar="VERB")
    s = verbs.add_parser("enroll", help="enroll this node with a one-time token from `nexa tokens create`")
    s.add_argument(
        "--controller",
        required=True,
        help="controller URL, e.g. https://control.example:8470 (its certificate is checked against the "
        "system's CAs, or $NEXA_CA_FILE)",
    )
    s.add_argument("--token", required=True, help="one-time enrollment token (nxb_…)")
    s.add_argument(
        "--controller-fingerprint",
        help="SHA-256 of the controller's keys, as `nexa tokens create` prints it "
        "(needed when the token does not carry it; must match when it does)",
    )
    s.add_argument("--name", help="node name to ask for (default: this host's name)")
    s.add_argument("--config", dest="enroll_config", default=None, help="node TOML config (for state_dir)")
    s.add_argument("--state-dir", dest="enroll_state_dir", help="overrides state_dir")
    s.set_defaults(handler=_cmd_node_enroll)
    _node_tool_commands(verbs)
    _node_rotate_command(verbs)

    _sim_runtime_command(sub)

    s = sub.add_parser("demo", help="a local cluster: registry, S3 store, controller and four sim nodes")
    s.add_argument("--state-dir", default=".nexa/demo", help="the demo's own directory, emptied at start")
    s.add_argument("--listen", default="127.0.0.1:8470", help="the controller's HTTP address")
    s.add_argument("--nodes", type=int, default=4, help="node agents, 1 to 4 (127.0.0.11 to .14)")
    s.add_argument("--replicas", type=int, default=2, help="replicas of the `chat` deployment")
    s.add_argument("--real", action="store_true", help="the real llama.cpp runtime in podman on CPU, not `sim`")
    s.add_argument("--log-level", default=os.environ.get("NEXA_LOG_LEVEL", "warning"))
    s.set_defaults(handler=_cmd_demo)


# ---- roles -------------------------------------------------------------------------------------


def control_config(args: argparse.Namespace) -> config.ControlConfig:
    cfg = config.load(args.config, config.ControlConfig) if args.config else config.ControlConfig()
    overrides: dict[str, Any] = {}
    if args.state_dir:
        overrides["state_dir"] = args.state_dir
    http: dict[str, Any] = {}
    if args.listen:
        http["listen"] = args.listen
    log: dict[str, Any] = {}
    if args.log_level:
        log["level"] = args.log_level
    channel: dict[str, Any] = {}
    if args.channel:
        channel["listen"] = args.channel
    if not (overrides or http or log or channel):
        return cfg
    # Flags go through the same validation as the file, so a bad flag is named like a bad key.
    merged = config.unstructure_config(cfg)
    merged.update(overrides)
    merged["http"].update(http)
    merged["log"].update(log)
    merged["channel"].update(channel)
    return config.structure_config(merged, config.ControlConfig)


def _worker_command(args: argparse.Namespace) -> list[str]:
    """How the supervisor starts a gateway worker: this nexa, `control` and the flags it was given."""
    from nexa.node.processes import default_argv

    command = [*default_argv(), "control"]
    for flag, value in (
        ("--config", args.config),
        ("--state-dir", args.state_dir),
        ("--log-level", args.log_level),
        ("--listen", args.listen),
        ("--channel", args.channel),
    ):
        if value:
            command += [flag, value]
    return command


def _cmd_workers(args: argparse.Namespace, cfg: config.ControlConfig) -> int:
    """`nexa control` with [http] workers above 1: the supervisor of the gateway workers."""
    from nexa.control.cluster.workers import WorkersStarted, serve_workers

    if args.recover:
        raise ConfigError(
            "--recover runs one controller: set [http] workers = 1 for the recovery, and back once it has ended",
            problems=("--recover: not with [http] workers above 1",),
        )

    def announce(started: WorkersStarted) -> None:
        print(
            f"nexa control {__version__} listening on {', '.join(started.urls)} with {started.workers} gateway "
            f"workers (node channels {', '.join(started.channels)})"
        )
        sys.stdout.flush()

    return _run_role(partial(serve_workers, cfg, _worker_command(args)), announce)


async def _serve_worker(cfg: config.ControlConfig, index: int, *, stopping: Any, task_status: Any) -> None:
    """Gateway worker `index` (`--worker`): a controller on the shared SQLite file that stops when
    its supervisor is gone. Each of its log lines names it (`worker`, `pid`): every worker writes
    to the stderr of `nexa control`."""
    import trio

    from nexa.control.cluster.workers import stop_when_orphaned
    from nexa.control.service import serve_control
    from nexa.control.store import open_store
    from nexa.telemetry import stamp_logs

    if not 0 <= index < cfg.http.workers:
        raise ConfigError(f"--worker {index}: [http] workers is {cfg.http.workers} (it is set by `nexa control`)")
    stamp_logs(worker=index, pid=os.getpid())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(stop_when_orphaned, stopping, os.getppid())
        opener = partial(open_store, worker=True)
        await serve_control(cfg, stopping=stopping, open_store=opener, worker=index, task_status=task_status)
        nursery.cancel_scope.cancel()


def _cmd_control(args: argparse.Namespace) -> int:
    from nexa.control.service import ControlStarted, serve_control
    from nexa.telemetry import setup_logging

    cfg = control_config(args)
    setup_logging(cfg.log.level.value)
    controller_gc()
    if args.worker is None and cfg.http.workers > 1:
        return _cmd_workers(args, cfg)

    def announce(started: ControlStarted) -> None:
        gc.freeze()  # see controller_gc
        if started.admin_key:
            print("first start: the admin API key follows; it is shown only this once, store it now:")
            print(f"  NEXA_TOKEN={started.admin_key}")
        print(f"nexa control {__version__} listening on {', '.join(started.urls)} (epoch {started.epoch})")
        sys.stdout.flush()

    if args.worker is not None:
        return _run_role(partial(_serve_worker, cfg, args.worker), announce)
    return _run_role(partial(serve_control, cfg, recover=args.recover), announce)


def _cmd_demo(args: argparse.Namespace) -> int:
    from nexa.demo import DemoConfig, DemoStarted, banner, serve_demo
    from nexa.telemetry import setup_logging

    setup_logging(args.log_level)
    cfg = DemoConfig(
        state_dir=Path(args.state_dir), listen=args.listen, nodes=args.nodes, replicas=args.replicas, real=args.real
    )
    print(f"starting the LunaNexa demo in {cfg.state_dir} (registry, S3 store, controller, {cfg.nodes} nodes)…")
    sys.stdout.flush()

    def announce(started: DemoStarted) -> None:
        print(banner(started))
        sys.stdout.flush()

    return _run_role(partial(serve_demo, cfg), announce)


def _run_role(serve: Callable[..., Awaitable[None]], announce: Callable[[Any], None]) -> int:
    """Run a role's composition root under trio until SIGTERM/SIGINT, then let it drain.

    `serve(stopping=event, task_status=...)` supports the nursery start protocol; what it reports
    at start goes to `announce`. A second signal cancels everything at once.
    """
    import trio

    async def run() -> None:
        stopping = trio.Event()
        async with trio.open_nursery() as nursery:

            async def serve_then_stop(task_status: trio.TaskStatus[Any]) -> None:
                await serve(stopping=stopping, task_status=task_status)
                nursery.cancel_scope.cancel()  # drained and closed: stop the signal watcher too

            nursery.start_soon(_stop_on_signal, stopping, nursery.cancel_scope)
            announce(await nursery.start(serve_then_stop))

    try:
        trio.run(run)
    except BaseExceptionGroup as group:
        raise _single_nexa_error(group) from None
    return EXIT_OK


def _single_nexa_error(group: BaseExceptionGroup[BaseException]) -> BaseException:
    """A start-up failure arrives wrapped by the nurseries; show the nexa error, not a traceback."""
    matched, rest = group.split(NexaError)
    if matched is None or rest is not None:
        return group
    leaf: BaseException = matched
    while isinstance(leaf, BaseExceptionGroup):
        leaf = leaf.exceptions[0]
    return leaf


def _node_config(args: argparse.Namespace) -> config.NodeConfig:
    cfg = config.load(args.config, config.NodeConfig) if args.config else config.NodeConfig()
    merged = config.unstructure_config(cfg)
    for flag, key in (
        ("state_dir", "state_dir"),
        ("inventory", "inventory_path"),
        ("source_address", "source_address"),
    ):
        value = getattr(args, flag, None)
        if value:
            merged[key] = value
    if getattr(args, "log_level", None):
        merged["log"]["level"] = args.log_level
    return config.structure_config(merged, config.NodeConfig)


def _cmd_node(args: argparse.Namespace) -> int:
    for name in NODE_ABSENT_MODULES:
        if name not in sys.modules:
            sys.modules[name] = None  # type: ignore[assignment]
    from nexa.node.agent import NodeStarted, serve_node
    from nexa.telemetry import setup_logging

    setup_logging("warning")  # what reading the config warns of (a deprecated key) is logged as JSON too
    cfg = _node_config(args)
    setup_logging(cfg.log.level.value)

    def announce(started: NodeStarted) -> None:
        print(
            f"nexa node {__version__} running as node {started.node_id} "
            f"(accepted epoch {started.epoch}, generation {started.generation})"
        )
        sys.stdout.flush()

    return _run_role(partial(serve_node, cfg), announce)


def _cmd_node_enroll(args: argparse.Namespace) -> int:
    import socket

    from nexa.client import ApiClient
    from nexa.contracts import codec
    from nexa.contracts.api import EnrollResponse
    from nexa.node import identity

    cfg = config.load(args.enroll_config, config.NodeConfig) if args.enroll_config else config.NodeConfig()
    state_dir = Path(args.enroll_state_dir or cfg.state_dir)
    # The keys that come back are pinned only if they are the controller the operator meant.
    pin = identity.expected_fingerprint(args.token, args.controller_fingerprint)
    if pin is None:
        raise ConfigError(
            "the token carries no controller fingerprint: pass --controller-fingerprint "
            "(`nexa tokens create` prints it)"
        )
    req = identity.enroll_request(state_dir, args.token, args.name or socket.gethostname(), __version__)
    with ApiClient(args.controller, None) as client:
        resp = client.post("/api/v1/enroll", EnrollResponse, body=codec.api.unstructure(req))
    identity.save_enrollment(state_dir, resp, pin=pin, controller_url=args.controller)
    print(f"enrolled as node {resp.node_id}; the channel is {resp.channel_endpoint}")
    print(f"pinned controller fingerprint {pin}")
    print(f"start the agent with: nexa node --state-dir {state_dir}")
    return EXIT_OK


def _node_tool_commands(verbs: Any) -> None:
    """`nexa node inventory` and `nexa node doctor`: they look at this host and start nothing."""
    s = verbs.add_parser("inventory", help="print what this node would report: discovery merged with inventory.json")
    s.add_argument("--config", dest="inv_config", default=None, help="node TOML config")
    s.add_argument("--inventory", dest="inv_path", help="overrides inventory_path")
    s.add_argument("--json", action="store_true", help="print JSON")
    s.set_defaults(handler=_cmd_node_inventory)
    s = verbs.add_parser("doctor", help="check this host for the agent, before enrollment and after (exit 0: no FAIL)")
    s.add_argument("--config", dest="doctor_config", default=None, help="node TOML config (default: $NEXA_CONFIG)")
    s.add_argument("--state-dir", dest="doctor_state_dir", help="overrides state_dir")
    s.add_argument(
        "--controller",
        dest="doctor_controller",
        default="",
        help="controller URL (default: the enrolled one); an https one's certificate is checked against the "
        "system's CAs, or $NEXA_CA_FILE",
    )
    s.add_argument("--controller-fingerprint", dest="doctor_fingerprint", help="the fingerprint to expect")
    s.add_argument(
        "--min-free-gib", type=float, default=50.0, help="free space the artifact cache needs (GiB, default 50)"
    )
    s.add_argument(
        "--min-cache-free-gib",
        type=float,
        default=10.0,
        help="free space the runtime caches (in state_dir) need (GiB, default 10)",
    )
    s.add_argument(
        "--cdi-dir", action="append", help="where CDI specs are (repeatable; default /etc/cdi, /var/run/cdi)"
    )
    s.add_argument("--json", dest="doctor_json", action="store_true", help="print the report as JSON")
    s.set_defaults(handler=_cmd_node_doctor)


def _cmd_node_doctor(args: argparse.Namespace) -> int:
    import math

    import trio

    from nexa import security
    from nexa.contracts import codec
    from nexa.errors import ContractError
    from nexa.node import doctor

    path = args.doctor_config or args.config
    cfg = config.load(path, config.NodeConfig) if path else config.NodeConfig()
    if args.doctor_state_dir:
        cfg = config.structure_config(
            {**config.unstructure_config(cfg), "state_dir": args.doctor_state_dir}, config.NodeConfig
        )
    fingerprint = None
    if args.doctor_fingerprint:
        try:
            fingerprint = security.parse_controller_fingerprint(args.doctor_fingerprint)
        except ContractError as exc:
            raise ConfigError(f"--controller-fingerprint: {exc.message}") from None
    if not (math.isfinite(args.min_free_gib) and args.min_free_gib >= 0):
        raise ConfigError("--min-free-gib must be a number of GiB, 0 or more")
    if not (math.isfinite(args.min_cache_free_gib) and args.min_cache_free_gib >= 0):
        raise ConfigError("--min-cache-free-gib must be a number of GiB, 0 or more")
    opts = doctor.DoctorOptions(
        controller_url=doctor.check_controller_url(args.doctor_controller) if args.doctor_controller else "",
        controller_fingerprint=fingerprint,
        min_free_bytes=int(args.min_free_gib * 2**30),
        cdi_dirs=tuple(args.cdi_dir) if args.cdi_dir else doctor.DEFAULT_CDI_DIRS,
        meminfo_path=cfg.meminfo_path,
        min_cache_free_bytes=int(args.min_cache_free_gib * 2**30),
    )
    report = trio.run(doctor.run_doctor, cfg, opts)
    if args.doctor_json:
        print(codec.dumps(codec.api, report))
    else:
        for line in doctor.render_text(report):
            print(line)
    return EXIT_OK if report.passed else EXIT_FAILED


def _cmd_node_inventory(args: argparse.Namespace) -> int:
    import trio

    from nexa.cli.nodes import fabric_lines
    from nexa.contracts import codec
    from nexa.contracts.fabric import effective_fabric
    from nexa.node.inventory import probe

    cfg = config.load(args.inv_config, config.NodeConfig) if args.inv_config else config.NodeConfig()
    path = args.inv_path or cfg.inventory_path
    inventory = trio.run(
        partial(probe, path, cfg.nvidia_smi or None, meminfo_path=cfg.meminfo_path, sysfs_path=cfg.sysfs_path)
    )
    data = codec.store.unstructure(inventory)
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
        return EXIT_OK
    print(f"host         {inventory.hostname} ({inventory.arch}, {inventory.cpu_count} CPUs)")
    print(f"memory       {gib(inventory.memory_total_bytes)} (available {gib(inventory.memory_available_bytes)})")
    for gpu in inventory.gpus:
        memory = "unified with the host" if gpu.unified_memory else gib(gpu.memory_total_bytes)
        print(f"gpu {gpu.index}        {gpu.name}, {memory}, {gpu.cdi_device}, driver {gpu.driver_version or '-'}")
    print(f"accelerator  pool {gib(inventory.accelerator_memory_bytes)}")
    print(f"labels       {', '.join(f'{k}={v}' for k, v in sorted(inventory.labels.items())) or '-'}")
    print(f"runtimes     {', '.join(inventory.runtimes) or '-'}")
    print(f"data         {', '.join(inventory.data_classes) or '-'}")
    for line in fabric_lines(inventory.fabric, effective_fabric(inventory.labels, inventory.fabric)):
        print(line)
    for problem in inventory.problems:
        print(f"problem      {problem}")
    return EXIT_OK


def _node_rotate_command(verbs: Any) -> None:
    """`nexa node rotate-keys`: new keys on this node, which the running agent sends to the controller."""
    s = verbs.add_parser("rotate-keys", help="make new node keys and have the running agent rotate to them")
    s.add_argument("--config", dest="rotate_config", default=None, help="node TOML config (for state_dir)")
    s.add_argument("--state-dir", dest="rotate_state_dir", help="overrides state_dir")
    s.add_argument(
        "--wait", type=float, default=60.0, help="seconds to wait for the agent to finish (0: do not wait; default 60)"
    )
    s.set_defaults(handler=_node_rotate_keys)


def _node_rotate_keys(args: argparse.Namespace) -> int:
    from nexa.node import identity

    path = args.rotate_config or args.config
    cfg = config.load(path, config.NodeConfig) if path else config.NodeConfig()
    state_dir = Path(args.rotate_state_dir or args.state_dir or cfg.state_dir)
    node_id = identity.load_enrollment(state_dir).node_id
    pending = identity.prepare_rotation(state_dir)
    fingerprint = pending.signing_key.public.fingerprint
    print(f"node {node_id}: new keys made (signing key {fingerprint}); the running agent sends them to the controller")
    if args.wait <= 0:
        return EXIT_OK
    deadline = time.monotonic() + args.wait
    while identity.load_pending_keys(state_dir) is not None:
        if time.monotonic() >= deadline:
            raise Unavailable(
                f"the agent has not rotated to the new keys within {args.wait:g} s: is `nexa node` running and "
                "connected? The new keys stay in the state directory and take effect once the controller confirms them"
            )
        time.sleep(_ROTATE_POLL_S)
    if identity.load_identity(state_dir).signing_key.public != pending.signing_key.public:
        raise Conflict(
            "the controller refused the new keys (the agent's log and `node.message.rejected` in the audit say why); "
            "the node keeps its keys"
        )
    print(f"node {node_id}: keys rotated; the controller knows it by signing key {fingerprint}")
    return EXIT_OK


def _sim_runtime_command(sub: Any) -> None:
    s = sub.add_parser(
        "sim-runtime", help="a simulated OpenAI-compatible runtime (tests and demos; needs NEXA_SIMULATION_ONLY=1)"
    )
    s.add_argument("--host", default="127.0.0.1", help="a loopback address")
    s.add_argument("--port", type=int, default=0, help="0: any free port (the address is printed)")
    s.add_argument("--model", default="sim", help="the model name /v1/models reports")
    s.add_argument("--ttft-ms", type=float, default=20.0, help="time to the first token")
    s.add_argument("--tokens-per-s", type=float, default=200.0, help="tokens per second after the first")
    s.add_argument("--output-tokens", type=int, default=16, help="tokens per answer (less if max_tokens says so)")
    s.add_argument("--embedding-dim", type=int, default=384)
    s.add_argument("--journal", default="", help="JSON-lines journal of requests and outcomes (no payloads)")
    s.add_argument("--faults", default="", help="JSON faults file, re-read when it changes; replaces the flags below")
    s.add_argument("--fail", choices=("before", "after"), help="fail every request before or after the first bytes")
    s.add_argument("--hang", choices=("before", "after"), help="stop sending, before or after the first bytes")
    s.add_argument("--fail-status", type=int, default=500, help="the status of a failure before the first byte")
    s.add_argument("--after-tokens", type=int, default=2, help="tokens sent before an `after` fault")
    s.add_argument("--queue-depth", type=int, default=0, help="requests /metrics says are waiting")
    s.add_argument("--kv-cache-usage", type=float, default=0.0, help="KV-cache use /metrics reports (0 to 1)")
    s.add_argument("--metrics-fail", action="store_true", help="/metrics answers 503")
    s.add_argument("--artifact", default="", help="the model artifact's path (checked to exist, never read)")
    s.add_argument("--exit-with-parent", action="store_true", help="stop when the parent process goes away")
    s.add_argument(
        "--enable-sleep-mode",
        action="store_true",
        help="vLLM's sleep endpoints: POST /sleep?level=1|2, POST /wake_up, GET /is_sleeping",
    )
    s.add_argument(
        "--serve",  # nexa.adapters.SIM_SERVE_FLAG: the controller reads it from a sim deployment's command
        default=None,
        help="what is served besides chat, completions and embeddings, comma-separated: rerank, score,"
        " tokenize, detokenize, transcription, translation, speech, image (the default: these eight),"
        " messages, message_tokens, responses (vLLM's native Messages and Responses APIs); none",
    )
    s.add_argument(
        "--max-loras",
        type=int,
        default=0,
        help="serve vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, this many adapters at once (0: off)",
    )
    s.add_argument("--log-level", default=os.environ.get("NEXA_LOG_LEVEL") or "warning")
    s.set_defaults(handler=_cmd_sim_runtime)


def _cmd_sim_runtime(args: argparse.Namespace) -> int:
    from nexa import simruntime
    from nexa.adapters import SIM_SERVE_FLAG, sim_serves
    from nexa.telemetry import setup_logging

    serves = sim_serves([] if args.serve is None else [SIM_SERVE_FLAG, args.serve])
    if serves is None:
        problem = f"{SIM_SERVE_FLAG}: comma-separated names of rerank, score, tokenize, detokenize, messages,"
        problem += " message_tokens, responses; or none"
        raise ConfigError("invalid sim-runtime flags: " + problem, problems=(problem,))

    cfg = simruntime.SimConfig(
        host=args.host,
        port=args.port,
        model=args.model,
        ttft_ms=args.ttft_ms,
        tokens_per_s=args.tokens_per_s,
        output_tokens=args.output_tokens,
        embedding_dim=args.embedding_dim,
        journal=args.journal,
        faults_path=args.faults,
        faults=simruntime.Faults(
            fail=None if args.fail is None else simruntime.Phase(args.fail),
            hang=None if args.hang is None else simruntime.Phase(args.hang),
            status=args.fail_status,
            after_tokens=args.after_tokens,
            queue_depth=args.queue_depth,
            kv_cache_usage=args.kv_cache_usage,
            metrics_fail=args.metrics_fail,
        ),
        artifact=args.artifact,
        exit_with_parent=args.exit_with_parent,
        sleep_mode=args.enable_sleep_mode,
        serves=serves,
        max_loras=args.max_loras,
    )
    simruntime.check_config(cfg, os.environ)
    setup_logging(args.log_level)

    def announce(started: simruntime.SimStarted) -> None:
        print(f"nexa sim-runtime {__version__} listening on {', '.join(started.urls)} (simulation only)")
        sys.stdout.flush()

    return _run_role(partial(simruntime.serve_sim, cfg), announce)


async def _stop_on_signal(stopping: Any, scope: Any) -> None:
    """First SIGTERM/SIGINT: graceful stop. A second one: cancel everything now."""
    import trio

    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT) as signals:
        async for _ in signals:
            if stopping.is_set():
                scope.cancel()
                return
            stopping.set()
