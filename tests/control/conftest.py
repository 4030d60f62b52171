"""Fixtures of the control tests: a controller that checks images in the run's OCI registry and
artifacts in its S3 store (`reg`), and one that also demands a trusted key's signature (`signed_reg`)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import trio

from nexa.security import SigningKey, generate_signing_key
from tests.conftest import Controller, start_controller
from tests.control.test_models import registry_config
from tests.realparts import S3Store


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
