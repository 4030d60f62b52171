"""Placement, table-driven over nodes built from the recorded hardware fixtures (the lab is
tests/support/scheduler.py).

Each node goes through the real inventory path (nvidia-smi CSV and /proc/meminfo parsed, then
merged with an inventory file) and a small stand-in for the fleet adapter turns the merged
inventory into a PlacementNode. The lab: four DGX Spark GB10 (unified memory), one 8x H100
with four GPUs busy, one 2x L40S with one busy, one CPU-only host.
"""

from __future__ import annotations

import math
import os
import random
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

from nexa.contracts import codec
from nexa.contracts.domain import NodeState
from nexa.contracts.node import DEFAULT_RUNTIMES, LabelKey, RuntimeKind, Taint, TaintEffect
from nexa.contracts.placement import PlacementDecision, PlacementPolicy, PlacementRequest
from nexa.control.deployments.scheduler import FILTERS, forecast, place
from tests.support.scheduler import GIB, LICENSE, SPARKS, by_id, explanation, failures, lab, vllm, where

# --- the fixtures read as their hardware -------------------------------------------------------


def test_fixture_nodes_look_like_their_hardware() -> None:
    nodes = {n.id: n for n in lab()}
    spark = nodes["spark-1"]
    assert spark.unified_memory and spark.arch == "arm64"
    assert spark.free_gpus == ("nvidia.com/gpu=0",)
    assert spark.accelerator_memory_total_bytes == 125106396 * 1024  # the host's MemTotal
    assert spark.accelerator_memory_free_bytes == 118950112 * 1024  # its MemAvailable
    h100 = nodes["h100-1"]
    assert not h100.unified_memory and h100.gpu_count == 8
    assert h100.free_gpus == tuple(f"nvidia.com/gpu={i}" for i in range(4, 8))  # 0-3 are busy
    assert h100.accelerator_memory_free_bytes == 4 * 80994 * 1024**2
    assert nodes["l40s-1"].free_gpus == ("nvidia.com/gpu=0",)
    assert nodes["cpu-1"].gpu_count == 0 and nodes["cpu-1"].free_gpus == ()


# --- every filter fails on its own and says why -------------------------------------------------

MISTRAL = "license.nexa/mistral=allowed"
MAINTENANCE = Taint(key=LabelKey("maintenance"), effect=TaintEffect.NO_SCHEDULE)

# (case, node id in the lab, changes to that node, changes to the request, filter, detail)
FILTER_CASES = [
    ("unreachable", "h100-1", {"state": NodeState.UNREACHABLE}, {}, "state_ready", "node is Unreachable"),
    ("revoked", "h100-1", {"state": NodeState.REVOKED}, {}, "state_ready", "node is Revoked"),
    ("cordoned", "h100-1", {"state": NodeState.CORDONED}, {}, "not_cordoned_or_draining", "node is Cordoned"),
    ("draining", "h100-1", {"state": NodeState.DRAINING}, {}, "not_cordoned_or_draining", "node is Draining"),
    (
        "runtime",
        "h100-1",
        {},
        {"runtime": RuntimeKind.SIM},
        "runtime_allowed",
        "sim is not allowed (allowed: llamacpp, sglang, trtllm, vllm)",
    ),
    ("arch", "h100-1", {}, {"arch": "arm64"}, "architecture", "needs arm64, node is amd64"),
    ("data class", "l40s-1", {}, {"data_classes": ("internal",)}, "data_classes", "node may not process internal"),
    ("taint", "h100-1", {"taints": (MAINTENANCE,)}, {}, "taints", "NoSchedule taint not tolerated: maintenance"),
    (
        "selector",
        "h100-1",
        {},
        {"node_selector": {"gpu": "l40s", "zone": "b"}},
        "selector_labels",
        "needs gpu=l40s (node has gpu=h100)",
    ),
    (
        "selector, label absent",
        "cpu-1",
        {"runtimes": DEFAULT_RUNTIMES},
        {"node_selector": {"gpu": "h100"}, "accelerators": 0, "memory_bytes": GIB},
        "selector_labels",
        "needs gpu=h100 (node has no gpu)",
    ),
    (
        "license absent",
        "l40s-1",
        {},
        {"license_allowance": f"{LICENSE}=allowed"},
        "license_allowance",
        f"needs label {LICENSE}=allowed (node has none)",
    ),
    (
        "license denied",
        "h100-1",
        {"labels": {LICENSE: "denied"}},
        {"license_allowance": f"{LICENSE}=allowed"},
        "license_allowance",
        f"(node has {LICENSE}=denied)",
    ),
    ("discrete GPUs", "h100-1", {}, {"accelerators": 5}, "accelerators", "needs 5 GPU(s), 4 free"),
    ("unified GPU", "spark-1", {}, {"accelerators": 2}, "accelerators", "needs 2 shared GPU(s), node has 1"),
    ("no GPU at all", "cpu-1", {"runtimes": DEFAULT_RUNTIMES}, {}, "accelerators", "needs 1 GPU(s), 0 free"),
    (
        "GPU memory",
        "h100-1",
        {},
        {"memory_bytes": 100 * GIB},
        "memory",
        "needs 100.0 GiB on 1 GPU(s), they have 79.1 GiB free",
    ),
    (
        "unified memory",
        "spark-1",
        {},
        {"memory_bytes": 120 * GIB},
        "memory",
        "needs 120.0 GiB of unified memory, 113.4 GiB free",
    ),
    (
        "memory pressure",
        "spark-1",
        {"memory_pressure": "memory pressure: MemAvailable 3.00 GiB is under the node's floor of 8.00 GiB"},
        {"memory_bytes": GIB},
        "memory",
        "memory pressure: MemAvailable 3.00 GiB is under the node's floor of 8.00 GiB; nothing more is placed "
        "on this node until MemAvailable is back above the floor",
    ),
    (
        "host memory",
        "cpu-1",
        {},
        {"runtime": RuntimeKind.LLAMACPP, "accelerators": 0, "memory_bytes": 300 * GIB},
        "memory",
        "needs 300.0 GiB of host memory, 200.0 GiB free",
    ),
]


@pytest.mark.parametrize(
    ("node_id", "node_changes", "request_changes", "filter_name", "detail"),
    [pytest.param(*case[1:], id=case[0]) for case in FILTER_CASES],
)
def test_each_filter_fails_on_its_own_and_names_itself(
    node_id: str,
    node_changes: dict[str, object],
    request_changes: dict[str, object],
    filter_name: str,
    detail: str,
) -> None:
    target = attrs.evolve(by_id(lab(), node_id), **node_changes)

    decision = place([target], vllm(**request_changes))

    assert not decision.feasible and decision.placements == ()
    e = explanation(decision, node_id)
    assert not e.eligible and e.score == 0.0 and e.terms == ()
    [(name, why)] = failures(e)  # this filter and no other
    assert name == filter_name
    assert detail in why
    assert [f.name for f in e.filters] == list(FILTERS)  # every filter shown, in order
    assert decision.reason is not None
    assert f"most often failed: {filter_name} on 1 of 1 nodes ({node_id}: " in decision.reason
    assert detail in decision.reason


@pytest.mark.parametrize(
    ("node_changes", "request_changes"),
    [
        pytest.param({"taints": (MAINTENANCE,)}, {"tolerations": ("maintenance",)}, id="tolerated taint"),
        pytest.param(
            {"taints": (Taint(key=LabelKey("busy"), effect=TaintEffect.PREFER_NO_SCHEDULE),)},
            {},
            id="PreferNoSchedule is not a hard filter",
        ),
        pytest.param({}, {"license_allowance": f"{LICENSE}=allowed"}, id="license label present"),
        pytest.param({}, {"node_selector": {"gpu": "h100", "zone": "b"}}, id="selector matches"),
        pytest.param({}, {"data_classes": ("confidential", "public")}, id="data classes allowed"),
        pytest.param({}, {"arch": "amd64"}, id="arch matches"),
        pytest.param({}, {"accelerators": 4, "memory_bytes": 300 * GIB}, id="four GPUs, memory across them"),
    ],
)
def test_filters_pass_when_satisfied(node_changes: dict[str, object], request_changes: dict[str, object]) -> None:
    target = attrs.evolve(by_id(lab(), "h100-1"), **node_changes)
    decision = place([target], vllm(**request_changes))
    assert decision.feasible
    assert all(f.passed for f in explanation(decision, "h100-1").filters)


def test_a_node_failing_several_filters_shows_each() -> None:
    target = attrs.evolve(by_id(lab(), "l40s-1"), state=NodeState.CORDONED)
    decision = place([target], vllm(arch="arm64", accelerators=2, license_allowance=MISTRAL))
    assert [name for name, _ in failures(explanation(decision, "l40s-1"))] == [
        "not_cordoned_or_draining",
        "architecture",
        "license_allowance",
        "accelerators",
    ]


def test_reason_names_the_most_common_failing_filter() -> None:
    decision = place(lab(), vllm(arch="riscv64"))
    assert not decision.feasible
    assert decision.reason is not None
    assert decision.reason.startswith("no node passes every filter; most often failed: architecture on 7 of 7 nodes")

    # cpu-1 fails runtime and accelerators; the sparks fail memory; the rest fit nowhere else.
    decision = place(lab(), vllm(memory_bytes=200 * GIB))
    assert decision.reason is not None
    assert "most often failed: memory on 6 of 7 nodes" in decision.reason
    assert place([], vllm()).reason == "no nodes to place on"


# --- scores, ties, policies -------------------------------------------------------------------


def test_the_emptiest_fitting_node_wins_and_every_eligible_node_is_scored() -> None:
    decision = place(lab(), vllm())
    assert decision.feasible
    # spark headroom (113.4 - 40) / 119.3 beats h100's 3 of 8 GPUs left and l40s's none.
    assert where(decision) == ["spark-1"]
    assert explanation(decision, "spark-1").replicas_placed == 1
    eligible = {e.node_id for e in decision.explanations if e.eligible}
    assert eligible == {*SPARKS, "h100-1", "l40s-1"}
    terms = {t.name: t.value for t in explanation(decision, "h100-1").terms}
    # Headroom in hundredths: 3 of 8 GPUs left; (MemAvailable - 40 GiB) / MemTotal = 0.6155.
    assert terms == {"artifact_cached": 0.0, "headroom": 0.38, "load": 1.0, "reliability": 1.0, "policy": 0.0}
    assert {t.name: t.value for t in explanation(decision, "spark-2").terms}["headroom"] == 0.62
    for e in decision.explanations:
        assert e.score == pytest.approx(sum(t.value * t.weight for t in e.terms))


SHA = "5" * 64

# (case, node changes by id, request changes, expected winner)
SCORE_CASES = [
    ("cached artifact beats headroom", {"l40s-1": {"cached_artifacts": (SHA,)}}, {"artifact_sha256": SHA}, "l40s-1"),
    ("less load wins", {"spark-1": {"load": 3}}, {}, "spark-2"),
    ("more reliable wins", {"spark-1": {"reliability": 0.5}, "spark-2": {"reliability": 0.9}}, {}, "spark-3"),
    ("equal nodes: smallest id", {}, {}, "spark-1"),
    ("binpack: the fullest that fits", {}, {"policy": PlacementPolicy.BINPACK}, "l40s-1"),
    ("binpack among sparks", {}, {"policy": PlacementPolicy.BINPACK, "node_selector": {"zone": "a"}}, "spark-1"),
]


@pytest.mark.parametrize(
    ("changes", "request_changes", "winner"),
    [pytest.param(*case[1:], id=case[0]) for case in SCORE_CASES],
)
def test_scores_order_the_nodes(
    changes: dict[str, dict[str, object]], request_changes: dict[str, object], winner: str
) -> None:
    nodes = [attrs.evolve(n, **changes.get(n.id, {})) for n in lab()]
    decision = place(nodes, vllm(**request_changes))
    assert where(decision) == [winner]
    best = explanation(decision, winner).score
    assert all(e.score <= best for e in decision.explanations)


def test_ties_are_broken_by_node_id_not_by_list_order() -> None:
    nodes = lab()
    for seed in range(5):
        random.Random(seed).shuffle(nodes)
        decision = place(nodes, vllm())
        assert where(decision) == ["spark-1"]
        assert [e.node_id for e in decision.explanations] == sorted(n.id for n in nodes)


def test_spread_puts_one_replica_on_each_node_first() -> None:
    decision = place(lab(), vllm(replicas=4))
    assert where(decision) == list(SPARKS)
    # Unified memory: the one GB10 GPU is shared, never used up.
    assert {p.gpus for p in decision.placements} == {("nvidia.com/gpu=0",)}
    assert [p.replica for p in decision.placements] == [0, 1, 2, 3]

    # Six replicas: every eligible node once (the sparks, h100, l40s), none twice.
    decision = place(lab(), vllm(replicas=6))
    assert sorted(where(decision)) == sorted([*SPARKS, "h100-1", "l40s-1"])
    # Seven: the seventh goes where a second one is best, the emptiest spark.
    decision = place(lab(), vllm(replicas=7))
    assert where(decision)[6] == "spark-1"


def test_spread_never_stacks_while_an_eligible_node_is_empty() -> None:
    # The H100 has the artifact cached: it wins the first replica and would win the second on
    # every soft term, but a second replica waits until every eligible node has one.
    nodes = [attrs.evolve(n, cached_artifacts=(SHA,)) if n.id == "h100-1" else n for n in lab()]
    decision = place(nodes, vllm(replicas=7, artifact_sha256=SHA))
    assert where(decision)[:6] == ["h100-1", *SPARKS, "l40s-1"]
    assert where(decision)[6] == "h100-1"


def test_spread_avoids_nodes_already_running_the_deployment() -> None:
    decision = place(lab(), vllm(), existing={"spark-1": 1, "spark-2": 2})
    assert where(decision) == ["spark-3"]
    assert {t.name: t.value for t in explanation(decision, "spark-2").terms}["policy"] == -2.0


def test_binpack_fills_one_node_when_one_node_can_take_them_all() -> None:
    decision = place(lab(), vllm(replicas=4, policy=PlacementPolicy.BINPACK))
    assert where(decision) == ["h100-1"] * 4  # only the H100 has room for four (a spark has 2)
    assert [p.gpus for p in decision.placements] == [(f"nvidia.com/gpu={i}",) for i in range(4, 8)]
    assert explanation(decision, "h100-1").replicas_placed == 4
    fits_all = {e.node_id: {t.name: t.value for t in e.terms}["fits_all"] for e in decision.explanations if e.eligible}
    assert fits_all == {"h100-1": 1.0, "l40s-1": 0.0, **dict.fromkeys(SPARKS, 0.0)}

    # Two replicas fit on a spark or on the H100: the fuller one afterwards (the H100) takes both.
    decision = place(lab(), vllm(replicas=2, policy=PlacementPolicy.BINPACK))
    assert where(decision) == ["h100-1", "h100-1"]


def test_binpack_fills_the_fullest_node_first_when_none_takes_them_all() -> None:
    decision = place(lab(), vllm(replicas=8, policy=PlacementPolicy.BINPACK))
    assert decision.feasible
    # l40s (1 free GPU) is fullest after placing; then the H100 until full; then spark by spark.
    assert where(decision) == ["l40s-1", *["h100-1"] * 4, "spark-1", "spark-1", "spark-2"]


def test_binpack_prefers_where_the_deployment_already_runs() -> None:
    decision = place(lab(), vllm(replicas=2, policy=PlacementPolicy.BINPACK), existing={"spark-3": 1})
    # Two fit on spark-3 as on the H100; the H100 is fuller, but spark-3 already runs it.
    assert where(decision) == ["spark-3", "spark-3"]


def test_all_or_nothing() -> None:
    # Three GPUs a replica: only the H100 (4 free) takes one; the second fits nowhere.
    decision = place(lab(), vllm(replicas=2, accelerators=3))
    assert not decision.feasible
    assert decision.placements == ()
    assert all(e.replicas_placed == 0 for e in decision.explanations)
    assert decision.reason is not None
    assert decision.reason.startswith("only 1 of 2 replicas fit on the 1 node(s) that pass every filter")
    assert "most often failed: accelerators on 6 of 7 nodes" in decision.reason
    assert place(lab(), vllm(replicas=1, accelerators=3)).feasible


def test_cpu_replicas_draw_host_memory_and_get_no_gpus() -> None:
    req = PlacementRequest(
        deployment="tiny", runtime=RuntimeKind.LLAMACPP, memory_bytes=90 * GIB, replicas=3, node_selector={"zone": "c"}
    )
    decision = place(lab(), req)
    assert not decision.feasible  # 200 GiB free: two fit, not three
    decision = place(lab(), attrs.evolve(req, replicas=2))
    assert where(decision) == ["cpu-1", "cpu-1"]
    assert all(p.gpus == () for p in decision.placements)


# --- the decision as data ---------------------------------------------------------------------


def test_decision_round_trips_through_the_api_codec_and_is_byte_identical() -> None:
    req = vllm(replicas=3, policy=PlacementPolicy.BINPACK, artifact_sha256=SHA, license_allowance=f"{LICENSE}=allowed")
    first = place(lab(), req)
    text = codec.dumps(codec.api, first)
    assert codec.loads(codec.api, text, PlacementDecision) == first
    shuffled = lab()
    random.Random(1).shuffle(shuffled)
    assert codec.dumps(codec.api, place(shuffled, req)) == text
    assert codec.dumps(codec.api, forecast(lab(), req)) == text
    for item in (req, lab()[0], first.explanations[0], first.placements[0]):
        assert codec.loads(codec.api, codec.dumps(codec.api, item), type(item)) == item


def test_a_decision_does_not_depend_on_the_decisions_before_it() -> None:
    # The scheduler keeps score terms from one decision to the next (`_Interned`). A reliability
    # of -0.0 equals 0.0 as a key but is written apart, so each must come out as its node gave it.
    req = vllm()
    for order in ((0.0, -0.0, 0.0), (-0.0, 0.0, -0.0)):
        for reliability in order:
            nodes = [attrs.evolve(n, reliability=reliability) for n in lab()]
            terms = [t for e in place(nodes, req).explanations for t in e.terms if t.name == "reliability"]
            assert terms
            assert all(math.copysign(1.0, t.value) == math.copysign(1.0, reliability) for t in terms)


_DECIDE = """
from nexa.contracts import codec
from nexa.contracts.node import RuntimeKind
from nexa.contracts.placement import PlacementPolicy
from nexa.control.deployments.scheduler import place
from tests.support.scheduler import GIB, lab, vllm

for policy in PlacementPolicy:
    req = vllm(replicas=5, policy=policy, data_classes=("public", "internal", "secret"), arch="arm64")
    print(codec.dumps(codec.api, place(lab(), req)))
    req = vllm(replicas=3, policy=policy, node_selector={"gpu": "b200", "zone": "a", "rack": "7"})
    print(codec.dumps(codec.api, place(lab(), req)))
print(codec.dumps(codec.api, place(lab(), vllm(memory_bytes=500 * GIB, runtime=RuntimeKind.SIM))))
"""


@pytest.mark.slow
def test_decisions_do_not_depend_on_string_hashing() -> None:
    # Sets and dicts of strings iterate in an order that changes with PYTHONHASHSEED.
    root = Path(__file__).resolve().parents[2]
    outputs = {
        subprocess.run(
            [sys.executable, "-c", _DECIDE],
            cwd=root,
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        for seed in ("1", "2", "3")
    }
    assert len(outputs) == 1


def test_bad_requests_and_snapshots_are_refused() -> None:
    with pytest.raises(ValueError, match="twice"):
        place([*lab(), by_id(lab(), "cpu-1")], vllm())
    with pytest.raises(ValueError, match="replicas"):
        vllm(replicas=0)
    with pytest.raises(ValueError, match="KEY=VALUE"):
        vllm(license_allowance="allowed")
    with pytest.raises(ValueError, match="reliability"):
        attrs.evolve(by_id(lab(), "cpu-1"), reliability=1.5)
    with pytest.raises(ValueError, match="free_gpus"):
        attrs.evolve(by_id(lab(), "l40s-1"), free_gpus=("a", "b", "c"))
