"""The rollout state machine, driven step by step against a simulated cluster."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from epd_engine.config import Method, Role
from epd_engine.plan import Plan
from epd_operator import resources as r
from epd_operator.loop import (
    Decision,
    Observed,
    ObservedPool,
    WorkloadStats,
    choose_plan,
    heuristic_plan,
    rollout_step,
    workload_shift_percent,
)
from epd_operator.spec import EPDDeploymentSpec, PlanStatus
from tests.operator.conftest import make_owner, make_spec_dict

OLD = Plan(method=Method.E_P_D, pools={Role.E: 1, Role.P: 2, Role.D: 1})
NEW = Plan(method=Method.EP_D, pools={Role.EP: 2, Role.D: 2})
T0 = datetime(2026, 1, 1, tzinfo=UTC)


@dataclass
class FakeCluster:
    """Pools become Ready one step after creation; the router may or may not answer."""

    pools: dict[str, ObservedPool] = field(default_factory=dict)
    active: frozenset[str] = frozenset()
    draining_since: datetime | None = None
    now: datetime = T0
    in_flight: dict[str, int] | None = None
    capacity_gpus: int = 100

    def observe(self) -> Observed:
        return Observed(
            dict(self.pools), self.active, self.draining_since, self.now, self.in_flight
        )

    def apply(self, d: Decision) -> None:
        for name, p in list(self.pools.items()):  # last step's pools are Ready now (if they fit)
            if not p.unschedulable:
                self.pools[name] = ObservedPool(p.name, p.role, p.replicas, p.replicas, p.gpus)
        for p in d.create:
            used = sum(x.gpus for x in self.pools.values())
            stuck = (
                "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."
                if used + p.gpus > self.capacity_gpus
                else ""
            )
            self.pools[p.name] = ObservedPool(p.name, p.role, p.replicas, 0, p.gpus, stuck)
        for name in d.delete:
            del self.pools[name]
        self.active = d.route_to
        self.draining_since = d.draining_since
        self.now += timedelta(seconds=1)


def run(
    cluster: FakeCluster,
    plan: Plan,
    budget: int = 8,
    timeout_s: int = 3,
    steps: int = 12,
    history: list[tuple[set[str], set[str], str]] | None = None,
) -> list[Decision]:
    """Run ``steps`` reconciles; ``history`` gets (pools after, routed, Progressing reason)."""
    desired = r.pool_specs(make_owner(gpuBudget=budget), plan)
    out = []
    for _ in range(steps):
        d = rollout_step(desired, cluster.observe(), budget, timeout_s)
        out.append(d)
        cluster.apply(d)
        if history is not None:
            history.append(
                (set(cluster.pools), set(d.route_to), d.conditions["Progressing"].reason)
            )
    return out


def names(plan: Plan, budget: int = 8) -> set[str]:
    return {p.name for p in r.pool_specs(make_owner(gpuBudget=budget), plan)}


def test_first_rollout_creates_then_routes_when_ready() -> None:
    cluster = FakeCluster()
    steps = run(cluster, OLD)
    assert {p.name for p in steps[0].create} == names(OLD)
    switch = next(i for i, d in enumerate(steps) if d.route_to)
    assert all(d.conditions["Ready"].status == "False" for d in steps[:switch])
    assert steps[switch].route_to == names(OLD)
    assert steps[-1].conditions["Ready"].reason == "AllPoolsReady"
    assert steps[-1].conditions["Progressing"].reason == "RolloutComplete"
    assert cluster.active == names(OLD)


def test_plan_change_is_blue_green_then_drain_by_timeout() -> None:
    cluster = FakeCluster()
    run(cluster, OLD, steps=3)
    history: list[tuple[set[str], set[str], str]] = []
    run(cluster, NEW, timeout_s=3, history=history)
    old, new = names(OLD), names(NEW)
    # the router only ever points at one complete, existing plan
    for existing, routed, _ in history:
        assert routed in (old, new)
        assert routed <= existing
    switch = next(i for i, (_, routed, _) in enumerate(history) if routed == new)
    assert all(old <= existing for existing, _, _ in history[: switch + 1]), (
        "old pools kept until switch"
    )
    reasons = [reason for _, _, reason in history]
    assert (
        reasons[0] == "WaitingForPools"
        and "Draining" in reasons
        and reasons[-1] == "RolloutComplete"
    )
    assert set(cluster.pools) == new


def test_drain_waits_for_router_in_flight() -> None:
    cluster = FakeCluster()
    run(cluster, OLD, steps=3)
    cluster.in_flight = {n: 1 for n in names(OLD)}
    steps = run(cluster, NEW, timeout_s=1000, steps=4)
    assert steps[-1].conditions["Progressing"].reason == "Draining"
    assert "in flight" in steps[-1].conditions["Progressing"].message
    assert names(OLD) <= set(cluster.pools)
    cluster.in_flight = {}
    steps = run(cluster, NEW, timeout_s=1000, steps=2)
    assert any(e.reason == "Drained" for e in steps[0].events)
    assert set(cluster.pools) == names(NEW)


def test_budget_too_small_for_both_plans_says_capacity_drops() -> None:
    cluster = FakeCluster()
    run(cluster, OLD, budget=5, steps=3)
    bigger = Plan(method=Method.EP_D, pools={Role.EP: 2, Role.D: 3})
    steps = run(cluster, bigger, budget=5, timeout_s=2, steps=10)
    assert steps[0].conditions["Progressing"].reason == "BudgetForcesCapacityDrop"
    assert any(e.reason == "CapacityDrop" for e in steps[0].events)
    assert sum(p.gpus for p in cluster.pools.values()) <= 5
    assert set(cluster.pools) == names(bigger, 5)
    assert steps[-1].conditions["Ready"].status == "True"


def test_unschedulable_pools_are_degraded_with_reason() -> None:
    cluster = FakeCluster(capacity_gpus=2)
    steps = run(cluster, OLD, steps=3)
    degraded = steps[-1].conditions["Degraded"]
    assert (degraded.status, degraded.reason) == ("True", "InsufficientGPUs")
    assert "Insufficient nvidia.com/gpu" in degraded.message


def test_choose_plan_fixed_and_auto() -> None:
    fixed = EPDDeploymentSpec.model_validate(make_spec_dict())
    assert choose_plan(fixed, None, None, None, 0)[0].describe() == "E+P+D 1E2P1D"
    auto = EPDDeploymentSpec.model_validate(make_spec_dict(disaggregation={"mode": "Auto"}))
    first, ran = choose_plan(auto, None, None, None, 0)
    assert ran
    assert first.num_instances <= 8
    current = PlanStatus.from_plan(first, 1)
    stats = WorkloadStats(500, 2.0, 100.0, 3.0, 50.0)
    assert choose_plan(auto, current, stats, None, 10) == (first, False)  # too soon
    replanned, _ = choose_plan(auto, current, stats, None, 10_000)
    assert replanned.num_instances <= 8 and replanned.pools[Role.E] > first.pools[Role.E]


def test_auto_replans_when_slo_attainment_drops() -> None:
    auto = EPDDeploymentSpec.model_validate(make_spec_dict(disaggregation={"mode": "Auto"}))
    current = PlanStatus.from_plan(heuristic_plan(auto, None), 1)
    before = WorkloadStats(500, 2.0, slo_attainment=0.95)
    ok = WorkloadStats(500, 2.0, mean_images=4.0, slo_attainment=0.95)
    bad = WorkloadStats(500, 2.0, mean_images=4.0, slo_attainment=0.5)
    same, ran = choose_plan(auto, current, ok, before, 10_000)
    assert not ran
    assert same.describe() == current.to_plan().describe()  # no shift, SLOs met: keep
    replanned, _ = choose_plan(auto, current, bad, before, 10_000)
    assert replanned.pools[Role.E] > current.to_plan().pools[Role.E]


def test_auto_replans_at_once_when_the_gpu_budget_changes() -> None:
    """A lower budget must never keep a plan that no longer fits; a higher one is used."""
    big = EPDDeploymentSpec.model_validate(
        make_spec_dict(gpuBudget=16, disaggregation={"mode": "Auto"})
    )
    current = PlanStatus.from_plan(heuristic_plan(big, None), 1)
    assert current.to_plan().num_instances == 16
    kept, ran = choose_plan(big, current, None, None, 0)
    assert not ran and kept.num_instances == 16
    small = big.model_copy(update={"gpu_budget": 4})
    shrunk, ran = choose_plan(small, current, None, None, 0)  # interval not reached: still
    assert ran and shrunk.num_instances == 4
    grown, ran = choose_plan(big, PlanStatus.from_plan(shrunk, 2), None, None, 0)
    assert ran and grown.num_instances == 16


def test_heuristic_plan_small_budgets_and_shift() -> None:
    one = EPDDeploymentSpec.model_validate(
        make_spec_dict(gpuBudget=1, disaggregation={"mode": "Auto"})
    )
    assert heuristic_plan(one, None).method is Method.EPD
    a = WorkloadStats(100, 1.0, 100.0, 1.0, 100.0)
    assert workload_shift_percent(a, a) == 0
    assert workload_shift_percent(a, WorkloadStats(100, 1.5, 100.0, 1.0, 100.0)) == 50
