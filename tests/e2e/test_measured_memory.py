"""Measured memory through the controller: a real `nexa node` measures its sim replica (a local process,
measured by its resident set), reports it in its heartbeats, and the controller keeps it per
(runtime, model, settings): `nexa deployments show` shows declared against measured, and placing
more replicas of the same triple reserves the measured figure, the larger one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.realparts import BuiltImages, S3Store
from tests.support.api import ok, wait_for
from tests.support.cluster import SIM_ARGS, new_key, sim_cluster
from tests.support.models import registry_config

TIMEOUT_S = 60
MIB = 1024 * 1024


@pytest.mark.slow
async def test_a_measured_replica_shows_in_deployments_show_and_placement_reserves_the_larger_figure(
    nursery: Any, tmp_path: Path, s3_store: S3Store, test_images: BuiltImages
) -> None:
    cfg = registry_config(tmp_path, s3_store)
    async with sim_cluster(nursery, tmp_path, cfg, s3_store, test_images, nodes=1) as cluster:
        body = {
            "name": "small",
            "runtime": "sim",
            "alias": "chat",
            "replicas": 1,
            # Declared far below what a python process holds: the measurement must win.
            "resources": {"accelerators": 0, "memory_bytes": 1 * MIB, "cpus": 0.5},
            "options": {"port": 18650, "command": SIM_ARGS},
        }
        async with cluster.client() as http:
            await ok(http.post("/api/v1/deployments", json=body), 201)
        await cluster.wait_ready("small", 1)
        seen: dict[str, Any] = {}

        async def measured() -> bool:
            async with cluster.client() as http:
                seen.update(await ok(http.get("/api/v1/deployments/small")))
            memory = seen.get("memory") or {}
            return bool(memory.get("replicas")) and memory.get("measured_bytes") is not None

        await wait_for(measured, timeout_s=TIMEOUT_S)
        memory = seen["memory"]
        [replica] = memory["replicas"]
        assert replica["node_id"] == cluster.nodes[0].node_id
        # A python sim runtime holds tens of MiB: more than the 1 MiB declared (sim has no engine overhead).
        assert 10 * MIB < memory["measured_bytes"] < 1024 * MIB
        assert memory["declared_bytes"] == 1 * MIB and memory["overhead_bytes"] == 0
        assert memory["reserved_bytes"] == memory["measured_bytes"]

        shown = await cluster.cli("deployments", "show", "small")
        assert shown.returncode == 0, shown.stderr
        assert "memory   declared 1.0 MiB + engine overhead 0 B, measured " in shown.stdout, shown.stdout
        assert f"  {replica['replica_id']} on {replica['node_id']}: measured " in shown.stdout

        # /metrics exports it per replica.
        async with cluster.client(await new_key(cluster, "monitoring")) as http:
            exposition = (await http.get("/metrics")).text
        [sample] = [line for line in exposition.splitlines() if line.startswith("nexa_runtime_memory_measured_bytes{")]
        assert 'deployment="small"' in sample and f'replica="{replica["replica_id"]}"' in sample
        assert float(sample.rpartition(" ")[2]) > 10 * MIB

        # A second replica of the same runtime, model and settings is placed against the measured figure.
        async with cluster.client() as http:
            await ok(http.post("/api/v1/deployments/small/scale", json={"replicas": 2}))
            placement = await ok(http.get("/api/v1/deployments/small/placement"))
        request = placement["decision"]["request"]
        assert request["memory_bytes"] == 1 * MIB
        assert request["reserve_bytes"] >= memory["measured_bytes"]
