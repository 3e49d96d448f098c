"""Placement groups in the planner (spec.placement.mode: Groups): each slice of the plan is
one pod, so a hand-off between members of a slice pays the in-pod link (shm / cuda_ipc) and
any other the cross-pod one (tcp); a source prefers its group's target within the load bound
(contracts/group_locality.py), as the engine does."""

from __future__ import annotations

import dataclasses

from epd_engine.config import SLO, Method, Role
from epd_engine.contracts.plan import Plan
from epd_engine.profiler.candidates import Candidate
from epd_engine.profiler.cost_model import FittedCostModel
from epd_engine.profiler.evaluate import Evaluator
from epd_engine.profiler.links import LinkCoeffs
from epd_engine.profiler.placement import instance_groups
from epd_engine.profiler.simulator import Simulator

from .factories import make_trace, toy_cost_model

POD = LinkCoeffs(latency_s=0.0001, bytes_per_s=5e9)  # shm inside a group pod
PODS = LinkCoeffs(latency_s=0.020, bytes_per_s=1e6)  # tcp between pods, far slower
LOOSE = SLO(ttft_s=100, tpot_s=10)


def grouped_cost() -> FittedCostModel:
    return dataclasses.replace(toy_cost_model(), links={"shm": POD, "tcp": PODS}).for_groups("auto")


def test_slices_are_groups_and_instances_beyond_them_pods_of_their_own() -> None:
    # 2 slices (the smallest pool); P's third instance stays in P's Deployment
    assert instance_groups([(Role.E, 2), (Role.P, 3), (Role.D, 2)]) == [0, 1, 0, 1, 2, 0, 1]
    assert instance_groups([(Role.EP, 1), (Role.D, 2)]) == [0, 0, 1]


def test_groups_charge_the_in_pod_link_inside_and_tcp_across() -> None:
    cost, stored = grouped_cost(), toy_cost_model().migration
    assert cost.transfer_backend == "shm"
    for kind in ("image", "kv"):
        assert cost.migration_s(kind, 100) == stored.over(POD).at(kind, 100)
        assert cost.migration_s(kind, 100, remote=True) == stored.over(PODS).at(kind, 100)


def _run(plan: Plan, rate_rps: float, grouped: bool = True) -> tuple[int, int, float]:
    """(remote pulls, all pulls, mean KV migration seconds) of a trace."""
    result = Simulator(plan, grouped_cost(), LOOSE, grouped=grouped).run(
        make_trace(num=40, rate_rps=rate_rps)
    )
    kv = [r.stage_s["migration_kv"] for r in result.results if r.stage_s is not None]
    return result.num_remote_pulls, 2 * len(kv), sum(kv) / len(kv)


def test_hand_offs_stay_in_their_group_while_loads_allow() -> None:
    plan = Plan(method=Method.E_P_D, pools={Role.E: 2, Role.P: 2, Role.D: 2})
    # busy enough that both slices take requests in (the plain least-loaded choice would
    # send about half of the hand-offs across), light enough that no peer passes the bound
    remote, pulls, kv_s = _run(plan, rate_rps=50)
    assert pulls and remote == 0
    assert kv_s < 0.020  # never the cross-pod latency
    # the same plan ungrouped (the Pools model: one link for all): no cross charge
    assert _run(plan, rate_rps=50, grouped=False)[0] == 0


def test_a_pool_beyond_the_slices_is_reached_across_pods_and_charged_for_it() -> None:
    # one slice (E, P, D) and a second P in its own pod: under load some requests go there,
    # each paying tcp twice (E -> P1, P1 -> D)
    plan = Plan(method=Method.E_P_D, pools={Role.E: 1, Role.P: 2, Role.D: 1})
    remote, pulls, _ = _run(plan, rate_rps=200)
    assert 0 < remote < pulls
    assert remote % 2 == 0


def test_the_plan_search_sees_the_groups() -> None:
    """The evaluator the search uses passes grouping on: the same E+P+D plan at the same rate
    is faster in group pods than as pools whose every hand-off crosses pods over tcp."""
    candidate = Candidate(Method.E_P_D, (1, 1, 1))
    records = make_trace(num=20, rate_rps=5)
    pods = dataclasses.replace(toy_cost_model(), links={"shm": POD, "tcp": PODS})
    ttft = {}
    for grouped, cost in ((True, grouped_cost()), (False, pods.for_backend("auto", False))):
        point = Evaluator(records, cost, LOOSE, grouped=grouped).point(candidate, 5.0)
        assert point.summary is not None
        ttft[grouped] = point.summary.ttft.mean_s
    assert ttft[False] > ttft[True] + 0.02  # at least the cross-pod latency per pull
