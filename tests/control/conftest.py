"""Fixtures of the control tests: a controller that checks images in the run's OCI registry and
artifacts in its S3 store (`reg`), one that also demands a trusted key's signature (`signed_reg`),
one that replaces an unreachable node's replicas after a second (`dep_reg`), and `dial`, which
connects RawNodes to a controller's channel."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import attrs
import pytest
import trio
import zmq

from nexa.channel import links
from nexa.security import SigningKey, generate_signing_key
from tests.conftest import Controller, start_controller
from tests.realparts import S3Store
from tests.support.models import registry_config
from tests.support.rawnode import RawNode


@pytest.fixture
async def reg(nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store) -> AsyncIterator[Controller]:
    started = await start_controller(nursery, registry_config(tmp_path, s3_store))
    yield started
    started.stopping.set()


@pytest.fixture
def signer() -> SigningKey:
    return generate_signing_key()


@pytest.fixture
async def signed_reg(
    nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store, signer: SigningKey
) -> AsyncIterator[Controller]:
    started = await start_controller(nursery, registry_config(tmp_path, s3_store, trusted_key=signer.public.b64))
    yield started
    started.stopping.set()


@pytest.fixture
async def dep_reg(nursery: trio.Nursery, tmp_path: Path, s3_store: S3Store) -> AsyncIterator[Controller]:
    cfg = registry_config(tmp_path, s3_store)
    cfg = attrs.evolve(cfg, nodes=attrs.evolve(cfg.nodes, replace_after_s=1.0))
    started = await start_controller(nursery, cfg)
    yield started
    started.stopping.set()


@pytest.fixture
async def dial(nursery: trio.Nursery) -> AsyncIterator[Any]:
    """Connect a RawNode's Curve DEALER to the controller's channel (real zmq over loopback)."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()

    async def connect(node: RawNode, *, curve: links.CurveKeyPair | None = None) -> RawNode:
        pair = curve or node.curve
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.CURVE_SERVERKEY, node.enrolled.controller_curve_public_key.encode())
        sock.setsockopt(zmq.CURVE_PUBLICKEY, pair.public.encode())
        sock.setsockopt(zmq.CURVE_SECRETKEY, pair.secret.encode())
        sock.connect(node.enrolled.channel_endpoint)
        node.pump = links.ZmqPump(sock)
        await nursery.start(node.pump.run)
        return node

    try:
        yield connect
    finally:
        nursery.cancel_scope.cancel()
        ctx.destroy(linger=0)
