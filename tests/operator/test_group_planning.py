"""The operator passes the placement mode to the planner: under ``placement.mode: Groups``
the plan search charges a group's hand-offs the in-pod link and the rest tcp."""

from __future__ import annotations

import dataclasses

from epd_engine.profiler.links import LinkCoeffs
from epd_engine.profiler.reference import reference_cost_model
from epd_operator.planning.planner import profiler_proposal
from tests.operator.test_planner import auto_spec, trace


def test_group_pods_plan_over_the_in_pod_link_inside_and_tcp_across() -> None:
    fast, slow = LinkCoeffs(1e-4, 50e9), LinkCoeffs(0.05, 1e8)
    cost = dataclasses.replace(reference_cost_model(), links={"shm": fast, "tcp": slow})
    records = trace("textvqa", 100)
    grouped = auto_spec(gpuBudget=3, placement={"mode": "Groups"})
    proposal = profiler_proposal(grouped, records, cost, "measured")
    assert proposal.plan.reason.endswith(
        "cost model: measured, shm link in a group pod, tcp across"
    )
    pools = profiler_proposal(auto_spec(gpuBudget=3), records, cost, "measured")
    assert pools.plan.reason.endswith("cost model: measured, tcp link")
    # epdctl up runs every instance on one host and ignores placement
    local = profiler_proposal(grouped, records, cost, "measured", same_host=True)
    assert local.plan.reason.endswith("cost model: measured, shm link")
