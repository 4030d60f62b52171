"""The controller's configuration (`nexa control --config`): `ControlConfig` and its sections."""

from __future__ import annotations

import enum
import math
import re
import urllib.parse
from typing import Final

import attrs

from nexa.config.common import (
    Bytes,
    HostPort,
    LogConfig,
    PublicKeyB64,
    Seconds,
    check_networks,
    parse_host_port,
    positive_rate,
    zmq_endpoint,
)

#: The most gateway worker processes `[http] workers` runs.
MAX_WORKERS = 64


class TlsVersion(enum.StrEnum):
    """The oldest TLS version `nexa control` accepts (`http.tls_min_version`)."""

    TLS_1_2 = "1.2"
    TLS_1_3 = "1.3"


@attrs.frozen(kw_only=True)
class HttpConfig:
    """The controller's HTTP listener."""

    listen: HostPort = HostPort("127.0.0.1:8470")
    #: Largest request body accepted; larger ones get 413 before they are read.
    max_body_bytes: Bytes = Bytes(1_048_576)
    #: How long in-flight requests may run on after SIGTERM before they are cancelled.
    graceful_timeout_s: Seconds = Seconds(10.0)
    #: Longest time a client may take to send its request line and headers.
    keep_alive_timeout_s: Seconds = Seconds(5.0)
    #: Longest time a client may take to send a request's body once its head arrived; past it the
    #: request is answered 408 (`request_timeout`) and its connection closed.
    body_timeout_s: Seconds = Seconds(60.0)
    #: Peers (addresses or networks, e.g. `["127.0.0.1"]`) whose `X-Forwarded-Proto: https` is
    #: believed: a TLS-terminating ingress there makes the console cookie `Secure`. The header is
    #: ignored from every other peer. Empty: only a direct https connection counts.
    trusted_proxies: tuple[str, ...] = attrs.field(default=(), validator=lambda _i, _a, v: check_networks(v))
    #: Share `listen`'s port with the other `nexa control` processes ("gateway workers") on this
    #: host: the socket is bound with SO_REUSEPORT and the kernel spreads new connections over the
    #: workers, so the gateway uses more than one core. Each worker is a controller of its own on
    #: the shared store (`[store] url`, required), with its own `[cluster] controller_id`,
    #: `[channel] listen` and an address of its own in `extra_listen` that `[cluster] address`
    #: names (`check_workers`). Off: the port is this process's alone.
    reuse_port: bool = False
    #: More HOST:PORT addresses this controller serves the same API on, never shared: with
    #: `reuse_port`, the worker's own address, where other controllers forward writes to it when
    #: it leads and where Prometheus scrapes its /metrics.
    extra_listen: tuple[HostPort, ...] = attrs.field(
        default=(), validator=lambda _i, _a, v: [parse_host_port(x) for x in v]
    )
    #: Serve HTTPS with this certificate (PEM: the server's certificate first, then its chain) and
    #: its private key (PEM, unencrypted, mode 0600): both set or neither (plain http, for an
    #: ingress that terminates TLS). Read at start (a bad or mismatched pair is refused there) and
    #: again when either file changes: new connections get the new certificate, open ones keep theirs.
    tls_cert_file: str = ""
    tls_key_file: str = ""
    #: The oldest TLS version served: "1.2" or "1.3".
    tls_min_version: TlsVersion = TlsVersion.TLS_1_2
    #: Gateway worker processes `nexa control` runs on this host with the embedded SQLite store
    #: (`control.cluster.workers`), sharing `listen`'s port (SO_REUSEPORT) and the state dir's
    #: database: the one holding the leader's lease makes the leader-only writes and the node
    #: channel's control work, the others serve inference and reads and forward management writes
    #: to it over loopback. Worker i serves the node channel on `[channel] listen`'s port + 2i.
    #: 1: one process, as before (`check_worker_processes`).
    workers: int = attrs.field(default=1, validator=[attrs.validators.ge(1), attrs.validators.le(MAX_WORKERS)])

    def __attrs_post_init__(self) -> None:
        if bool(self.tls_cert_file) != bool(self.tls_key_file):
            given, missing = (
                ("tls_cert_file", "tls_key_file") if self.tls_cert_file else ("tls_key_file", "tls_cert_file")
            )
            raise ValueError(
                f"http.{given} is set but http.{missing} is not: give both the certificate and its key to serve "
                "https, or neither (plain http behind a TLS-terminating ingress)"
            )

    def check_workers(self, store: StoreConfig, cluster: ClusterConfig) -> None:
        """With `reuse_port`, what several workers on one port need; ValueError naming the key.

        The shared port reaches whichever worker the kernel picks, so nothing that must reach one
        controller in particular may point at it: its id would be every worker's default, and a
        follower forwards management writes to the leader's own `[cluster] address`."""
        if not self.reuse_port:
            return
        _, port = parse_host_port(self.listen)
        own_ports = {parse_host_port(extra)[1] for extra in self.extra_listen}
        try:
            address_port = urllib.parse.urlsplit(cluster.address).port if cluster.address else None
        except ValueError:
            address_port = None  # not a URL with a port: refused below
        if not store.url:
            problem = "needs a shared store: set [store] url to a postgresql:// URL (SQLite has one controller)"
        elif port == 0:
            problem = "needs a fixed port in http.listen for the workers to share (not 0)"
        elif not cluster.controller_id:
            problem = "needs [cluster] controller_id set, one name per worker (the default is the same for all)"
        elif not own_ports:
            problem = "needs an address of this worker's own in [http] extra_listen, e.g. 127.0.0.1:8481"
        elif address_port not in own_ports:
            problem = (
                "needs [cluster] address set to this worker's own URL with a port of [http] extra_listen, "
                "e.g. http://ctl-1.example.internal:8481: forwarded writes must reach the leader, not the shared port"
            )
        else:
            return
        raise ValueError(f"http.reuse_port {problem}")

    def check_worker_processes(self, store: StoreConfig, cluster: ClusterConfig, channel: ChannelConfig) -> None:
        """With `workers` above 1, what one supervisor running them needs; ValueError naming the key.
        Each worker's own address, id suffix and channel ports are derived (`control.cluster.workers`),
        so nothing that names one process may be set."""
        if self.workers == 1:
            return
        _, port = parse_host_port(self.listen)
        if store.url:
            problem = (
                "runs workers on the embedded SQLite store: with [store] url, run one `nexa control` per worker "
                "with [http] reuse_port instead (units/nexa-control@.service), or set workers = 1"
            )
        elif self.reuse_port or self.extra_listen:
            problem = "sets reuse_port and each worker's own address itself: remove [http] reuse_port and extra_listen"
        elif port == 0:
            problem = "needs a fixed port in http.listen for the workers to share (not 0)"
        elif channel.listen.endswith(":*"):
            problem = "needs a fixed port in [channel] listen: worker i serves nodes on its port + 2i (not *)"
        elif cluster.address:
            problem = "chooses each worker's own address itself: remove [cluster] address"
        else:
            return
        raise ValueError(f"http.workers = {self.workers} {problem}")


@attrs.frozen(kw_only=True)
class BootstrapConfig:
    """How the first admin key comes to be."""

    #: If set, the first start stores the hash of the key read from this file instead of
    #: generating one (the file must hold one key in nexa's format, mode 0600 recommended).
    admin_key_file: str | None = None


@attrs.frozen(kw_only=True)
class BackupConfig:
    """Backups of the controller's state (`nexa backup`, `POST /api/v1/backups`, the schedule)."""

    #: Where backups are written; empty: `<state_dir>/backups` (mount another disk there, or copy them off).
    dir: str = ""
    #: Seconds between scheduled backups; 0 (the default) schedules none.
    interval_s: float = attrs.field(default=0.0, validator=[attrs.validators.ge(0.0), attrs.validators.lt(math.inf)])
    #: The newest this many backups in `dir` are kept; older ones are deleted after each backup.
    keep: int = attrs.field(default=7, validator=attrs.validators.ge(1))
    #: File holding the 32-byte backup key as base64 or hex (mode 0600; `nexa keygen --backup --out FILE`).
    #: Empty: the key is read from $NEXA_BACKUP_KEY; neither: backups are refused (backup_not_configured).
    key_file: str = ""


@attrs.frozen(kw_only=True)
class ChannelConfig:
    """The ZeroMQ ROUTER nodes dial (CurveZMQ; nodes listen on nothing)."""

    #: zmq endpoint to bind, e.g. `tcp://0.0.0.0:8471` on the management network; a bare
    #: `HOST:PORT` (the syntax of `http.listen`) means `tcp://HOST:PORT`.
    listen: str = attrs.field(default="tcp://127.0.0.1:8471", converter=zmq_endpoint)
    #: The endpoint handed to nodes at enrollment; empty means the bound endpoint.
    advertise: str = attrs.field(default="", converter=zmq_endpoint)
    #: The second endpoint: after `nexa keys rotate-controller` the new Curve key is served there
    #: beside the current one until `[nodes] key_overlap_s` ends; then the old key's endpoint
    #: refuses every node and the two swap roles at the next rotation. Empty: `listen`'s port + 1.
    rotation_listen: str = attrs.field(default="", converter=zmq_endpoint)
    #: What nodes are told to dial for `rotation_listen`; empty: `advertise`'s port + 1 where
    #: `advertise` is set, else the bound endpoint.
    rotation_advertise: str = attrs.field(default="", converter=zmq_endpoint)
    #: Largest data chunk a node may send. Keep it at least the nodes' `relay.max_chunk_bytes`:
    #: a zmq frame above this plus `channel.links.MESSAGE_HEADROOM_BYTES` (64 KiB) costs the node its
    #: connection (zmq MAXMSGSIZE), and a stream buffers at most `gateway.stream_window_chunks`
    #: times this many bytes.
    max_chunk_bytes: Bytes = Bytes(65536)
    #: Messages zmq queues per node connection before it stops reading from that node (RCVHWM).
    receive_hwm: int = attrs.field(default=64, validator=attrs.validators.ge(1))
    #: Signed messages (hello, heartbeat, ack) one node may send per second, and in a burst; the
    #: excess is dropped before it is verified and counted as `rate_limited`.
    signed_messages_per_s: float = attrs.field(default=20.0, validator=lambda _i, a, v: positive_rate(a, v))
    signed_messages_burst: int = attrs.field(default=40, validator=attrs.validators.ge(1))
    #: Store writes one node's messages may cause (inventory saves, acknowledgement records) per
    #: second, and in a burst. Above it the newest state is kept in memory and written with a later
    #: message (counted in `nexa_node_store_writes_deferred_total`).
    node_store_writes_per_s: float = attrs.field(default=0.5, validator=lambda _i, a, v: positive_rate(a, v))
    node_store_writes_burst: int = attrs.field(default=10, validator=attrs.validators.ge(1))
    #: Wake-up moderation of the channel's receive side, in seconds (0: off), while requests are
    #: relayed on it: once a wake-up received node messages, the next comes this long after it and
    #: takes all that arrived meanwhile, so one wake-up (most of what a message costs) serves many.
    #: A message after a quiet spell is taken at once; under load each waits at most this long.
    gather_s: float = attrs.field(default=0.002, validator=[attrs.validators.ge(0.0), attrs.validators.le(0.1)])
    #: The same while no request is relayed: the fleet's liveness beats and states, which no one
    #: waits for (a request sent wakes the channel at once, and its answer is taken at once).
    idle_gather_s: float = attrs.field(default=0.025, validator=[attrs.validators.ge(0.0), attrs.validators.le(1.0)])

    def endpoint(self, slot: int) -> tuple[str, str]:
        """(bind, advertise) of endpoint `slot`: 0 `listen`, 1 `rotation_listen` ("" advertise: the bound)."""
        if slot == 0:
            return self.listen, self.advertise
        advertise = self.rotation_advertise or (_next_port(self.advertise) if self.advertise else "")
        return self.rotation_listen or _next_port(self.listen), advertise


def _next_port(endpoint: str) -> str:
    host, _, port = endpoint.rpartition(":")
    return endpoint if port == "*" else f"{host}:{int(port) + 1}"


@attrs.frozen(kw_only=True)
class NodesConfig:
    """Liveness and fencing of the fleet."""

    #: A node with no good heartbeat for this long becomes Unreachable.
    lease_s: Seconds = Seconds(3.0)
    #: Heartbeat timestamps further than this from the controller's clock are refused.
    max_clock_skew_s: Seconds = Seconds(30.0)
    #: How long a signed assignment set stays valid on a node without renewal.
    assignment_lease_s: Seconds = Seconds(60.0)
    #: The longest lifetime an enrollment token may be given.
    max_token_ttl_s: Seconds = Seconds(86400.0)
    #: A node Unreachable for this long (after its lease lapsed) has its replicas placed elsewhere.
    replace_after_s: Seconds = Seconds(30.0)
    #: After `nexa keys rotate-controller`, how long nodes still accept the controller's previous
    #: signing key beside the new one (a node offline all that time must be enrolled again: it is
    #: marked as needing re-enrollment when it says hello pinning only the old key, sent nothing).
    key_overlap_s: Seconds = Seconds(86400.0)


@attrs.frozen(kw_only=True)
class PlacementConfig:
    """How placement counts a node's resources."""

    #: On a unified-memory node (a DGX Spark's GB10: the GPU and the host share 128 GB), the
    #: memory left to the host: replicas on one such node reserve together at most its pool less
    #: this. The OS, the node agent, the container engine and each runtime's own host processes
    #: (the API server, the tokenizer, CUDA's own context) live in the same pool and are not
    #: reserved by any replica; and a runtime given a share of the pool refuses to start when
    #: less than that share is free. 8 GiB covers DGX OS with Docker and the agent at rest with a
    #: margin; raise it on nodes that run more beside their replicas.
    unified_host_headroom_bytes: Bytes = Bytes(8 * 2**30)
    #: Place a runtime only on nodes whose (architecture, GPU model) its image (by digest) passed
    #: a qualification on (`nexa runtimes qualify RUNTIME --node NODE`); a node that did not fails
    #: placement's `qualified` filter, which names the pair. Off: no qualification is needed.
    require_qualified: bool = False


@attrs.frozen(kw_only=True)
class OciConfig:
    """How the controller checks runtime images in their OCI registry (named by each image reference)."""

    #: Verify registries' TLS certificates. Off: a registry on a loopback address (localhost,
    #: 127.0.0.0/8, ::1) is reached over plain HTTP and any other over HTTPS without certificate
    #: checks. Turn it off only for a test registry.
    tls_verify: bool = True
    #: Optional JSON file {"auths": {"HOST[:PORT]": {"username": …, "password": …, "token_realms": […]}}}
    #: (`oci.load_registry_credentials`); an entry goes only to its registry. Never logged.
    credentials_file: str = ""


@attrs.frozen(kw_only=True)
class ArtifactStoreConfig:
    """The S3-compatible store the controller streams model artifacts from to verify them."""

    #: e.g. https://s3.internal:8333; path-style requests. Empty: models cannot be verified.
    s3_endpoint: str = ""
    s3_region: str = "us-east-1"
    #: JSON {"access_key_id": …, "secret_access_key": …} or an AWS shared-credentials (INI) file;
    #: re-read when it changes, never logged. Empty: AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, else anonymous.
    s3_credentials_file: str = ""
    #: The profile (section) of an INI credentials file.
    s3_profile: str = "default"
    s3_tls_verify: bool = True
    #: Where a model's artifact may be, as `bucket` or `bucket/prefix/` (e.g. `["nexa-models/models/"]`):
    #: a model naming any other object is refused at registration and verification, before the store
    #: is asked, so no answer quotes what lies outside. Empty: any object of the store.
    allowed_prefixes: tuple[str, ...] = attrs.field(default=(), validator=lambda _i, _a, v: _check_prefixes(v))

    def artifact_problem(self, uri: str) -> str | None:
        """Why an artifact at `uri` (`s3://bucket/key`) is outside `allowed_prefixes`, or None."""
        if not self.allowed_prefixes:
            return None
        where = uri.removeprefix("s3://")
        allowed = tuple(p if "/" in p else f"{p}/" for p in self.allowed_prefixes)  # a bucket: all of it
        if uri.startswith("s3://") and "/../" not in f"/{where}/" and where.startswith(allowed):
            return None
        return f"artifact.uri: outside [artifacts] allowed_prefixes ({', '.join(self.allowed_prefixes)})"


def _check_prefixes(prefixes: tuple[str, ...]) -> None:
    for prefix in prefixes:
        bucket = prefix.split("/", 1)[0]
        if prefix.startswith("s3://") or not bucket or ".." in prefix.split("/"):
            raise ValueError(f"allowed_prefixes: {prefix!r} is not `bucket` or `bucket/prefix/` (no s3://, no '..')")


@attrs.frozen(kw_only=True)
class ApprovalRequirement:
    """One measured result a model version needs before it is approved (`[models] approval_requires`)."""

    #: The evaluation suite (`nexa eval register ... --name`).
    suite: str
    #: The metric whose pass rate is checked; "" checks the run's own verdict (every metric passed).
    metric: str = ""
    #: The least pass rate of `metric` (0 to 1).
    min: float = attrs.field(default=1.0, validator=[attrs.validators.ge(0.0), attrs.validators.le(1.0)])


@attrs.frozen(kw_only=True)
class ModelsConfig:
    """The model registry's verification policy."""

    #: Ed25519 public key (base64 of the raw 32 bytes). When set, verifying a model also requires
    #: a detached Ed25519 signature (base64) by this key over the artifact's 32-byte sha256 digest.
    trusted_signing_key: PublicKeyB64 = PublicKeyB64("")
    #: Longest time one verification (streaming and hashing the whole artifact) may take.
    verify_timeout_s: Seconds = Seconds(3600.0)
    #: Measured results (`nexa eval run`) a version needs before `models approve`: for each, the
    #: newest measured evaluation of the version by that suite must pass (409 approval_requirements).
    #: A version not yet approved is measured on an evaluation replica (`nexa eval run SUITE --model
    #: NAME@VERSION`), which clients cannot reach.
    approval_requires: tuple[ApprovalRequirement, ...] = ()


class PriorityOverGrant(enum.StrEnum):
    """What the gateway does with a request asking for a priority class its key is not granted."""

    #: 403 priority_not_granted.
    REFUSE = "refuse"
    #: Served at the highest class the key is granted below the one asked for (else its lowest).
    LOWER = "lower"


#: `gateway.max_upload_bytes` at most: what one channel message to a node holds besides its head.
MAX_UPLOAD_BYTES: Final = Bytes(15 * 1024 * 1024)


@attrs.frozen(kw_only=True)
class GatewayConfig:
    """The inference gateway: admission, routing, relay, batching and metering."""

    #: Requests that may wait for a slot per model (all priorities together); beyond it: 429 queue_full.
    queue_depth: int = attrs.field(default=1024, validator=attrs.validators.ge(1))
    #: The share of a model's queue (0 < share <= 1) one tenant may hold while others wait: when the
    #: queue is full, a request of another tenant takes the newest place of a tenant above its share
    #: (that waiter gets 429 queue_full) instead of being refused itself. 1 turns this off.
    queue_tenant_share: float = attrs.field(default=0.5, validator=[attrs.validators.gt(0.0), attrs.validators.le(1.0)])
    #: Completion tokens reserved against the tenant's token quotas for a request that sets no
    #: `max_tokens` (or `max_completion_tokens`); settled to the real count when it finishes.
    reserve_completion_tokens: int = attrs.field(default=1024, validator=attrs.validators.ge(1))
    #: Requests one replica is given at once; more wait in the model's queue.
    max_inflight_per_replica: int = attrs.field(default=64, validator=attrs.validators.ge(1))
    #: Deadline of a request that does not name one (queue time included).
    default_deadline_s: Seconds = Seconds(300.0)
    #: The longest deadline a request may ask for.
    max_deadline_s: Seconds = Seconds(3600.0)
    #: Further attempts after a failure before the first output byte: on a Ready replica not tried
    #: yet while there is one, else on those Ready by then after `retry_backoff_s` (doubling each
    #: round), never past the request's deadline.
    retries: int = attrs.field(default=2, validator=attrs.validators.ge(0))
    #: The pause before trying the replicas again once every one failed a request before output.
    retry_backoff_s: Seconds = attrs.field(default=Seconds(0.2), validator=attrs.validators.gt(Seconds(0.0)))
    #: Send requests with the same prompt prefix to the same replica while it is not overloaded.
    prefix_affinity: bool = True
    #: How many leading characters of the prompt make its prefix.
    affinity_prefix_chars: int = attrs.field(default=256, validator=attrs.validators.ge(1))
    #: Affinity yields when its replica has more than this many requests beyond the least loaded one.
    affinity_slack: int = attrs.field(default=8, validator=attrs.validators.ge(0))
    #: A replica's runtime load report (queue, KV cache) older than this is ignored by the router,
    #: which then counts only the gateway's own requests in flight to it.
    load_max_age_s: Seconds = attrs.field(default=Seconds(15.0), validator=attrs.validators.gt(Seconds(0.0)))
    #: Stream chunks a node may send ahead of what the client has read (per request).
    stream_window_chunks: int = attrs.field(default=32, validator=attrs.validators.ge(1))
    #: Embedding requests to one deployment arriving within this window are sent as one call.
    embedding_batch_window_s: Seconds = Seconds(0.005)
    embedding_max_batch: int = attrs.field(default=64, validator=attrs.validators.ge(1))
    #: Usage records are written to the store at least this often (what a crash can lose at most).
    metering_flush_s: Seconds = Seconds(1.0)
    #: Usage records older than this are deleted (hourly); usage reports reach back this far.
    usage_retention_s: Seconds = Seconds(400 * 86400.0)
    #: Finished workloads (their idempotency keys and receipts) older than this are deleted (hourly).
    workload_retention_s: Seconds = Seconds(90 * 86400.0)
    #: A request asking for a priority class its key is not granted (`nexa keys create --priorities`):
    #: `refuse` (403 priority_not_granted) or `lower` (served at a class the key is granted).
    priority_over_grant: PriorityOverGrant = PriorityOverGrant.REFUSE
    #: The largest media upload (`/v1/audio/transcriptions`, `…/translations`), in bytes: held in
    #: memory (never on disk) and sent to the node in one channel message, so at most 15 MiB (the
    #: node's 16 MiB message limit less room for the rest). Larger: 413 payload_too_large.
    max_upload_bytes: Bytes = attrs.field(
        default=Bytes(15 * 1024 * 1024),
        validator=[attrs.validators.ge(Bytes(1)), attrs.validators.le(Bytes(15 * 1024 * 1024))],
    )


@attrs.frozen(kw_only=True)
class ClusterConfig:
    """Several controllers on one (PostgreSQL) store: the leader's lease. The embedded SQLite store
    has one controller, always the leader, and reads none of this but the defaults' checks."""

    #: A leader that has not renewed its lease for this long is replaced by another controller.
    lease_s: Seconds = Seconds(5.0)
    #: How often the leader renews its lease (and followers try to take an expired one). Below
    #: `lease_s / 2`: the leader stops acting as one `lease_s - renew_s` after its last renewal.
    renew_s: Seconds = Seconds(1.0)
    #: This controller's name in the cluster; empty: `<hostname>:<http port>` (stable across restarts).
    controller_id: str = ""
    #: The base URL other controllers forward API writes to; empty: `http://<http.listen>` (`https://`
    #: when `[http] tls_cert_file` is set).
    address: str = ""
    #: How often each controller looks at the audit head for changes another one made, and re-reads
    #: what they touched (`control.cluster.follow`): a write shows on every controller within about this long.
    refresh_s: Seconds = attrs.field(default=Seconds(0.25), validator=attrs.validators.gt(Seconds(0.0)))
    #: The CA file (PEM) that verifies the other controllers' https certificates when a follower
    #: forwards writes to the leader; empty: the system's CA store.
    peer_ca_file: str = ""
    #: Forward writes over plain http to a leader on another host (its `address` is http://). Off:
    #: refused (`plain_http_peer`, logged): API keys and bodies would cross the network in clear.
    #: Loopback addresses are always allowed.
    allow_plain_http_peers: bool = False

    def __attrs_post_init__(self) -> None:
        # ValueError, as the field validators raise: loading the file turns it into ConfigError.
        if not self.renew_s < self.lease_s / 2:
            raise ValueError(
                f"renew_s ({self.renew_s:g}) must be below half of lease_s ({self.lease_s:g}): "
                "the leader must renew at least twice per lease"
            )


def _store_url(_instance: object, _attribute: object, value: str) -> None:
    """`postgresql://…` or `postgres://…` (a libpq URL), or empty; never with a password in it."""
    if not value:
        return
    scheme, sep, rest = value.partition("://")
    if not sep or scheme not in {"postgresql", "postgres"}:
        raise ValueError("'url' must be a postgresql://USER@HOST:PORT/DATABASE URL (or empty: SQLite in state_dir)")
    authority = rest.split("/", 1)[0].split("?", 1)[0]
    query = rest.partition("?")[2]
    if ":" in authority.rpartition("@")[0] or re.search(r"(^|&)password=", query):
        raise ValueError("'url' holds a password: put it in a file named by store.password_file instead")


@attrs.frozen(kw_only=True)
class StoreConfig:
    """Where the controller keeps its durable state.

    Empty `url` (the default): the embedded SQLite database in `state_dir`, one controller on it.
    A `postgresql://` URL: a PostgreSQL database that several controllers may share (DESIGN §5;
    `[cluster]`), created empty by the operator (`createdb -O nexa nexa`); the controller creates and
    migrates its tables there at start. Backups of it are PostgreSQL's own (pg_dump, continuous
    archiving): `nexa backup` copies only the SQLite store.
    """

    #: A libpq URL, `postgresql://USER@HOST:PORT/DATABASE` (`postgres://` too; libpq's query
    #: parameters such as `?sslmode=verify-full` are passed on). Never the password: see below.
    url: str = attrs.field(default="", validator=_store_url)
    #: A file holding the database user's password (one line; mode 0600), read at start so it
    #: stays out of this file. Empty: libpq's own sources (PGPASSWORD, ~/.pgpass) or none.
    password_file: str = ""
    #: How long connecting to the database may take, at start and at each reconnect.
    connect_timeout_s: Seconds = attrs.field(default=Seconds(10.0), validator=attrs.validators.gt(Seconds(0.0)))


def _check_report_keys(keys: tuple[PublicKeyB64, ...]) -> None:
    if any(not k for k in keys):
        raise ValueError("trusted_report_keys: an empty key; list base64 Ed25519 public keys, or none")


@attrs.frozen(kw_only=True)
class EvidenceConfig:
    """Release evidence (`nexa evidence`)."""

    #: Ed25519 public keys (base64 of the raw 32 bytes) of the release pipeline: a sim summary or
    #: gate report signed by one of them (`nexa sim --sign-key`, `release-gate.sh --sign-key`) counts
    #: as verified; anything else is asserted, and `release_ready` is false over an asserted part.
    trusted_report_keys: tuple[PublicKeyB64, ...] = attrs.field(
        default=(), validator=lambda _i, _a, v: _check_report_keys(v)
    )


@attrs.frozen(kw_only=True)
class RetentionConfig:
    """Payload retention (`nexa retention`): requests naming a policy their tenant may use are kept
    encrypted in the S3-compatible store of `[artifacts]` (its endpoint and credentials)."""

    #: File holding the 32-byte retention master key as base64 or hex (mode 0600; `nexa keygen
    #: --backup --out FILE` writes one). It wraps each tenant's data key. Empty: retention is off and
    #: every retention but `ephemeral` is refused (retention_unavailable).
    key_file: str = ""
    #: The bucket retained payloads are written to (it must exist), and the key prefix inside it.
    bucket: str = ""
    prefix: str = "retention/"
    #: How often payloads past their policy's TTL are purged (the leader does it).
    purge_interval_s: Seconds = attrs.field(default=Seconds(60.0), validator=attrs.validators.gt(Seconds(0.0)))
    #: Retained answers waiting to be written at most; a request asking for retention while this
    #: many wait is refused (overloaded) before it runs, so nothing it asked to keep is dropped.
    max_pending: int = attrs.field(default=256, validator=attrs.validators.ge(1))
    #: How long one payload's write to the store may take before it is given up (logged, counted).
    write_timeout_s: Seconds = attrs.field(default=Seconds(30.0), validator=attrs.validators.gt(Seconds(0.0)))

    def check(self, artifacts: ArtifactStoreConfig) -> None:
        if self.key_file and not (self.bucket and artifacts.s3_endpoint):
            raise ValueError("key_file: retention needs [retention] bucket and [artifacts] s3_endpoint too")
        if self.prefix.startswith("/") or ".." in self.prefix.split("/"):
            raise ValueError(f"prefix: {self.prefix!r} must not start with / or hold '..'")


@attrs.frozen(kw_only=True)
class ControlConfig:
    """Everything `nexa control` reads."""

    state_dir: str = "/var/lib/nexa/control"
    #: Checked against `store`, `cluster` and `channel` (`HttpConfig.check_workers`,
    #: `check_worker_processes`) once all are set.
    http: HttpConfig = attrs.field(
        default=HttpConfig(),
        validator=[
            lambda i, _a, v: v.check_worker_processes(i.store, i.cluster, i.channel),
            lambda i, _a, v: v.check_workers(i.store, i.cluster),
        ],
    )
    channel: ChannelConfig = ChannelConfig()
    nodes: NodesConfig = NodesConfig()
    placement: PlacementConfig = PlacementConfig()
    oci: OciConfig = OciConfig()
    artifacts: ArtifactStoreConfig = ArtifactStoreConfig()
    models: ModelsConfig = ModelsConfig()
    gateway: GatewayConfig = GatewayConfig()
    bootstrap: BootstrapConfig = BootstrapConfig()
    backup: BackupConfig = BackupConfig()
    log: LogConfig = LogConfig()
    cluster: ClusterConfig = ClusterConfig()
    store: StoreConfig = StoreConfig()
    evidence: EvidenceConfig = EvidenceConfig()
    retention: RetentionConfig = attrs.field(default=RetentionConfig(), validator=lambda i, _a, v: v.check(i.artifacts))
