"""The `nexa` command: roles (`control`), tools (`version`, `check-config`) and the operator CLI.

Owns argument parsing, log handler setup, signals and `trio.run`. Imports each role lazily so
that `nexa version` and the operator commands start fast.

Exit codes: 0 success; 1 the operation failed (remote error, verify failed, cannot start);
2 bad usage or invalid configuration; 3 a running role stopped because its store became unusable
(corrupt, not a database, I/O failure, read-only). A role's loops that fail otherwise are
restarted (`nexa.supervision`), never an exit.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any, Final

from nexa import __version__, config
from nexa.errors import ConfigError, NexaError, RemoteError, StoreUnusable

if TYPE_CHECKING:
    from nexa.security import PublicKey

EXIT_OK: Final = 0
EXIT_FAILED: Final = 1
EXIT_USAGE: Final = 2
EXIT_STORE_UNUSABLE: Final = 3
DEFAULT_URL: Final = "http://127.0.0.1:8470"
ROLES: Final = ("admin", "operator", "inference", "audit", "monitoring")


def main(argv: Sequence[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    handler: Callable[[argparse.Namespace], int] | None = getattr(args, "handler", None)
    if handler is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        return handler(args)
    except ConfigError as exc:
        print(f"nexa: {exc.message}", file=sys.stderr)
        return EXIT_USAGE
    except RemoteError as exc:
        rid = f" (request {exc.request_id})" if exc.request_id else ""
        print(f"nexa: error: {exc.remote_code}: {exc.message}{rid}", file=sys.stderr)
        return EXIT_FAILED
    except NexaError as exc:
        print(f"nexa: error: {exc.message}", file=sys.stderr)
        # An unusable database is not fixed by a restart: its own exit code, for alerting.
        return EXIT_STORE_UNUSABLE if isinstance(exc, StoreUnusable) else EXIT_FAILED
    except KeyboardInterrupt:
        return 130


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nexa", description="LunaNexa model and GPU-cluster control plane")
    sub = p.add_subparsers(metavar="COMMAND")

    s = sub.add_parser("version", help="print the version")
    s.set_defaults(handler=_cmd_version)

    s = sub.add_parser("check-config", help="validate a config file (exit 0 valid, 2 invalid)")
    s.add_argument("file")
    s.add_argument("--role", choices=("control", "node"), default="control", help="which config it is")
    s.set_defaults(handler=_cmd_check_config)

    s = sub.add_parser("keygen", help="print a new API key in nexa's format (for bootstrap.admin_key_file)")
    s.set_defaults(handler=_cmd_keygen)

    openapi_help = "print the HTTP API's OpenAPI 3.1 document (as GET /api/v1/openapi.json)"
    sub.add_parser("openapi", help=openapi_help).set_defaults(handler=_cmd_openapi)

    s = sub.add_parser("control", help="run the controller")
    s.add_argument("--config", default=os.environ.get("NEXA_CONFIG"), help="TOML config file ($NEXA_CONFIG)")
    s.add_argument("--state-dir", help="overrides state_dir")
    s.add_argument("--listen", help="HOST:PORT, overrides http.listen")
    s.add_argument("--channel", help="HOST:PORT (or tcp://HOST:PORT) of the node channel, overrides channel.listen")
    s.add_argument("--log-level", default=os.environ.get("NEXA_LOG_LEVEL"), help="overrides log.level")
    s.set_defaults(handler=_cmd_control)

    node = sub.add_parser("node", help="run the node agent, or enroll this node (`nexa node enroll`)")
    node.add_argument("--config", default=os.environ.get("NEXA_CONFIG"), help="TOML config file ($NEXA_CONFIG)")
    node.add_argument("--state-dir", help="overrides state_dir")
    node.add_argument("--inventory", help="overrides inventory_path")
    node.add_argument("--source-address", help="local address to dial the controller from")
    node.add_argument("--log-level", default=os.environ.get("NEXA_LOG_LEVEL"), help="overrides log.level")
    node.set_defaults(handler=_cmd_node)
    verbs = node.add_subparsers(metavar="VERB")
    s = verbs.add_parser("enroll", help="enroll this node with a one-time token from `nexa tokens create`")
    s.add_argument("--controller", required=True, help="controller URL, e.g. https://control.example:8470")
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

    _sim_runtime_command(sub)

    s = sub.add_parser("demo", help="a local cluster: registry, S3 store, controller and four sim nodes")
    s.add_argument("--state-dir", default=".nexa/demo", help="the demo's own directory, emptied at start")
    s.add_argument("--listen", default="127.0.0.1:8470", help="the controller's HTTP address")
    s.add_argument("--nodes", type=int, default=4, help="node agents, 1 to 4 (127.0.0.11 to .14)")
    s.add_argument("--replicas", type=int, default=2, help="replicas of the `chat` deployment")
    s.add_argument("--real", action="store_true", help="the real llama.cpp runtime in podman on CPU, not `sim`")
    s.add_argument("--log-level", default=os.environ.get("NEXA_LOG_LEVEL", "warning"))
    s.set_defaults(handler=_cmd_demo)

    _operator_commands(sub)
    return p


# ---- tools -------------------------------------------------------------------------------------


def _cmd_version(_: argparse.Namespace) -> int:
    print(f"nexa {__version__}")
    return EXIT_OK


def _cmd_check_config(args: argparse.Namespace) -> int:
    config.load(args.file, config.ControlConfig if args.role == "control" else config.NodeConfig)
    print(f"{args.file}: ok")
    return EXIT_OK


def _cmd_openapi(_: argparse.Namespace) -> int:
    from nexa.control import openapi

    print(json.dumps(openapi.document(), indent=2, sort_keys=True))
    return EXIT_OK


def _cmd_keygen(_: argparse.Namespace) -> int:
    from nexa.control.registry import new_api_key

    print(new_api_key()[1])
    return EXIT_OK


# ---- roles -------------------------------------------------------------------------------------


def _control_config(args: argparse.Namespace) -> config.ControlConfig:
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


def _cmd_control(args: argparse.Namespace) -> int:
    from nexa.control.service import ControlStarted, serve_control
    from nexa.telemetry import setup_logging

    cfg = _control_config(args)
    setup_logging(cfg.log.level.value)

    def announce(started: ControlStarted) -> None:
        if started.admin_key:
            print("first start: the admin API key follows; it is shown only this once, store it now:")
            print(f"  NEXA_TOKEN={started.admin_key}")
        print(f"nexa control {__version__} listening on {', '.join(started.urls)} (epoch {started.epoch})")
        sys.stdout.flush()

    return _run_role(partial(serve_control, cfg), announce)


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
    from nexa.node.agent import NodeStarted, serve_node
    from nexa.telemetry import setup_logging

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
        out = client.call("POST", "/api/v1/enroll", body=codec.api.unstructure(req))
    resp = codec.structure(codec.api, out, EnrollResponse)
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
        "--controller", dest="doctor_controller", default="", help="controller URL (default: the enrolled one)"
    )
    s.add_argument("--controller-fingerprint", dest="doctor_fingerprint", help="the fingerprint to expect")
    s.add_argument(
        "--min-free-gib", type=float, default=50.0, help="free space the artifact cache needs (GiB, default 50)"
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
    opts = doctor.DoctorOptions(
        controller_url=doctor.check_controller_url(args.doctor_controller) if args.doctor_controller else "",
        controller_fingerprint=fingerprint,
        min_free_bytes=int(args.min_free_gib * 2**30),
        cdi_dirs=tuple(args.cdi_dir) if args.cdi_dir else doctor.DEFAULT_CDI_DIRS,
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

    from nexa.contracts import codec
    from nexa.node.inventory import probe

    cfg = config.load(args.inv_config, config.NodeConfig) if args.inv_config else config.NodeConfig()
    path = args.inv_path or cfg.inventory_path
    inventory = trio.run(probe, path, cfg.nvidia_smi or None)
    data = codec.store.unstructure(inventory)
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
        return EXIT_OK
    print(f"host         {inventory.hostname} ({inventory.arch}, {inventory.cpu_count} CPUs)")
    print(f"memory       {_gib(inventory.memory_total_bytes)} (available {_gib(inventory.memory_available_bytes)})")
    for gpu in inventory.gpus:
        memory = "unified with the host" if gpu.unified_memory else _gib(gpu.memory_total_bytes)
        print(f"gpu {gpu.index}        {gpu.name}, {memory}, {gpu.cdi_device}, driver {gpu.driver_version or '-'}")
    print(f"accelerator  pool {_gib(inventory.accelerator_memory_bytes)}")
    print(f"labels       {', '.join(f'{k}={v}' for k, v in sorted(inventory.labels.items())) or '-'}")
    print(f"runtimes     {', '.join(inventory.runtimes) or '-'}")
    print(f"data         {', '.join(inventory.data_classes) or '-'}")
    for problem in inventory.problems:
        print(f"problem      {problem}")
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
    s.add_argument("--artifact", default="", help="the model artifact's path (checked to exist, never read)")
    s.add_argument("--exit-with-parent", action="store_true", help="stop when the parent process goes away")
    s.add_argument("--log-level", default=os.environ.get("NEXA_LOG_LEVEL") or "warning")
    s.set_defaults(handler=_cmd_sim_runtime)


def _cmd_sim_runtime(args: argparse.Namespace) -> int:
    from nexa import simruntime
    from nexa.telemetry import setup_logging

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
        ),
        artifact=args.artifact,
        exit_with_parent=args.exit_with_parent,
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


# ---- operator commands over HTTP ---------------------------------------------------------------


def _operator_commands(sub: Any) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--url", default=os.environ.get("NEXA_URL", DEFAULT_URL), help="controller URL ($NEXA_URL)")
    common.add_argument("--token", default=os.environ.get("NEXA_TOKEN"), help="API key ($NEXA_TOKEN)")
    common.add_argument("--json", action="store_true", help="print JSON for scripts")

    keys = sub.add_parser("keys", help="API keys (admin)").add_subparsers(metavar="VERB", required=True)
    s = keys.add_parser("create", parents=[common], help="create a key; its secret is printed once")
    s.add_argument("--role", required=True, choices=ROLES)
    s.add_argument("--tenant", help="required for role inference")
    s.add_argument("--name", default="")
    s.set_defaults(handler=_keys_create)
    s = keys.add_parser("list", parents=[common])
    s.set_defaults(handler=_keys_list)
    s = keys.add_parser("revoke", parents=[common])
    s.add_argument("key_id")
    s.set_defaults(handler=_keys_revoke)

    tenants = sub.add_parser("tenants", help="tenants (admin)").add_subparsers(metavar="VERB", required=True)
    s = tenants.add_parser("create", parents=[common])
    s.add_argument("tenant_id")
    s.add_argument("--display-name", default="")
    s.set_defaults(handler=_tenants_create)
    s = tenants.add_parser("list", parents=[common])
    s.set_defaults(handler=_tenants_list)

    tokens = sub.add_parser("tokens", help="one-time node enrollment tokens (admin)").add_subparsers(
        metavar="VERB", required=True
    )
    s = tokens.add_parser("create", parents=[common], help="create a token; it is printed once")
    s.add_argument("--ttl", default="15m", type=_duration, help="lifetime, e.g. 900, 90s, 15m, 2h (default 15m)")
    s.add_argument("--labels", default="", help="labels the node gets: k=v,k2=v2")
    s.set_defaults(handler=_tokens_create)

    nodes = sub.add_parser("nodes", help="the fleet (operator; revoke: admin)").add_subparsers(
        metavar="VERB", required=True
    )
    s = nodes.add_parser("list", parents=[common])
    s.set_defaults(handler=_nodes_list)
    s = nodes.add_parser("show", parents=[common])
    s.add_argument("node_id")
    s.set_defaults(handler=_nodes_show)
    for verb in ("cordon", "uncordon", "drain", "revoke"):
        s = nodes.add_parser(verb, parents=[common])
        s.add_argument("node_id")
        s.set_defaults(handler=_nodes_action, verb=verb)

    _audit_commands(sub, common)
    _registry_commands(sub, common)
    _gateway_commands(sub, common)


def _audit_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    audit = sub.add_parser("audit", help="the audit chain (audit, admin)").add_subparsers(metavar="VERB", required=True)
    s = audit.add_parser("list", parents=[common])
    s.add_argument("--action")
    s.add_argument("--actor", help="key id")
    s.add_argument("--target")
    s.add_argument("--since", type=float, help="unix seconds")
    s.add_argument("--until", type=float, help="unix seconds")
    s.add_argument("--after", type=int, default=0, help="cursor: list events after this sequence number")
    s.add_argument("--limit", type=int, default=100)
    s.set_defaults(handler=_audit_list)
    s = audit.add_parser("verify", parents=[common], help="recompute the chain; exit 1 if it is broken")
    s.add_argument(
        "--against",
        metavar="HEAD_FILE",
        help="also check a checkpoint saved by `nexa audit head`: its signature, and that the chain still holds it",
    )
    s.add_argument(
        "--public-key",
        help="with --against: the controller's signing key (base64, or @FILE). Without it, fetched from --url",
    )
    s.set_defaults(handler=_audit_verify)
    s = audit.add_parser(
        "head", parents=[common], help="print the chain's head (seq, sha256) signed by the controller; keep it"
    )
    s.set_defaults(handler=_audit_head)


def _client(args: argparse.Namespace) -> Any:
    from nexa.client import ApiClient

    if not args.token:
        raise ConfigError("no API key: set NEXA_TOKEN or pass --token")
    return ApiClient(args.url, args.token)


def _emit(args: argparse.Namespace, data: Any, rows: list[dict[str, Any]], columns: Sequence[str]) -> None:
    if args.json:
        print(json.dumps(data, indent=2, sort_keys=True))
        return
    print(_table(rows, columns))


def _table(rows: list[dict[str, Any]], columns: Sequence[str]) -> str:
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max([len(c), *(len(row[i]) for row in cells)]) for i, c in enumerate(columns)]
    lines = ["  ".join(c.upper().ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip()]
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)).rstrip() for row in cells]
    if not rows:
        lines.append("(none)")
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and value > 1e9:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(value))
    return str(value)


def _keys_create(args: argparse.Namespace) -> int:
    body = {"role": args.role, "name": args.name, "tenant": args.tenant}
    with _client(args) as c:
        out = c.call("POST", "/api/v1/keys", body=body)
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
    else:
        info = out["info"]
        print(f"created key {info['id']} (role {info['role']}{', tenant ' + info['tenant'] if info['tenant'] else ''})")
        print("secret (shown only this once):")
        print(out["key"])
    return EXIT_OK


def _keys_list(args: argparse.Namespace) -> int:
    with _client(args) as c:
        out = c.call("GET", "/api/v1/keys")
    rows = [{**k, "state": "revoked" if k["revoked_at"] else "active"} for k in out["keys"]]
    _emit(args, out, rows, ("id", "role", "tenant", "name", "state", "created_at"))
    return EXIT_OK


def _keys_revoke(args: argparse.Namespace) -> int:
    with _client(args) as c:
        out = c.call("DELETE", f"/api/v1/keys/{args.key_id}")
    _emit(args, out, [out], ("id", "role", "revoked_at"))
    return EXIT_OK


def _tenants_create(args: argparse.Namespace) -> int:
    with _client(args) as c:
        out = c.call("POST", "/api/v1/tenants", body={"id": args.tenant_id, "display_name": args.display_name})
    _emit(args, out, [out], ("id", "display_name", "created_at"))
    return EXIT_OK


def _tenants_list(args: argparse.Namespace) -> int:
    with _client(args) as c:
        out = c.call("GET", "/api/v1/tenants")
    _emit(args, out, out["tenants"], ("id", "display_name", "created_at"))
    return EXIT_OK


def _audit_list(args: argparse.Namespace) -> int:
    params = {"after": str(args.after), "limit": str(args.limit)}
    for name in ("action", "actor", "target", "since", "until"):
        value = getattr(args, name)
        if value is not None:
            params[name] = str(value)
    with _client(args) as c:
        out = c.call("GET", "/api/v1/audit", params=params)
    _emit(args, out, out["events"], ("seq", "time", "action", "target", "actor_key_id", "actor_role", "result"))
    if not args.json and out["next_cursor"] is not None:
        print(f"(more: --after {out['next_cursor']})")
    return EXIT_OK


def _audit_head(args: argparse.Namespace) -> int:
    with _client(args) as c:
        out = c.call("GET", "/api/v1/audit/head")
    print(json.dumps(out, indent=2, sort_keys=True))
    return EXIT_OK


def _audit_verify(args: argparse.Namespace) -> int:
    body = None
    with _client(args) as c:
        if args.against is not None:
            head = _checked_audit_head(args, c)
            if head is None:
                return EXIT_FAILED
            body = {"against": head}
        out = c.call("POST", "/api/v1/audit/verify", body=body)
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
    elif out["ok"]:
        held = f"; it holds the signed checkpoint at seq {body['against']['checkpoint']['seq']}" if body else ""
        print(f"audit chain ok: {out['checked']} events verified{held}")
    else:
        print(
            f"audit chain BROKEN at event seq {out['first_bad_seq']} (id {out['first_bad_id']}): {out['reason']}; "
            f"{out['checked']} events before it verified",
            file=sys.stderr,
        )
    return EXIT_OK if out["ok"] else EXIT_FAILED


def _checked_audit_head(args: argparse.Namespace, c: Any) -> Any:
    """The `--against` file, once its signature verifies with the controller's key (here, not only
    on the controller); None, after saying why, when it does not."""
    from nexa import security
    from nexa.contracts import codec
    from nexa.contracts.api import SignedAuditCheckpoint
    from nexa.errors import BadSignature

    signed = codec.loads(codec.api, _read_file(args.against), SignedAuditCheckpoint)
    pub = _public_key(args.public_key, lambda: str(c.call("GET", "/api/v1/receipts/public-key")["public_key"]))
    try:
        security.verify_audit_checkpoint(pub, signed)
    except BadSignature as exc:
        print(f"audit checkpoint {args.against}: INVALID ({exc.message})", file=sys.stderr)
        return None
    return codec.api.unstructure(signed)


_UNITS: Final = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def _duration(text: str) -> float:
    number, unit = (text[:-1], text[-1]) if text and text[-1] in _UNITS else (text, "s")
    try:
        value = float(number) * _UNITS[unit]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a duration: {text!r} (use e.g. 900, 90s, 15m, 2h)") from None
    if value <= 0:
        raise argparse.ArgumentTypeError("a duration must be positive")
    return value


def _labels(text: str) -> dict[str, str]:
    labels = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"--labels: {item!r} is not key=value")
        labels[key.strip()] = value.strip()
    return labels


def _tokens_create(args: argparse.Namespace) -> int:
    body = {"ttl_s": args.ttl, "labels": _labels(args.labels)}
    with _client(args) as c:
        out = c.call("POST", "/api/v1/enrollment-tokens", body=body)
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
    else:
        expires = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(out["expires_at"]))
        print(f"enrollment token {out['id']} (single use, expires {expires}); shown only this once:")
        print(out["token"])
        if out.get("controller_fingerprint"):
            # Also inside the token (after the `.`): the node refuses a controller with other keys.
            print(f"controller fingerprint: {out['controller_fingerprint']}")
        print(f"on the node: nexa node enroll --controller {args.url} --token {out['token']}")
    return EXIT_OK


def _gib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**30:.1f} GiB"


def _accelerators(inventory: dict[str, Any] | None) -> str:
    if not inventory or not inventory.get("gpus"):
        return "-"
    names: dict[str, int] = {}
    for gpu in inventory["gpus"]:
        name = gpu["name"] + (" (unified)" if gpu.get("unified_memory") else "")
        names[name] = names.get(name, 0) + 1
    return ", ".join(f"{n}x {name}" for name, n in names.items())


def _node_row(n: dict[str, Any]) -> dict[str, Any]:
    age = n["last_heartbeat_age_s"]
    return {
        "id": n["id"],
        "state": n["state"],
        "heartbeat": "never" if age is None else f"{age:.1f}s ago",
        "labels": ",".join(f"{k}={v}" for k, v in sorted(n["labels"].items())) or "-",
        "accelerators": _accelerators(n["inventory"]),
        "free_memory": _gib(n["free_memory_bytes"]) if n["inventory"] else "-",
        "assignments": f"{len(n['assignments'])} (gen {n['acked_generation']}/{n['desired_generation']})",
    }


_NODE_COLUMNS: Final = ("id", "state", "heartbeat", "labels", "accelerators", "free_memory", "assignments")


def _nodes_list(args: argparse.Namespace) -> int:
    with _client(args) as c:
        out = c.call("GET", "/api/v1/nodes")
    _emit(args, out, [_node_row(n) for n in out["nodes"]], _NODE_COLUMNS)
    return EXIT_OK


def _nodes_show(args: argparse.Namespace) -> int:
    with _client(args) as c:
        n = c.call("GET", f"/api/v1/nodes/{args.node_id}")
    if args.json:
        print(json.dumps(n, indent=2, sort_keys=True))
        return EXIT_OK
    row = _node_row(n)
    inv = n["inventory"] or {}
    taints = ", ".join("{key}={value}:{effect}".format(**t) for t in inv.get("taints", [])) or "-"
    free = _gib(n["free_memory_bytes"]) if inv else "-"
    ack = f"; last refusal: {n['ack_reason']}" if n["ack_reason"] else ""
    lines = [
        f"node         {n['id']} ({n['hostname']})",
        f"state        {n['state']} (admin: {n['admin_state']})",
        f"heartbeat    {row['heartbeat']}; agent {n['agent_version'] or '-'}",
        f"labels       {row['labels']}",
        f"taints       {taints}",
        f"data         {', '.join(inv.get('data_classes', [])) or '-'}",
        f"runtimes     {', '.join(inv.get('runtimes', [])) or '-'}",
        f"host         {inv.get('arch', '-')}, {inv.get('cpu_count', '-')} CPUs, "
        f"memory {_gib(inv.get('memory_total_bytes'))} (free {free})",
        f"accelerators {row['accelerators']}; pool {_gib(inv.get('accelerator_memory_bytes'))}",
        f"engine       {inv.get('container_engine') or '-'} {inv.get('container_engine_version') or '-'}, "
        f"GPUs by {inv.get('gpu_method') or '-'}",
        f"assignments  generation {n['acked_generation']} acked of {n['desired_generation']} desired{ack}",
    ]
    lines += [
        f"  {a['assignment_id']}: {a['state']}{'(' + a['reason'] + ')' if a.get('reason') else ''} "
        f"restarts {a.get('restarts', 0)} {a['detail']}".rstrip()
        for a in n["assignments"]
    ]
    lines += [f"problem      {p}" for p in inv.get("problems", [])]
    print("\n".join(lines))
    return EXIT_OK


def _nodes_action(args: argparse.Namespace) -> int:
    with _client(args) as c:
        n = c.call("POST", f"/api/v1/nodes/{args.node_id}/{args.verb}")
    if args.json:
        print(json.dumps(n, indent=2, sort_keys=True))
    else:
        print(f"node {n['id']}: {n['state']} (admin: {n['admin_state']})")
    return EXIT_OK


# ---- registry: runtimes, models, aliases -------------------------------------------------------

RUNTIME_KINDS: Final = ("vllm", "sglang", "trtllm", "llamacpp", "sim")
MODEL_FORMATS: Final = ("gguf", "safetensors", "onnx", "tensorrt", "tar")
MODEL_STATES: Final = ("Candidate", "Verified", "Evaluated", "Approved", "Retired")


def _registry_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    _runtime_commands(sub, common)
    _model_commands(sub, common)
    _alias_commands(sub, common)
    _deployment_commands(sub, common)


def _runtime_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    runtimes = sub.add_parser("runtimes", help="runtime images (operator)").add_subparsers(
        metavar="VERB", required=True
    )
    s = runtimes.add_parser("register", parents=[common], help="register an image; its registry must hold the digest")
    s.add_argument("name")
    s.add_argument("--kind", required=True, choices=RUNTIME_KINDS)
    s.add_argument("--version", required=True)
    s.add_argument("--image", required=True, help="registry/repository@sha256:<64 hex>")
    s.add_argument(
        "--host-network",
        action="store_true",
        help="run its containers in the node's network namespace (default: a namespace of their own)",
    )
    s.set_defaults(handler=_runtimes_register)
    s = runtimes.add_parser("list", parents=[common])
    s.set_defaults(handler=_runtimes_list)
    s = runtimes.add_parser("show", parents=[common])
    s.add_argument("name")
    s.set_defaults(handler=_runtimes_show)


def _model_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    models = sub.add_parser("models", help="model versions and their lifecycle (operator)").add_subparsers(
        metavar="VERB", required=True
    )
    s = models.add_parser("register", parents=[common], help="register a version as Candidate")
    _model_version(s)
    s.add_argument(
        "--uri", required=True, help="s3://bucket/key of the artifact; with --manifest, the prefix its files are under"
    )
    s.add_argument("--manifest", help="a manifest file (`nexa models manifest`): register its files under --uri")
    s.add_argument("--sha256", help="the artifact's sha256 (64 hex); not with --manifest")
    s.add_argument("--size", type=_size, help="the artifact's size in bytes (or 8GiB, 512MiB, …); not with --manifest")
    _model_claims(s)
    s.set_defaults(handler=_models_register)
    s = models.add_parser(
        "push", parents=[common], help="upload a model directory (or one file) to S3 and register it as Candidate"
    )
    _model_version(s)
    s.add_argument("dir", metavar="DIR", help="the model directory, or a single file")
    s.add_argument("--to", help="s3://bucket/prefix/ to upload under (default s3://BUCKET/models/NAME/VERSION/)")
    s.add_argument("--bucket", default=os.environ.get("NEXA_S3_BUCKET"), help="the bucket of the default --to")
    _entry_flag(s)
    _model_claims(s)
    _push_flags(s)
    s.set_defaults(handler=_models_push)
    s = models.add_parser("manifest", help="print the manifest of a model directory (for uploads by other tools)")
    s.add_argument("dir", metavar="DIR", help="the model directory, or a single file")
    _entry_flag(s)
    s.set_defaults(handler=_models_manifest)
    s = models.add_parser("license", parents=[common], help="record the licence and who accepted it")
    _model_version(s)
    _license_flags(s, required=True)
    s.set_defaults(handler=_models_license)
    s = models.add_parser("verify", parents=[common], help="the controller streams and hashes the artifact itself")
    _model_version(s)
    s.add_argument("--signature", help="detached Ed25519 signature (base64) over the 32-byte sha256 digest")
    s.set_defaults(handler=_models_verify)
    s = models.add_parser("evaluate", parents=[common], help="record an evaluation (a pass makes it Evaluated)")
    _model_version(s)
    s.add_argument("--suite", required=True)
    s.add_argument("--metric", action="append", default=[], help="NAME=NUMBER; repeat for more")
    verdict = s.add_mutually_exclusive_group(required=True)
    verdict.add_argument("--passed", dest="passed", action="store_true")
    verdict.add_argument("--failed", dest="passed", action="store_false")
    s.add_argument("--evidence", default="", help="where the full results are kept")
    s.set_defaults(handler=_models_evaluate)
    for verb in ("approve", "retire"):
        s = models.add_parser(verb, parents=[common])
        _model_version(s)
        s.set_defaults(handler=_models_action, verb=verb)
    s = models.add_parser("list", parents=[common])
    s.add_argument("--name")
    s.add_argument("--state", choices=MODEL_STATES)
    s.set_defaults(handler=_models_list)
    s = models.add_parser("show", parents=[common])
    _model_version(s)
    s.set_defaults(handler=_models_show)


def _model_claims(s: argparse.ArgumentParser) -> None:
    s.add_argument("--format", required=True, choices=MODEL_FORMATS)
    s.add_argument("--memory", required=True, type=_size, help="memory to schedule: weights plus runtime overhead")
    s.add_argument("--source", required=True, help="provenance: where the weights come from")
    s.add_argument("--signer", default="", help="provenance: who signed them")
    s.add_argument(
        "--signature",
        help="detached Ed25519 signature (base64) over the 32-byte sha256 digest (a manifest's: see models manifest)",
    )
    _license_flags(s, required=False)


def _entry_flag(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "--entry",
        help="the file or directory the runtime is given, relative ('.' = the directory); "
        "default: the one file, else the one GGUF or a split GGUF's first shard, else '.'",
    )


def _push_flags(s: argparse.ArgumentParser) -> None:
    s.add_argument(
        "--s3-endpoint", default=os.environ.get("NEXA_S3_ENDPOINT"), help="the S3 endpoint URL ($NEXA_S3_ENDPOINT)"
    )
    s.add_argument("--s3-region", default=os.environ.get("NEXA_S3_REGION", "us-east-1"), help="($NEXA_S3_REGION)")
    s.add_argument(
        "--s3-credentials-file",
        default=os.environ.get("NEXA_S3_CREDENTIALS_FILE"),
        help='JSON {"access_key_id": …, "secret_access_key": …} ($NEXA_S3_CREDENTIALS_FILE); none: anonymous',
    )
    s.add_argument("--s3-no-tls-verify", action="store_true", help="do not verify the endpoint's TLS certificate")
    s.add_argument(
        "--multipart-threshold",
        type=_size,
        default="64MiB",
        help="files of at least this size go up in parts (default 64MiB)",
    )
    s.add_argument(
        "--part-size",
        type=_size,
        default="16MiB",
        help="bytes per part of a multipart upload; at least 5MiB, S3's minimum (default 16MiB)",
    )
    s.add_argument("--parallel", type=int, default=4, help="uploads (files and parts) in flight at once (default 4)")
    s.add_argument(
        "--progress-interval",
        type=float,
        help="seconds between progress lines (default 0.25 on a terminal, 5 otherwise)",
    )


def _alias_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    aliases = sub.add_parser("aliases", help="versioned aliases (operator)").add_subparsers(
        metavar="VERB", required=True
    )
    s = aliases.add_parser("list", parents=[common])
    s.set_defaults(handler=_aliases_list)
    s = aliases.add_parser("promote", parents=[common], help="point the alias at an Approved version")
    s.add_argument("alias")
    s.add_argument("--model", required=True)
    s.add_argument("--version", required=True)
    s.set_defaults(handler=_aliases_promote)
    s = aliases.add_parser("rollback", parents=[common], help="undo the latest promotion")
    s.add_argument("alias")
    s.set_defaults(handler=_aliases_rollback)
    s = aliases.add_parser("history", parents=[common], help="the alias and every change, oldest first")
    s.add_argument("alias")
    s.set_defaults(handler=_aliases_history)


def _deployment_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    deployments = sub.add_parser("deployments", help="desired state and placement (operator)").add_subparsers(
        metavar="VERB", required=True
    )
    s = deployments.add_parser("create", parents=[common], help="place and start a deployment")
    _deployment_flags(s)
    s.set_defaults(handler=_deployments_create)
    s = deployments.add_parser("list", parents=[common])
    s.set_defaults(handler=_deployments_list)
    for verb, handler in (("show", _deployments_show), ("placement", _deployments_placement)):
        s = deployments.add_parser(verb, parents=[common])
        s.add_argument("name")
        s.set_defaults(handler=handler)
    s = deployments.add_parser("scale", parents=[common])
    s.add_argument("name")
    s.add_argument("replicas", type=int)
    s.set_defaults(handler=_deployments_scale)
    s = deployments.add_parser("delete", parents=[common], help="stop every replica and forget the deployment")
    s.add_argument("name")
    s.set_defaults(handler=_deployments_delete)
    s = deployments.add_parser("canary", parents=[common], help="run another version beside it on extra replicas")
    s.add_argument("name")
    s.add_argument("--model", required=True)
    s.add_argument("--version", required=True)
    s.add_argument("--replicas", type=int, default=1)
    s.add_argument("--weight", type=float, required=True, help="share of requests for the canary (0..1, exclusive)")
    s.add_argument("--max-error-rate", type=float, default=0.05, help="roll back above this error rate")
    s.add_argument("--max-p95-ms", type=float, help="roll back above this p95 latency (default: not checked)")
    s.add_argument("--window-s", type=float, default=60.0, help="the window the figures cover")
    s.add_argument("--min-requests", type=int, default=20, help="fewer requests in the window decide nothing")
    s.set_defaults(handler=_deployments_canary)
    for verb, handler, text in (
        ("promote", _deployments_promote, "make the canary's version the deployment's (its alias moves too)"),
        ("rollback", _deployments_rollback, "remove the canary, or return to the version before the last promotion"),
    ):
        s = deployments.add_parser(verb, parents=[common], help=text)
        s.add_argument("name")
        s.set_defaults(handler=handler)
    capacity = sub.add_parser("capacity", help="what would fit (operator)").add_subparsers(
        metavar="VERB", required=True
    )
    s = capacity.add_parser("forecast", parents=[common], help="would this deployment fit, and where")
    _deployment_flags(s)
    s.set_defaults(handler=_capacity_forecast)


def _deployment_flags(s: argparse.ArgumentParser) -> None:
    s.add_argument("name")
    s.add_argument("--runtime", required=True, help="a registered runtime")
    target = s.add_mutually_exclusive_group(required=True)
    target.add_argument("--alias", help="deploy what this alias points at")
    target.add_argument("--model", metavar="NAME:VERSION", help="deploy a pinned, Approved model version")
    s.add_argument("--replicas", type=int, default=1)
    s.add_argument("--accelerators", type=int, default=0, help="GPUs per replica")
    s.add_argument("--memory-bytes", type=int, help="memory per replica (default: the model's)")
    s.add_argument("--cpus", type=float, default=1.0)
    s.add_argument("--policy", choices=("spread", "binpack"), default="spread")
    s.add_argument("--selector", default="", help="node labels: k=v,k2=v2")
    s.add_argument("--data-classes", default="", help="comma-separated")
    s.add_argument("--port", type=int, default=18000, help="first loopback port for the runtime")


def _deployment_body(args: argparse.Namespace) -> dict[str, Any]:
    body: dict[str, Any] = {
        "name": args.name,
        "runtime": args.runtime,
        "replicas": args.replicas,
        "resources": {"accelerators": args.accelerators, "memory_bytes": args.memory_bytes, "cpus": args.cpus},
        "options": {"port": args.port},
        "placement": {
            "policy": args.policy,
            "node_selector": _labels(args.selector),
            "data_classes": [c for c in args.data_classes.split(",") if c],
        },
    }
    if args.alias:
        body["alias"] = args.alias
    else:
        name, sep, version = args.model.partition(":")
        if not sep:
            raise ConfigError("--model takes NAME:VERSION")
        body["model"] = {"model": name, "version": version}
    return body


_DEPLOYMENT_COLUMNS: Final = ("name", "model", "runtime", "replicas", "nodes", "problem")


def _deployment_row(d: dict[str, Any]) -> dict[str, Any]:
    dep = d.get("deployment", d)
    model = dep.get("model") or {}
    return {
        "name": dep["name"],
        "model": f"{model.get('model', '-')}:{model.get('version', '-')}",
        "runtime": dep["runtime"],
        "replicas": f"{len(dep.get('placed', []))}/{dep['replicas']}",
        "nodes": ",".join(sorted(r["node_id"] for r in dep.get("placed", []))) or "-",
        "problem": d.get("problem") or "-",
    }


def _deployments_create(args: argparse.Namespace) -> int:
    with _client(args) as c:
        out = c.call("POST", "/api/v1/deployments", body=_deployment_body(args))
    _emit(args, out, [_deployment_row(out)], _DEPLOYMENT_COLUMNS)
    return EXIT_OK


def _deployments_list(args: argparse.Namespace) -> int:
    with _client(args) as c:
        out = c.call("GET", "/api/v1/deployments")
    _emit(args, out, [_deployment_row(d) for d in out["deployments"]], _DEPLOYMENT_COLUMNS)
    return EXIT_OK


def _deployments_show(args: argparse.Namespace) -> int:
    with _client(args) as c:
        out = c.call("GET", f"/api/v1/deployments/{args.name}")
    _emit(args, out, [_deployment_row(out)], _DEPLOYMENT_COLUMNS)
    if not args.json:
        _print_rollout(out)
    return EXIT_OK


def _print_rollout(view: dict[str, Any]) -> None:
    """The canary and the rollout of a deployment, when it has them."""
    dep = view["deployment"]
    canary = dep.get("canary")
    if canary:
        o = canary["objective"]
        p95 = "-" if o["max_p95_ms"] is None else f"{o['max_p95_ms']:g} ms"
        print(
            f"canary   {_ref(canary['model'])}: {view.get('canary_ready', 0)}/{canary['replicas']} Ready, "
            f"weight {canary['weight']:g}; objective: error rate <= {o['max_error_rate']:g}, p95 <= {p95}, "
            f"over {o['window_s']:g} s, from {o['min_requests']} requests"
        )
    rollout = dep.get("rollout")
    if rollout:
        print(
            f"rollout  {_ref(rollout['from'])} -> {_ref(rollout['to'])} ({rollout['reason']}): "
            f"{view.get('rollout_new', 0)} new, {view.get('rollout_old', 0)} old replica(s) left"
        )


def _deployments_canary(args: argparse.Namespace) -> int:
    body = {
        "model": {"model": args.model, "version": args.version},
        "replicas": args.replicas,
        "weight": args.weight,
        "objective": {
            "max_error_rate": args.max_error_rate,
            "max_p95_ms": args.max_p95_ms,
            "window_s": args.window_s,
            "min_requests": args.min_requests,
        },
    }
    with _client(args) as c:
        out = c.call("POST", f"/api/v1/deployments/{args.name}/canary", body=body)
    _emit(args, out, [_deployment_row(out)], _DEPLOYMENT_COLUMNS)
    if not args.json:
        _print_rollout(out)
    return EXIT_OK


def _deployments_promote(args: argparse.Namespace) -> int:
    return _deployment_rollout(args, "promote")


def _deployments_rollback(args: argparse.Namespace) -> int:
    return _deployment_rollout(args, "rollback")


def _deployment_rollout(args: argparse.Namespace, verb: str) -> int:
    with _client(args) as c:
        out = c.call("POST", f"/api/v1/deployments/{args.name}/{verb}")
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
        return EXIT_OK
    print(_table([_deployment_row(out["deployment"])], _DEPLOYMENT_COLUMNS))
    _print_rollout(out["deployment"])
    if out.get("alias"):
        _print_receipt(args, out["alias"])
    return EXIT_OK


def _deployments_scale(args: argparse.Namespace) -> int:
    with _client(args) as c:
        out = c.call("POST", f"/api/v1/deployments/{args.name}/scale", body={"replicas": args.replicas})
    _emit(args, out, [_deployment_row(out)], _DEPLOYMENT_COLUMNS)
    return EXIT_OK


def _deployments_delete(args: argparse.Namespace) -> int:
    with _client(args) as c:
        out = c.call("DELETE", f"/api/v1/deployments/{args.name}")
    _emit(args, out, [_deployment_row(out)], _DEPLOYMENT_COLUMNS)
    return EXIT_OK


def _print_decision(args: argparse.Namespace, out: dict[str, Any]) -> None:
    decision = out.get("decision", out)
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
        return
    if decision is None:
        print("no placement decision yet")
        return
    verdict = "fits" if decision["feasible"] else f"does not fit: {decision['reason']}"
    print(f"{decision['request']['deployment']}: {verdict}")
    host_network = decision["request"].get("host_network", False)
    print("network: " + ("host (the runtime's opt-in)" if host_network else "private namespace per replica"))
    rows = []
    for e in decision["explanations"]:
        failed = [f"{f['name']} ({f['detail']})" for f in e["filters"] if not f["passed"]]
        terms = " ".join(f"{t['name']}={t['value']:.2f}x{t['weight']:g}" for t in e["terms"])
        if (memory := e.get("runtime_memory")) and e["eligible"]:
            how = "derived from the reservation" if memory["derived"] else "as set"
            terms += f"; {memory['flag']} {memory['value']} ({how})"
        rows.append(
            {
                "node": e["node_id"],
                "eligible": "yes" if e["eligible"] else "no",
                "score": f"{e['score']:.2f}" if e["eligible"] else "-",
                "replicas": e["replicas_placed"],
                "why": "; ".join(failed) or terms or "-",
            }
        )
    print(_table(rows, ("node", "eligible", "score", "replicas", "why")))


def _deployments_placement(args: argparse.Namespace) -> int:
    with _client(args) as c:
        out = c.call("GET", f"/api/v1/deployments/{args.name}/placement")
    _print_decision(args, out)
    return EXIT_OK


def _capacity_forecast(args: argparse.Namespace) -> int:
    with _client(args) as c:
        out = c.call("POST", "/api/v1/capacity/forecast", body=_deployment_body(args))
    _print_decision(args, out)
    return EXIT_OK


def _model_version(s: argparse.ArgumentParser) -> None:
    s.add_argument("name")
    s.add_argument("version")


def _license_flags(s: argparse.ArgumentParser, *, required: bool) -> None:
    terms = s.add_mutually_exclusive_group(required=required)
    terms.add_argument("--spdx", help="SPDX licence id or expression, e.g. Apache-2.0")
    terms.add_argument("--terms-sha256", help="sha256 of custom licence terms")
    terms.add_argument("--terms-file", help="custom licence terms: the file's sha256 is recorded")
    s.add_argument("--accepted-by", help="who accepted the terms (a person or a ticket)")
    s.add_argument(
        "--expires", type=_when, help="when the acceptance expires: 2027-01-31, an ISO time, or unix seconds"
    )


def _license_body(args: argparse.Namespace) -> dict[str, Any] | None:
    terms_sha256 = args.terms_sha256
    if args.terms_file:
        import hashlib

        try:
            terms_sha256 = hashlib.sha256(Path(args.terms_file).read_bytes()).hexdigest()
        except OSError as exc:
            raise ConfigError(f"cannot read --terms-file {args.terms_file}: {exc.strerror}") from None
    if args.spdx is None and terms_sha256 is None:
        if args.accepted_by or args.expires:
            raise ConfigError("--accepted-by and --expires need --spdx, --terms-sha256 or --terms-file")
        return None
    return {
        "spdx_id": args.spdx,
        "terms_sha256": terms_sha256,
        "accepted_by": args.accepted_by,
        "expires_at": args.expires,
    }


_SIZE_UNITS: Final = {
    "": 1,
    "k": 1000,
    "kb": 1000,
    "m": 1000**2,
    "mb": 1000**2,
    "g": 1000**3,
    "gb": 1000**3,
    "t": 1000**4,
    "tb": 1000**4,
    "kib": 1024,
    "mib": 1024**2,
    "gib": 1024**3,
    "tib": 1024**4,
}


def _size(text: str) -> int:
    number = text.strip().rstrip("BbIiKkMmGgTt")
    unit = text.strip()[len(number) :].lower()
    try:
        value = float(number) * _SIZE_UNITS[unit]
    except (ValueError, KeyError):
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (use bytes, or e.g. 512MiB, 8GiB, 7.5GB)") from None
    if value <= 0 or value != int(value):
        raise argparse.ArgumentTypeError(f"a size must be a positive whole number of bytes: {text!r}")
    return int(value)


def _when(text: str) -> float:
    import datetime

    try:
        return float(text)
    except ValueError:
        pass
    try:
        moment = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"not a time: {text!r} (use 2027-01-31, an ISO time or unix seconds)"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    return moment.timestamp()


def _size_text(n: int | None) -> str:
    if n is None:
        return "-"
    for unit, factor in (("TiB", 1024**4), ("GiB", 1024**3), ("MiB", 1024**2), ("KiB", 1024)):
        if n >= factor:
            return f"{n / factor:.1f} {unit}"
    return f"{n} B"


def _runtimes_register(args: argparse.Namespace) -> int:
    body: dict[str, Any] = {"name": args.name, "kind": args.kind, "version": args.version, "image": args.image}
    if args.host_network:
        body["host_network"] = True
    with _client(args) as c:
        out = c.call("POST", "/api/v1/runtimes", body=body)
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
    else:
        print(f"runtime {out['name']} registered: {out['kind']} {out['version']}, {out['image']} ({out['media_type']})")
        print(f"platforms: {_platforms(out)}")
        for warning in out.get("warnings", []):
            print(f"warning: {warning}", file=sys.stderr)
    return EXIT_OK


def _platforms(runtime: dict[str, Any]) -> str:
    """`linux/amd64, linux/arm64/v8`, or `unknown` for records that name none."""
    names = [
        "/".join(p for p in (x["os"], x["architecture"], x.get("variant", "")) if p)
        for x in runtime.get("platforms", [])
    ]
    return ", ".join(names) or "unknown (no node is filtered)"


_RUNTIME_COLUMNS: Final = ("name", "kind", "version", "image", "registered_at")


def _runtimes_list(args: argparse.Namespace) -> int:
    with _client(args) as c:
        out = c.call("GET", "/api/v1/runtimes")
    _emit(args, out, out["runtimes"], _RUNTIME_COLUMNS)
    return EXIT_OK


def _runtimes_show(args: argparse.Namespace) -> int:
    with _client(args) as c:
        out = c.call("GET", f"/api/v1/runtimes/{args.name}")
    row = {**out, "network": "host (opt-in)" if out.get("host_network") else "private", "platforms": _platforms(out)}
    _emit(args, out, [row], (*_RUNTIME_COLUMNS, "network", "platforms", "media_type", "registered_by"))
    return EXIT_OK


def _model_path(args: argparse.Namespace) -> str:
    return f"/api/v1/models/{args.name}/{args.version}"


def _license_text(lic: dict[str, Any] | None) -> str:
    if lic is None:
        return "-"
    terms = lic["spdx_id"] or f"custom terms sha256 {lic['terms_sha256'][:12]}…"
    accepted = f"accepted by {lic['accepted_by']}" if lic["accepted_by"] else "not accepted"
    expires = f", expires {_cell(lic['expires_at'])}" if lic["expires_at"] else ""
    return f"{terms} ({accepted}{expires})"


def _model_row(m: dict[str, Any]) -> dict[str, Any]:
    lic = m["license"]
    return {
        "name": m["name"],
        "version": m["version"],
        "state": m["state"],
        "format": m["format"],
        "size": _size_text(m["artifact"]["size_bytes"]),
        "memory": _size_text(m["memory_bytes"]),
        "license": (lic["spdx_id"] or "custom") if lic else "-",
        "registered_at": m["registered_at"],
    }


_MODEL_COLUMNS: Final = ("name", "version", "state", "format", "size", "memory", "license", "registered_at")


def _print_model(args: argparse.Namespace, out: dict[str, Any], what: str) -> None:
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
    else:
        print(f"model {out['name']}@{out['version']}: {out['state']}{what}")


def _model_body(args: argparse.Namespace, artifact: dict[str, Any]) -> dict[str, Any]:
    return {
        "name": args.name,
        "version": args.version,
        "artifact": artifact,
        "format": args.format,
        "memory_bytes": args.memory,
        "provenance": {"source": args.source, "signer": args.signer},
        "license": _license_body(args),
        "signature": args.signature,
    }


def _manifest_artifact(uri: str, manifest: Any) -> dict[str, Any]:
    """A manifest's artifact for `POST /api/v1/models`: no sha256 or size (the controller computes them)."""
    files = [{"path": f.path, "size_bytes": f.size_bytes, "sha256": f.sha256} for f in manifest.files]
    return {"uri": uri, "files": files, "entry": manifest.entry}


def _read_manifest(path: str) -> Any:
    """A manifest file as `nexa models manifest` prints it; ConfigError naming every problem."""
    from nexa.contracts.manifest import MANIFEST_SCHEMA, ArtifactFile, Manifest, manifest_problems

    try:
        data = json.loads(Path(path).read_bytes())
    except OSError as exc:
        raise ConfigError(f"cannot read --manifest {path}: {exc.strerror}") from None
    except ValueError:
        raise ConfigError(f"--manifest {path} is not valid JSON") from None
    if not isinstance(data, dict) or data.get("schema") != MANIFEST_SCHEMA or not isinstance(data.get("files"), list):
        raise ConfigError(
            f"--manifest {path}: not a manifest (a JSON object with schema {MANIFEST_SCHEMA!r} and files)"
        )
    try:
        files = [ArtifactFile(path=f["path"], size_bytes=f["size_bytes"], sha256=f["sha256"]) for f in data["files"]]
    except (TypeError, KeyError) as exc:
        raise ConfigError(f"--manifest {path}: every file needs path, size_bytes and sha256 ({exc})") from None
    entry = data.get("entry")
    if not isinstance(entry, str):
        raise ConfigError(f"--manifest {path}: entry must be a string")
    bad = [f"{f.path!r}" for f in files if not isinstance(f.path, str) or not isinstance(f.size_bytes, int)]
    problems = [f"files: {b} has a bad path or size" for b in bad] or manifest_problems(files, entry, field="manifest")
    if problems:
        raise ConfigError(f"--manifest {path}: " + "; ".join(problems), problems=tuple(problems))
    return Manifest(files=tuple(files), entry=entry)


def _models_register(args: argparse.Namespace) -> int:
    if args.manifest:
        if args.sha256 or args.size:
            raise ConfigError("--manifest gives the files' sha256 and size: leave out --sha256 and --size")
        artifact = _manifest_artifact(args.uri, _read_manifest(args.manifest))
    elif not args.sha256 or not args.size:
        raise ConfigError("--sha256 and --size are required (or --manifest FILE for a directory's files)")
    else:
        artifact = {"uri": args.uri, "sha256": args.sha256, "size_bytes": args.size}
    with _client(args) as c:
        out = c.call("POST", "/api/v1/models", body=_model_body(args, artifact))
    _print_model(args, out, " (registered; verify it next)")
    return EXIT_OK


def _models_manifest(args: argparse.Namespace) -> int:
    import trio

    from nexa.push import build_manifest

    manifest, _ = trio.run(partial(build_manifest, Path(args.dir), entry=args.entry))
    sys.stdout.write(manifest.canonical_bytes().decode("utf-8") + "\n")
    print(
        f"manifest sha256 {manifest.digest}: {len(manifest.files)} files, {manifest.size_bytes} bytes", file=sys.stderr
    )
    return EXIT_OK


def _models_push(args: argparse.Namespace) -> int:
    import trio

    from nexa.push import PushOptions, push_directory
    from nexa.s3 import load_s3_credentials

    if not args.s3_endpoint:
        raise ConfigError("no S3 endpoint: pass --s3-endpoint or set NEXA_S3_ENDPOINT")
    to = args.to or (f"s3://{args.bucket}/models/{args.name}/{args.version}/" if args.bucket else None)
    if to is None:
        raise ConfigError("where to upload: pass --to s3://bucket/prefix/ or --bucket (or set NEXA_S3_BUCKET)")
    _license_body(args)  # refuse bad licence flags, and a missing API key, before any upload
    if not args.token:
        raise ConfigError("no API key: set NEXA_TOKEN or pass --token")
    credentials = load_s3_credentials(args.s3_credentials_file) if args.s3_credentials_file else None
    options = PushOptions(
        multipart_threshold=args.multipart_threshold, part_size=args.part_size, parallel=args.parallel
    )
    result = trio.run(
        partial(
            push_directory,
            Path(args.dir),
            to,
            endpoint=args.s3_endpoint,
            region=args.s3_region,
            credentials=credentials,
            tls_verify=not args.s3_no_tls_verify,
            entry=args.entry,
            options=options,
            progress_interval_s=args.progress_interval,
        )
    )
    m = result.manifest
    with _client(args) as c:
        out = c.call("POST", "/api/v1/models", body=_model_body(args, _manifest_artifact(result.prefix_uri, m)))
    if args.json:
        summary = {
            "model": out,
            "manifest_uri": result.manifest_uri,
            "uploaded": list(result.uploaded),
            "skipped": list(result.skipped),
            "multipart": result.multipart,
        }
        print(json.dumps(summary, indent=2, sort_keys=True))
        return EXIT_OK
    a = out["artifact"]
    print(f"model {out['name']}@{out['version']}: {out['state']} (registered; verify it next)")
    print(f"manifest     {a['sha256']} ({result.manifest_uri})")
    print(f"files        {len(m.files)}, {_size_text(a['size_bytes'])} in all; entry {m.entry}")
    print(f"uploaded     {len(result.uploaded)}; skipped {len(result.skipped)} (already in the store)")
    return EXIT_OK


def _models_license(args: argparse.Namespace) -> int:
    with _client(args) as c:
        out = c.call("POST", f"{_model_path(args)}/license", body=_license_body(args))
    _print_model(args, out, f"; licence {_license_text(out['license'])}")
    return EXIT_OK


def _models_verify(args: argparse.Namespace) -> int:
    body = {"signature": args.signature} if args.signature else None
    with _client(args) as c:
        out = c.call("POST", f"{_model_path(args)}/verify", body=body)
    v = out["verification"]
    signed = f", signature by key {v['signature_key']}" if v["signature_key"] else ""
    _print_model(args, out, f" (sha256 {v['sha256']}, {v['size_bytes']} bytes in {v['seconds']:.2f} s{signed})")
    return EXIT_OK


def _metrics(items: list[str]) -> dict[str, float]:
    metrics = {}
    for item in items:
        name, sep, value = item.partition("=")
        try:
            metrics[name.strip()] = float(value)
        except ValueError:
            raise ConfigError(f"--metric {item!r}: expected NAME=NUMBER") from None
        if not sep:
            raise ConfigError(f"--metric {item!r}: expected NAME=NUMBER")
    return metrics


def _models_evaluate(args: argparse.Namespace) -> int:
    body = {"suite": args.suite, "metrics": _metrics(args.metric), "passed": args.passed, "evidence": args.evidence}
    with _client(args) as c:
        out = c.call("POST", f"{_model_path(args)}/evaluations", body=body)
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
    else:
        e, m = out["evaluation"], out["model"]
        verdict = "passed" if e["passed"] else "failed"
        print(f"evaluation {e['id']} ({e['suite']}) {verdict}; model {m['name']}@{m['version']} is {m['state']}")
    return EXIT_OK


def _models_action(args: argparse.Namespace) -> int:
    with _client(args) as c:
        out = c.call("POST", f"{_model_path(args)}/{args.verb}")
    _print_model(args, out, "")
    return EXIT_OK


def _models_list(args: argparse.Namespace) -> int:
    params = {k: v for k, v in (("name", args.name), ("state", args.state)) if v}
    with _client(args) as c:
        out = c.call("GET", "/api/v1/models", params=params)
    _emit(args, out, [_model_row(m) for m in out["models"]], _MODEL_COLUMNS)
    return EXIT_OK


def _models_show(args: argparse.Namespace) -> int:
    with _client(args) as c:
        out = c.call("GET", _model_path(args))
    if args.json:
        print(json.dumps(out, indent=2, sort_keys=True))
        return EXIT_OK
    m, v = out["model"], out["model"]["verification"]
    a = m["artifact"]
    lines = [
        f"model        {m['name']}@{m['version']}",
        f"state        {m['state']} since {_cell(m['state_changed_at'])}",
        f"artifact     {a['uri']} ({m['format']}, {_size_text(a['size_bytes'])})",
        f"sha256       {a['sha256']}" + (" (the manifest's digest)" if a["files"] else ""),
    ]
    if a["files"]:
        lines.append(f"entry        {a['entry']} (of {len(a['files'])} files)")
        lines += [f"  file       {f['path']}  {_size_text(f['size_bytes'])}  {f['sha256'][:16]}…" for f in a["files"]]
    lines += [
        f"memory       {_size_text(m['memory_bytes'])}",
        f"licence      {_license_text(m['license'])}",
        f"provenance   {m['provenance']['source']}"
        + (f", signed by {m['provenance']['signer']}" if m["provenance"]["signer"] else ""),
        "verified     " + (f"{_cell(v['verified_at'])} ({v['size_bytes']} bytes, {v['seconds']:.2f} s)" if v else "no"),
        f"aliases      {', '.join(out['aliases']) or '-'}",
    ]
    for e in out["evaluations"]:
        metrics = ", ".join(f"{k}={val:g}" for k, val in sorted(e["metrics"].items()))
        verdict = "passed" if e["passed"] else "failed"
        lines.append(f"evaluation   {e['id']} {e['suite']} {verdict} {_cell(e['recorded_at'])} {metrics}".rstrip())
    print("\n".join(lines))
    return EXIT_OK


def _ref(ref: dict[str, Any] | None) -> str:
    return "-" if ref is None else f"{ref['model']}@{ref['version']}"


def _alias_row(a: dict[str, Any]) -> dict[str, Any]:
    return {
        "alias": a["name"],
        "target": _ref(a["target"]),
        "generation": a["generation"],
        "updated_at": a["updated_at"],
    }


def _aliases_list(args: argparse.Namespace) -> int:
    with _client(args) as c:
        out = c.call("GET", "/api/v1/aliases")
    _emit(args, out, [_alias_row(a) for a in out["aliases"]], ("alias", "target", "generation", "updated_at"))
    return EXIT_OK


def _print_receipt(args: argparse.Namespace, r: dict[str, Any]) -> None:
    if args.json:
        print(json.dumps(r, indent=2, sort_keys=True))
    else:
        print(
            f"alias {r['alias']}: generation {r['generation']}, {_ref(r['from'])} -> {_ref(r['to'])} "
            f"({r['action']}; audit event {r['event_id']})"
        )


def _aliases_promote(args: argparse.Namespace) -> int:
    with _client(args) as c:
        out = c.call(
            "POST", f"/api/v1/aliases/{args.alias}/promote", body={"model": args.model, "version": args.version}
        )
    _print_receipt(args, out)
    return EXIT_OK


def _aliases_rollback(args: argparse.Namespace) -> int:
    with _client(args) as c:
        out = c.call("POST", f"/api/v1/aliases/{args.alias}/rollback")
    _print_receipt(args, out)
    return EXIT_OK


def _aliases_history(args: argparse.Namespace) -> int:
    with _client(args) as c:
        out = c.call("GET", f"/api/v1/aliases/{args.alias}")
    rows = [
        {
            "generation": r["generation"],
            "action": r["action"],
            "from": _ref(r["from"]),
            "to": _ref(r["to"]),
            "at": r["at"],
            "actor": r["actor"],
            "event": r["event_id"],
        }
        for r in out["history"]
    ]
    if not args.json:
        print(
            f"alias {out['alias']['name']} -> {_ref(out['alias']['target'])} (generation {out['alias']['generation']})"
        )
    _emit(args, out, rows, ("generation", "action", "from", "to", "at", "actor", "event"))
    return EXIT_OK


# ---- quotas, usage, workloads and receipts -------------------------------------------------------

_QUOTA_FLAGS: Final = (
    ("concurrent", "concurrent_requests", "requests in flight at once"),
    ("rpm", "requests_per_minute", "requests per minute"),
    ("tpm", "tokens_per_minute", "tokens per minute (prompt + completion)"),
    ("tpd", "tokens_per_day", "tokens per UTC day"),
)


def _gateway_commands(sub: Any, common: argparse.ArgumentParser) -> None:
    quotas = sub.add_parser("quotas", help="per-tenant limits (admin)").add_subparsers(metavar="VERB", required=True)
    s = quotas.add_parser("set", parents=[common], help="replace a tenant's limits (a limit left out: none)")
    s.add_argument("tenant")
    for flag, _, text in _QUOTA_FLAGS:
        s.add_argument(f"--{flag}", type=int, default=None, help=text)
    s.set_defaults(handler=_quotas_set)
    s = quotas.add_parser("show", parents=[common], help="limits and current use: one tenant, or all with limits")
    s.add_argument("tenant", nargs="?")
    s.set_defaults(handler=_quotas_show)

    s = sub.add_parser("usage", parents=[common], help="usage by tenant, model and UTC day (audit, admin)")
    s.add_argument("--since", type=_when, help="2027-01-31 (UTC), an ISO time or Unix seconds; default 30 days ago")
    s.add_argument("--until", type=_when, help="the same forms; default now")
    s.add_argument("--tenant")
    s.add_argument("--model")
    s.add_argument("--csv", action="store_true", help="print CSV (the controller's export)")
    s.set_defaults(handler=_usage)

    workloads = sub.add_parser("workloads", help="canonical workloads of your tenant (inference)").add_subparsers(
        metavar="VERB", required=True
    )
    for verb, text in (("status", "state"), ("cancel", "cancel it"), ("receipt", "its signed receipt (JSON)")):
        s = workloads.add_parser(verb, parents=[common], help=text)
        s.add_argument("workload_id")
        s.set_defaults(handler=_workloads_action, verb=verb)

    receipts = sub.add_parser("receipts", help="signed workload receipts").add_subparsers(metavar="VERB", required=True)
    s = receipts.add_parser("verify", parents=[common], help="check a receipt file's signature (exit 1 if bad)")
    s.add_argument("file")
    s.add_argument(
        "--public-key",
        help="the controller's receipt key (base64, or @FILE); offline. Without it, fetched from --url",
    )
    s.set_defaults(handler=_receipts_verify)
    s = receipts.add_parser("key", parents=[common], help="print the controller's receipt-signing public key")
    s.set_defaults(handler=_receipts_key)


def _quotas_set(args: argparse.Namespace) -> int:
    body = {field: getattr(args, flag) for flag, field, _ in _QUOTA_FLAGS}
    with _client(args) as c:
        out = c.call("PUT", f"/api/v1/quotas/{args.tenant}", body=body)
    _emit(args, out, [_quota_row(out)], _QUOTA_COLUMNS)
    return EXIT_OK


_QUOTA_COLUMNS: Final = ("tenant", "concurrent", "rpm", "tpm", "tpd", "in_flight", "req_1m", "tok_1m", "tok_today")


def _quota_row(q: dict[str, Any]) -> dict[str, Any]:
    limits, use = q["limits"], q["use"]
    return {
        "tenant": q["tenant"],
        **{flag: limits[field] for flag, field, _ in _QUOTA_FLAGS},
        "in_flight": use["concurrent_requests"],
        "req_1m": use["requests_last_minute"],
        "tok_1m": use["tokens_last_minute"],
        "tok_today": use["tokens_today"],
    }


def _quotas_show(args: argparse.Namespace) -> int:
    with _client(args) as c:
        if args.tenant:
            out = c.call("GET", f"/api/v1/quotas/{args.tenant}")
            rows = [_quota_row(out)]
        else:
            out = c.call("GET", "/api/v1/quotas")
            rows = [_quota_row(q) for q in out["quotas"]]
    _emit(args, out, rows, _QUOTA_COLUMNS)
    return EXIT_OK


def _usage(args: argparse.Namespace) -> int:
    params = {
        k: v
        for k, v in {
            "since": None if args.since is None else str(args.since),
            "until": None if args.until is None else str(args.until),
            "tenant": args.tenant,
            "model": args.model,
        }.items()
        if v is not None
    }
    with _client(args) as c:
        if args.csv:
            sys.stdout.write(c.text("GET", "/api/v1/usage", params={**params, "format": "csv"}))
            return EXIT_OK
        out = c.call("GET", "/api/v1/usage", params=params)
    columns = ("day", "tenant", "model", "requests", "errors", "prompt_tokens", "completion_tokens")
    _emit(args, out, out["rows"], columns)
    return EXIT_OK


def _workloads_action(args: argparse.Namespace) -> int:
    path = f"/api/v1/workloads/{args.workload_id}"
    with _client(args) as c:
        if args.verb == "status":
            out = c.call("GET", path)
        elif args.verb == "cancel":
            out = c.call("POST", path + "/cancel")
        else:
            out = c.call("GET", path + "/receipt")
            print(json.dumps(out, indent=2, sort_keys=True))
            return EXIT_OK
    row = {k: out.get(k) for k in ("workload_id", "state", "model", "priority", "error", "accepted_at", "finished_at")}
    _emit(args, out, [row], list(row))
    return EXIT_OK


def _receipts_verify(args: argparse.Namespace) -> int:
    from nexa import security
    from nexa.contracts import codec
    from nexa.contracts.gateway import SignedReceipt
    from nexa.errors import BadSignature

    signed = codec.loads(codec.api, _read_file(args.file), SignedReceipt)

    def fetch() -> str:
        with _client(args) as c:
            return str(c.call("GET", "/api/v1/receipts/public-key")["public_key"])

    pub = _public_key(args.public_key, fetch)
    try:
        security.verify_receipt(pub, signed)
    except BadSignature as exc:
        print(f"receipt {signed.receipt.receipt_id}: INVALID ({exc.message})")
        return EXIT_FAILED
    r = signed.receipt
    print(
        f"receipt {r.receipt_id}: valid — workload {r.workload_id}, {r.state.value}, "
        f"{r.model}@{r.model_version}, {r.prompt_tokens}+{r.completion_tokens} tokens, key {pub.fingerprint}"
    )
    return EXIT_OK


def _receipts_key(args: argparse.Namespace) -> int:
    with _client(args) as c:
        print(c.call("GET", "/api/v1/receipts/public-key")["public_key"])
    return EXIT_OK


def _read_file(path: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read {path}: {exc.strerror}") from None


def _public_key(given: str | None, fetch: Callable[[], str]) -> PublicKey:
    """`--public-key B64|@FILE`, or the controller's own key (`fetch`) when none is given."""
    from nexa.security import PublicKey

    if given is None:
        given = fetch()
    elif given.startswith("@"):
        given = _read_file(given[1:]).decode("ascii", "replace").strip()
    return PublicKey.from_b64(given)
