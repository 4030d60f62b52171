"""Deployments: desired state, placement over a snapshot of the fleet, and the reconciler.

A deployment is checked against the model registry when it is created (its model Approved with
a licence valid now, its runtime registered, which means its digest was checked at the
registry), then placed with `scheduler.place` over `snapshot_from(fleet)`. A placement that
cannot take every replica is refused (422, `Unplaceable`, the message explaining each node)
and nothing starts. The decision is kept, so `GET /deployments/{id}/placement` shows it.

Each replica is one `wire.Assignment` in its node's desired set (`assignment_for` documents the
mapping). On a unified-memory node (a DGX Spark) the replica's reservation becomes the runtime's
own memory limit, and replicas there reserve together at most the pool less the configured host
headroom (`placement.unified_host_headroom_bytes`); an operator-set memory setting that would
claim more than the reservation on such a node is refused at creation (422,
`MemoryOverReservation`). A change writes the deployment, its decision and every node set it touched (each one
generation up) in one audited transaction, then pushes those sets through the node channel.

The package, one module per job (each imports only those above it in this list):

- `groups`: group replicas (`nodes_per_replica` above 1) laid over fabrics, for `scheduler`.
- `scheduler`: placement, pure (`place`).
- `snapshot`: the fleet as placement sees it (`snapshot_from`).
- `assignment`: what a replica runs (`assignment_for`) and what placement is asked (`placement_request`).
- `checks`: what a change must pass first, each refusal a typed error; `explain` for Unplaceable.
- `records`: a deployment's `Entry` and the pure steps of a change (`follow`, `bump`).
- `desired`: the deployments in memory, the lock, and `Desired.commit`, the one write path.
- `views`: `DeploymentView` and the gateway's `ServingSet`.
- `reconciler`: re-placement of lost replicas, drains, and rollout steps (its docstring tells how;
  `soak.held` says when a step waits).
- `canary`: canary, promote and rollback (`Rollouts`).
- `soak`: a rollout's watch, the pure part (`held`, `breach`).
- `rolloutsuite`: a rollout policy's suite gate, the pure part (`verdict`: a run against the new
  replicas alone passes or reverts each one); `canarysuite` is the canary's.
- `watch`: every change rolled out under watch: `change`, pause / resume / undo, and the loop that
  soaks each new replica and reverts a breach (`RolloutControl`, `ChangeWatcher`).
- `manager`: `Deployments`, the object the rest of the controller holds.
"""

from __future__ import annotations

from nexa.control.deployments.assignment import artifact_ref, assignment_for, placement_request
from nexa.control.deployments.checks import check_memory_limits, check_settings, explain
from nexa.control.deployments.manager import Deployments
from nexa.control.deployments.snapshot import snapshot_from, unified_pool_bytes

__all__ = [
    "Deployments",
    "artifact_ref",
    "assignment_for",
    "check_memory_limits",
    "check_settings",
    "explain",
    "placement_request",
    "snapshot_from",
    "unified_pool_bytes",
]
