"""The simulator's indexed routing picks exactly what reading every instance's load would.

``sim_routing.IndexedPool`` keeps each pool's load order in a heap instead of reading every
instance per pick. These tests run whole simulations with it and with ``ScannedPool`` (the
literal reading) and require the same result to the last float: every request's tokens,
times, path and stage seconds, the steps, the remote pulls, the prefix hits and the
affinity policy's counts.
"""

from __future__ import annotations

import pytest

from epd_engine.config import SLO, Method, Role
from epd_engine.contracts.affinity import PrefixAffinity
from epd_engine.contracts.plan import Plan
from epd_engine.contracts.routing_policy import RoutingPolicy
from epd_engine.contracts.trace import TraceRecord
from epd_engine.profiler.reference import reference_cost_model
from epd_engine.profiler.simulator import SimResult, Simulator
from epd_engine.workload.arrivals import ArrivalSpec
from epd_engine.workload.distributions import SizeChoice, Uniform
from epd_engine.workload.generators import WorkloadShape, synthesize

# Issue 19's mixed traffic with shorter outputs (a test must stay cheap), fast enough that
# queues form and loads tie and differ.
MIXED = WorkloadShape(
    "indexed-routing-mixed",
    "0-3 images, prompts 20-600, outputs 2-60",
    "tests",
    prompt_tokens=Uniform(20, 600),
    output_tokens=Uniform(2, 60),
    image_sizes=SizeChoice([(336, 336), (640, 480), (1024, 768)]),
    images_per_request=Uniform(0, 3),
)
TRACE = synthesize(MIXED, 240, ArrivalSpec("poisson", 80.0), seed=7)
SLO_MIXED = SLO(ttft_s=0.5, tpot_s=0.04)
PLANS = [
    Plan(method=Method.E_P_D, pools={Role.E: 2, Role.P: 3, Role.D: 4}),
    Plan(method=Method.EP_D, pools={Role.EP: 5, Role.D: 3}),
    Plan(method=Method.ED_P, pools={Role.ED: 6, Role.P: 2}),
    Plan(method=Method.E_PD, pools={Role.E: 2, Role.PD: 6}),
    Plan(method=Method.EPD, pools={Role.EPD: 7}),
]


def _both(
    plan: Plan,
    trace: list[TraceRecord],
    policy: type[RoutingPolicy] | None = None,
    instances_per_node: int | None = None,
    grouped: bool = False,
) -> tuple[SimResult, SimResult, list[RoutingPolicy | None]]:
    results, policies = [], []
    for indexed in (True, False):
        chosen = policy() if policy is not None else None
        simulator = Simulator(
            plan,
            reference_cost_model(),
            SLO_MIXED,
            policy=chosen,
            instances_per_node=instances_per_node,
            indexed_routing=indexed,
            grouped=grouped,
        )
        results.append(simulator.run(trace))
        policies.append(chosen)
    return results[0], results[1], policies


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.method.value)
def test_least_loaded_picks_as_the_scan(plan: Plan) -> None:
    indexed, scanned, _ = _both(plan, TRACE)
    assert indexed.num_steps > 0 and not any(r.error for r in scanned.results)
    assert indexed == scanned


@pytest.mark.parametrize("plan", PLANS[:2], ids=lambda p: p.method.value)
def test_local_targets_across_nodes_as_the_scan(plan: Plan) -> None:
    indexed, scanned, _ = _both(plan, TRACE, instances_per_node=3)
    assert scanned.num_remote_pulls > 0
    assert indexed == scanned


@pytest.mark.parametrize("plan", [PLANS[0], PLANS[2]], ids=lambda p: p.method.value)
def test_group_targets_as_the_scan(plan: Plan) -> None:
    trace = _with_prefixes(TRACE)
    indexed, scanned, _ = _both(plan, trace, PrefixAffinity, grouped=True)
    assert scanned.num_remote_pulls > 0
    assert indexed == scanned


def _with_prefixes(trace: list[TraceRecord]) -> list[TraceRecord]:
    """Shared first blocks (a few popular prefixes) and some conversations."""
    out = []
    for index, record in enumerate(trace):
        update: dict[str, object] = {"hash_ids": (index % 4, 100 + index % 9)}
        if index % 3 == 0:
            update["session_id"] = f"s{index % 11}"
        out.append(record.model_copy(update=update))
    return out


@pytest.mark.parametrize("plan", [PLANS[0], PLANS[2], PLANS[4]], ids=lambda p: p.method.value)
def test_prefix_affinity_picks_as_the_scan(plan: Plan) -> None:
    trace = _with_prefixes(TRACE)
    indexed, scanned, policies = _both(plan, trace, PrefixAffinity)
    assert indexed == scanned
    counts = [p.counts for p in policies if isinstance(p, PrefixAffinity)]
    assert counts[0] == counts[1] and sum(counts[0].values()) >= len(trace)
    assert any(scanned.prefix_hit_tokens.values())
