"""Two "controllers" on one store for the tests of `nexa.control.cluster.follow`: the leader over the state
dir's store and a follower over a second pair of apsw connections on the same SQLite file, each with
its own accounts, model registry, fleet, deployments, quotas and change feed; and the config of one
real controller of a cluster on PostgreSQL."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path

import apsw
import attrs
import httpx
import trio

from nexa import security
from nexa.channel import links
from nexa.config import (
    ArtifactStoreConfig,
    ClusterConfig,
    ControlConfig,
    HostPort,
    HttpConfig,
    ModelsConfig,
    NodesConfig,
    OciConfig,
    Seconds,
    StoreConfig,
)
from nexa.contracts.api import EnrollmentTokenCreate, EnrollRequest
from nexa.contracts.domain import SYSTEM
from nexa.control import store as st
from nexa.control.access.accounts import Accounts
from nexa.control.cluster.follow import ChangeFeed
from nexa.control.cluster.leadership import Leadership
from nexa.control.datapath.quotas import Quotas
from nexa.control.deployments import Deployments
from nexa.control.fleet.nodes import Fleet
from nexa.control.registry.models import ModelRegistry
from nexa.control.registry.outbound import Outbound
from nexa.control.store.sqlite import LiteDb
from nexa.telemetry import Metrics
from tests.conftest import free_port, local_config


class NoPush:
    """A southbound that pushes nothing: these tests place nothing on nodes."""

    recovering = False

    async def push_now(self, node_id: str) -> None:
        return None


@attrs.define
class Side:
    """One controller's in-memory state over its own store connections."""

    store: st.Store
    leadership: Leadership
    accounts: Accounts
    models: ModelRegistry
    fleet: Fleet
    deployments: Deployments
    quotas: Quotas
    feed: ChangeFeed


async def side(store: st.Store, name: str, leadership: Leadership) -> Side:
    """Load one controller's views over `store`, as `serve_control` does."""
    metrics = Metrics()
    accounts = await Accounts.load(store, metrics)
    outbound = Outbound(OciConfig(), ArtifactStoreConfig(), registry_credentials=None, s3_credentials=None)
    models = await ModelRegistry.load(ModelsConfig(), store, metrics, outbound)
    fleet = Fleet(NodesConfig(), store, metrics, leadership=leadership)
    await fleet.load()
    deployments = Deployments(
        NodesConfig(),
        store,
        metrics,
        fleet,
        models=models,
        southbound=NoPush(),  # type: ignore[arg-type]  # nothing is placed or pushed here
        leadership=leadership,
    )
    await deployments.load()
    quotas = await Quotas.load(store, metrics, accounts.tenant_exists)
    feed = ChangeFeed(
        store,
        ClusterConfig(),
        controller_id=name,
        accounts=accounts,
        models=models,
        fleet=fleet,
        deployments=deployments,
        quotas=quotas,
    )
    await feed.refresh_all()
    return Side(store, leadership, accounts, models, fleet, deployments, quotas, feed)


@asynccontextmanager
async def two_sides(tmp_path: Path) -> AsyncIterator[tuple[Side, Side]]:
    """The leader (`a`, solo over the state dir's store) and a follower (`b`, a never-run leased
    leadership) on one database file."""
    async with st.open_store(tmp_path, inline=True) as first:
        db = apsw.Connection(str(tmp_path / st.DB_FILE))
        reader = apsw.Connection(str(tmp_path / st.DB_FILE), flags=apsw.SQLITE_OPEN_READONLY)
        try:
            second = st.Store(LiteDb(db), epoch=0, inline=True, reader=LiteDb(reader))
            follower = Leadership.leased(second, ClusterConfig(), controller_id="b", address="http://b.test:8470")
            yield await side(first, "a", Leadership.solo(first)), await side(second, "b", follower)
        finally:
            reader.close()
            db.close()


async def enroll(fleet: Fleet, hostname: str = "n1") -> tuple[str, security.SigningKey, links.CurveKeyPair]:
    """Enroll a node through `fleet` with fresh keys: (its id, its signing key, its Curve keys)."""
    key, curve = security.generate_signing_key(), links.generate_curve_keypair()
    secret, _ = await fleet.create_token(SYSTEM, EnrollmentTokenCreate(ttl_s=60))
    node = await fleet.enroll(
        EnrollRequest(token=secret, hostname=hostname, signing_public_key=key.public.b64, curve_public_key=curve.public)
    )
    return node.id, key, curve


def cluster_config(tmp_path: Path, name: str, pg_url: str) -> ControlConfig:
    """Controller `name` of a cluster on `pg_url`: its own state dir and loopback port, a 2 s lease."""
    port = free_port()
    return attrs.evolve(
        local_config(tmp_path / name),
        http=HttpConfig(listen=HostPort(f"127.0.0.1:{port}")),
        store=StoreConfig(url=pg_url),
        cluster=ClusterConfig(
            lease_s=Seconds(2.0),
            renew_s=Seconds(0.5),
            refresh_s=Seconds(0.1),
            controller_id=name,
            address=f"http://127.0.0.1:{port}",
        ),
    )


async def until_leads(http: httpx.AsyncClient) -> None:
    """Wait until the controller behind `http` says it leads."""
    while (await http.get("/readyz")).json().get("role") != "leader":  # noqa: ASYNC110 - polls another process
        await trio.sleep(0.1)
