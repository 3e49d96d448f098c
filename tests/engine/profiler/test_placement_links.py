"""The planner charges each migration at the link its placement gives: instances on one node
over the node's link (``migration``), pairs on two nodes over the network
(``remote_migration``, from ``links["network"]``); the simulator places instances as the
operator's partner affinity fills nodes (profiler/placement.py) and sources prefer a target on
their own node (contracts/node_locality.py)."""

from __future__ import annotations

import dataclasses
from collections import Counter

import pytest

from epd_engine.config import SLO, Method, Role
from epd_engine.contracts.plan import Plan
from epd_engine.profiler.candidates import Candidate
from epd_engine.profiler.cost_model import FittedCostModel
from epd_engine.profiler.evaluate import Evaluator
from epd_engine.profiler.links import NETWORK_LINK, LinkCoeffs
from epd_engine.profiler.placement import instance_nodes
from epd_engine.profiler.simulator import Simulator

from .factories import make_trace, toy_cost_model

NODE = LinkCoeffs(latency_s=0.0001, bytes_per_s=5e9)  # shm / cuda_ipc / a node's own bridge
NETWORK = LinkCoeffs(latency_s=0.020, bytes_per_s=1e6)  # far slower, so a test can tell
LOOSE = SLO(ttft_s=100, tpot_s=10)


def two_links() -> FittedCostModel:
    model = dataclasses.replace(toy_cost_model(), links={"shm": NODE, NETWORK_LINK: NETWORK})
    return model.for_backend("auto")


def test_nodes_fill_with_a_mix_of_the_pools_in_the_plans_ratio() -> None:
    pools = [(Role.E, 2), (Role.P, 6), (Role.D, 8)]
    nodes = instance_nodes(pools, instances_per_node=8)
    roles = [r for r, n in pools for _ in range(n)]
    per_node = [
        Counter(r for r, node in zip(roles, nodes, strict=True) if node == k) for k in (0, 1)
    ]
    assert per_node == [Counter({Role.E: 1, Role.P: 3, Role.D: 4})] * 2
    assert instance_nodes(pools, None) == [0] * 16  # one host: one node
    assert instance_nodes(pools, 16) == [0] * 16
    assert instance_nodes([(Role.EP, 1), (Role.D, 1)], 1) == [0, 1]
    with pytest.raises(ValueError):
        instance_nodes(pools, 0)


def test_a_migration_between_nodes_pays_the_network_link() -> None:
    cost = two_links()
    assert cost.transfer_backend == "shm"
    assert cost.remote_migration is not None
    assert cost.migration_s("image", 100) == pytest.approx(NODE.latency_s + 100 * 1024 / 5e9)
    assert cost.migration_s("image", 100, remote=True) == pytest.approx(0.020 + 100 * 1024 / 1e6)
    # no network measured: a pair on two nodes is charged as one on one node
    plain = dataclasses.replace(toy_cost_model(), links={"shm": NODE}).for_backend("auto")
    assert plain.remote_migration is None
    assert plain.migration_s("kv", 50, remote=True) == plain.migration_s("kv", 50)
    # saved and loaded with the model
    assert FittedCostModel.from_dict(cost.to_dict()) == cost


def _run(instances_per_node: int | None, plan: Plan) -> tuple[float, int, int]:
    """(mean KV migration seconds, remote pulls, all pulls) of a light trace."""
    result = Simulator(plan, two_links(), LOOSE, instances_per_node=instances_per_node).run(
        make_trace(num=30, rate_rps=5)
    )
    kv = [r.stage_s["migration_kv"] for r in result.results if r.stage_s is not None]
    pulls = 2 * len(kv)  # an image and a KV pull per request under E+P+D
    return sum(kv) / len(kv), result.num_remote_pulls, pulls


def test_the_simulator_charges_each_pair_by_where_its_instances_run() -> None:
    plan = Plan(method=Method.E_P_D, pools={Role.E: 2, Role.P: 2, Role.D: 2})
    one_node_s, remote_none, pulls = _run(None, plan)
    assert remote_none == 0
    # one instance per node: every pull crosses the network
    apart_s, remote_apart, _ = _run(1, plan)
    assert remote_apart == pulls
    assert apart_s > 50 * one_node_s
    # two E+P+D slices, one per node: partners on one node and sources stay on it (load is
    # light, so the bound never sends one across)
    sliced_s, remote_sliced, _ = _run(3, plan)
    assert remote_sliced == 0
    assert sliced_s == pytest.approx(one_node_s, rel=0.2)


def test_the_plan_search_sees_the_placement() -> None:
    """The evaluator the search uses passes the node size on: the same plan at the same rate
    is slower when its pairs cross a slow network."""
    plan = Plan(method=Method.E_P_D, pools={Role.E: 1, Role.P: 1, Role.D: 1})
    candidate = Candidate(plan.method, (1, 1, 1))
    records = make_trace(num=20, rate_rps=5)
    ttft: dict[int | None, float] = {}
    for per_node in (None, 1):
        evaluator = Evaluator(records, two_links(), LOOSE, instances_per_node=per_node)
        point = evaluator.point(candidate, 5.0)
        assert point.summary is not None
        ttft[per_node] = point.summary.ttft.mean_s
    assert ttft[1] > ttft[None] + 0.02  # at least the network's latency per pull
