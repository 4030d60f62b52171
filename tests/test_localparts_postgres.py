"""`nexa.localparts.LocalPostgres`, the PostgreSQL of the store's tests and of perf/failover.py: it
starts on a free loopback port in a directory of its own, makes a database a controller's store
opens, and leaves nothing behind when stopped; without PostgreSQL it says what to install."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from nexa.config import StoreConfig
from nexa.control import store as st
from nexa.errors import ConfigError
from nexa.localparts import LocalPostgres, postgres
from nexa.localparts.postgres import POSTGRES_HINT
from tests.conftest import IN_CI


def _refused(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


async def test_it_serves_a_database_a_store_opens_then_stops_and_leaves_nothing(tmp_path: Path) -> None:
    if missing := postgres.postgres_missing():
        if IN_CI:
            pytest.fail(f"required in CI: {missing}", pytrace=False)
        pytest.skip(missing)
    server = LocalPostgres()
    server.start()
    try:
        url = server.createdb("nexa_lp")
        assert url == f"postgresql://nexa@127.0.0.1:{server.port}/nexa_lp"
        async with st.open_store(tmp_path, StoreConfig(url=url)) as store:
            assert (await store.read(st.verify_audit)).ok
        root = server.root
        assert (root / "data" / "postmaster.pid").exists()
    finally:
        server.stop()
    assert not root.exists()
    assert _refused(server.port)
    server.stop()  # a second stop is harmless


def test_without_postgresql_it_says_what_to_install_and_starts_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(postgres, "find_pg_tool", lambda name: None)
    server = LocalPostgres()
    with pytest.raises(ConfigError, match="apt-get install postgresql"):
        server.start()
    assert server.root == Path()  # no directory was made
    assert postgres.postgres_missing() == POSTGRES_HINT
