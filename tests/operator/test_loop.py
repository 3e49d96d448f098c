"""The rollout state machine, driven step by step against a simulated cluster."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

import pytest

from epd_engine.config import Method, Role
from epd_engine.contracts.plan import Plan
from epd_operator.api.spec import EPDDeploymentSpec, PlanStatus
from epd_operator.kube import manifests as r
from epd_operator.planning.choice import (
    WorkloadStats,
    choose_plan,
    heuristic_plan,
    workload_shift_percent,
)
from epd_operator.rollout.state_machine import (
    ALL_STAGES,
    Decision,
    Observed,
    ObservedPool,
    RouterView,
    rollout_step,
    stages_served,
)
from tests.operator.conftest import make_owner, make_spec_dict, plan_and_ran

OLD = Plan(method=Method.E_P_D, pools={Role.E: 1, Role.P: 2, Role.D: 1})
NEW = Plan(method=Method.EP_D, pools={Role.EP: 2, Role.D: 2})
T0 = datetime(2026, 1, 1, tzinfo=UTC)


@dataclass
class FakeCluster:
    """Simulated pools and one router (no cluster or process here: this tests the pure state
    machine; test_rollout_driver.py runs it against real router processes).

    Pools become Ready one step after creation (if they fit ``capacity_gpus``). The router
    applies a routing change at once when ``reachable`` and reports it back on the next read,
    as the driver's PUT-then-read does; ``in_flight`` is what it reports per pool.
    """

    pools: dict[str, ObservedPool] = field(default_factory=dict)
    routing: frozenset[str] | None = None  # the router's; None: a fresh router (all pools)
    recorded: frozenset[str] = frozenset()  # status.activePools
    draining_since: datetime | None = None
    now: datetime = T0
    in_flight: dict[str, int] = field(default_factory=dict)
    reachable: bool = True
    capacity_gpus: int = 100

    def observe(self) -> Observed:
        routing = {"router-0": self.routing} if self.reachable else {}
        view = RouterView(("router-0",), routing, dict(self.in_flight) if self.reachable else {})
        return Observed(dict(self.pools), view, self.draining_since, self.now, self.recorded)

    def apply(self, d: Decision) -> None:
        for name, p in list(self.pools.items()):  # last step's pools are Ready now (if they fit)
            if not p.unschedulable:
                self.pools[name] = ObservedPool(p.name, p.role, p.replicas, p.replicas, p.gpus)
        for p in d.create:
            used = sum(x.gpus for n, x in self.pools.items() if n != p.name)
            stuck = (
                "0/4 nodes are available: 4 Insufficient nvidia.com/gpu."
                if used + p.gpus > self.capacity_gpus
                else ""
            )
            ready = self.pools[p.name].ready if p.name in self.pools else 0
            self.pools[p.name] = ObservedPool(p.name, p.role, p.replicas, ready, p.gpus, stuck)
        for name, n in d.shrink.items():  # the removed instances drain and go
            p = self.pools[name]
            self.pools[name] = ObservedPool(
                name, p.role, n, min(p.ready, n), p.gpus // p.replicas * n, p.unschedulable
            )
        for name in d.delete:
            del self.pools[name]
        if self.reachable and d.route_to and d.route_to != self.routing:
            self.routing = d.route_to
        if self.reachable and self.routing is not None:
            self.recorded = self.routing
        self.draining_since = d.draining_since
        self.now += timedelta(seconds=1)


@dataclass(frozen=True)
class Step:
    pools: dict[str, ObservedPool]  # after the step
    routed: set[str]
    progressing: str
    ready: str

    @property
    def existing(self) -> set[str]:
        return set(self.pools)


def run(
    cluster: FakeCluster,
    plan: Plan,
    budget: int = 8,
    timeout_s: int = 3,
    steps: int = 12,
    history: list[Step] | None = None,
) -> list[Decision]:
    """Run ``steps`` reconciles (settle time 1 s: one step)."""
    desired = r.pool_specs(make_owner(gpuBudget=budget), plan)
    out = []
    for _ in range(steps):
        d = rollout_step(desired, cluster.observe(), budget, timeout_s, settle_s=1)
        out.append(d)
        cluster.apply(d)
        assert sum(p.gpus for p in cluster.pools.values()) <= budget, "GPU budget exceeded"
        if history is not None:
            history.append(
                Step(
                    dict(cluster.pools),
                    set(cluster.routing or ()),
                    d.conditions["Progressing"].reason,
                    d.conditions["Ready"].reason,
                )
            )
    return out


def names(plan: Plan, budget: int = 8) -> set[str]:
    return {p.name for p in r.pool_specs(make_owner(gpuBudget=budget), plan)}


def assert_never_cuts_service(history: list[Step]) -> None:
    """Routing never empty and never missing a stage, only to pools that exist and are Ready."""
    for step in history:
        assert step.routed, "the router was left with no pool"
        assert step.routed <= step.existing
        served = stages_served(frozenset(step.routed), step.pools)
        assert served == ALL_STAGES, f"routing {sorted(step.routed)} misses a stage"


def test_first_rollout_creates_then_routes_when_ready() -> None:
    cluster = FakeCluster()
    steps = run(cluster, OLD)
    assert {p.name for p in steps[0].create} == names(OLD)
    switch = next(i for i, d in enumerate(steps) if d.route_to)
    assert all(d.conditions["Ready"].status == "False" for d in steps[:switch])
    assert steps[switch].route_to == names(OLD)
    assert steps[-1].conditions["Ready"].reason == "AllPoolsReady"
    assert steps[-1].conditions["Progressing"].reason == "RolloutComplete"
    assert cluster.routing == names(OLD)


def test_plan_change_is_blue_green_then_drains_when_nothing_is_in_flight() -> None:
    cluster = FakeCluster()
    run(cluster, OLD, steps=3)
    history: list[Step] = []
    run(cluster, NEW, timeout_s=1000, history=history)
    old, new = names(OLD), names(NEW)
    assert_never_cuts_service(history)
    for step in history:
        assert step.routed in (old, new)  # room for both: one switch from one plan to the other
    switch = next(i for i, step in enumerate(history) if step.routed == new)
    assert all(old <= step.existing for step in history[: switch + 1])
    reasons = [step.progressing for step in history]
    assert reasons[0] == "WaitingForPools" and "Draining" in reasons
    assert reasons[-1] == "RolloutComplete"
    assert set(cluster.pools) == new


def test_old_pools_are_deleted_only_after_the_switch_is_read_back_defect_same_pass() -> None:
    """Defect: in-flight was read before the switch in the same pass, so an old pool showing
    0 was deleted in the very pass that switched away from it. Now the deletion needs a read in
    which the router already routes elsewhere, a settle time, and no request in flight."""
    cluster = FakeCluster()
    run(cluster, OLD, steps=3)
    desired = r.pool_specs(make_owner(), NEW)
    d = rollout_step(desired, cluster.observe(), 8, 1000, settle_s=0)
    while d.route_to != names(NEW):  # until the pass that switches
        assert not d.delete
        cluster.apply(d)
        d = rollout_step(desired, cluster.observe(), 8, 1000, settle_s=0)
    assert cluster.routing == names(OLD)
    assert not d.delete, "deleted in the pass that switches away from it (read before switch)"
    cluster.apply(d)
    cluster.in_flight = {n: 1 for n in names(OLD)}
    steps = run(cluster, NEW, timeout_s=1000, steps=4)
    assert not any(s.delete for s in steps)
    assert steps[-1].conditions["Progressing"].reason == "Draining"
    assert "1 in flight" in steps[-1].conditions["Progressing"].message
    cluster.in_flight = {}
    steps = run(cluster, NEW, timeout_s=1000, steps=2)
    assert any(e.reason == "Drained" for e in steps[0].events)
    assert set(cluster.pools) == names(NEW)


def test_a_draining_pool_is_kept_while_another_draining_pool_holds_requests() -> None:
    """Defect (seen under load, EP+D -> EPD): the old D pool showed 0 in flight and was
    deleted while the old EP pool still held requests it had offered to that D instance."""
    cluster = FakeCluster()
    run(cluster, OLD, steps=3)
    e_pool = next(n for n in names(OLD) if "-e-" in n)
    cluster.in_flight = {e_pool: 2}
    steps = run(cluster, NEW, timeout_s=1000, steps=6)
    assert not any(s.delete for s in steps)
    assert names(OLD) <= set(cluster.pools)
    cluster.in_flight = {}
    run(cluster, NEW, timeout_s=1000, steps=2)
    assert set(cluster.pools) == names(NEW)


def test_unreachable_router_confirms_nothing_and_deletes_nothing() -> None:
    """Defect: a failed routing PUT was recorded as done and the old pools were then deleted
    by the drain timeout, blind. Now status keeps the last confirmed routing and no old pool
    goes while the router cannot confirm the switch."""
    cluster = FakeCluster()
    run(cluster, OLD, steps=3)
    cluster.reachable = False
    steps = run(cluster, NEW, timeout_s=1, steps=8)
    assert names(OLD) <= set(cluster.pools)
    assert cluster.recorded == names(OLD)
    assert not any(s.delete for s in steps)
    last = steps[-1].conditions
    assert last["Progressing"].reason == "RouterUnreachable"
    assert (last["Ready"].status, last["Ready"].reason) == ("False", "RouterUnreachable")
    cluster.reachable = True
    run(cluster, NEW, timeout_s=1, steps=6)
    assert set(cluster.pools) == names(NEW) and cluster.routing == names(NEW)


def test_budget_4_for_e_p_d_to_ep_d_waits_and_never_routes_nothing() -> None:
    """Defect: E+P+D 1E2P1D -> EP+D 2EP2D at budget 4 routed to no pool (PUT []) while Ready
    stayed True. Nothing can start without a stage going unserved: wait, and say what it takes."""
    cluster = FakeCluster()
    run(cluster, OLD, budget=4, steps=3)
    history: list[Step] = []
    steps = run(cluster, NEW, budget=4, steps=6, history=history)
    assert_never_cuts_service(history)
    assert cluster.routing == names(OLD, 4) and set(cluster.pools) == names(OLD, 4)
    progressing = steps[-1].conditions["Progressing"]
    assert progressing.reason == "BudgetBlocksRollout"
    # one EP instance beside the old pools (the D pool is the same pool, resized in place)
    assert "With gpuBudget 5" in progressing.message
    assert steps[-1].conditions["Ready"].status == "True"


def test_budget_5_for_e_p_d_to_ep_d_goes_in_steps_serving_every_stage() -> None:
    """Defect: at budget 5 only the D pool stayed routed (every new request got a 503). Now a
    first EP instance starts in the free GPU, takes over encode and prefill, E and P drain,
    then the rest of the new plan starts and the router switches."""
    cluster = FakeCluster()
    run(cluster, OLD, budget=5, steps=3)
    history: list[Step] = []
    steps = run(cluster, NEW, budget=5, steps=20, history=history)
    assert_never_cuts_service(history)
    assert set(cluster.pools) == names(NEW, 5) and cluster.routing == names(NEW, 5)
    assert "SteppedRollout" in {step.progressing for step in history}
    assert any(e.reason == "SteppedRollout" for d in steps for e in d.events)
    assert all(step.ready != "PoolsNotReady" for step in history)
    assert steps[-1].conditions["Progressing"].reason == "RolloutComplete"


PLANS = [
    Plan(method=Method.E_P_D, pools={Role.E: 1, Role.P: 1, Role.D: 2}),
    Plan(method=Method.EP_D, pools={Role.EP: 2, Role.D: 2}),
    Plan(method=Method.EPD, pools={Role.EPD: 4}),
    Plan(method=Method.E_PD, pools={Role.E: 1, Role.PD: 3}),
    Plan(method=Method.ED_P, pools={Role.ED: 3, Role.P: 1}),
    Plan(method=Method.E_P_D, pools={Role.E: 1, Role.P: 2, Role.D: 1}),
]


@pytest.mark.parametrize("budget", [4, 5, 6, 8])
def test_every_method_switch_keeps_every_stage_served(budget: int) -> None:
    """Through E+P+D -> EP+D -> EPD -> E+PD -> ED+P -> E+P+D (4 instances each) at budgets
    from no headroom to room for both: never a stage unserved, never over budget; each switch
    completes, or (only below 6 GPUs: 4 old + one instance of each of two new pools) waits
    saying BudgetBlocksRollout."""
    cluster = FakeCluster()
    run(cluster, PLANS[0], budget=budget, steps=3)
    for plan in PLANS[1:]:
        history: list[Step] = []
        steps = run(cluster, plan, budget=budget, steps=25, history=history)
        assert_never_cuts_service(history)
        last = steps[-1].conditions["Progressing"].reason
        if last == "BudgetBlocksRollout" and budget < 6:
            assert steps[-1].conditions["Ready"].status == "True"
            return  # waits for more GPUs, still serving the plan it has
        assert last == "RolloutComplete", history[-3:]
        assert set(cluster.pools) == names(plan, budget)


def test_unschedulable_pools_are_degraded_with_reason() -> None:
    cluster = FakeCluster(capacity_gpus=2)
    steps = run(cluster, OLD, steps=3)
    degraded = steps[-1].conditions["Degraded"]
    assert (degraded.status, degraded.reason) == ("True", "InsufficientGPUs")
    assert "Insufficient nvidia.com/gpu" in degraded.message


def test_choose_plan_fixed_and_auto() -> None:
    fixed = EPDDeploymentSpec.model_validate(make_spec_dict())
    assert choose_plan(fixed, None, None, None, 0).plan.describe() == "E+P+D 1E2P1D"
    auto = EPDDeploymentSpec.model_validate(make_spec_dict(disaggregation={"mode": "Auto"}))
    first, ran = plan_and_ran(choose_plan(auto, None, None, None, 0))
    assert ran
    assert first.num_instances <= 8
    current = PlanStatus.from_plan(first, 1)
    stats = WorkloadStats(500, 2.0, 100.0, 3.0, 50.0)
    assert plan_and_ran(choose_plan(auto, current, stats, None, 10)) == (first, False)  # too soon
    replanned, _ = plan_and_ran(choose_plan(auto, current, stats, None, 10_000))
    assert replanned.num_instances <= 8 and replanned.pools[Role.E] > first.pools[Role.E]


def test_auto_replans_when_slo_attainment_drops() -> None:
    auto = EPDDeploymentSpec.model_validate(make_spec_dict(disaggregation={"mode": "Auto"}))
    current = PlanStatus.from_plan(heuristic_plan(auto, None), 1)
    before = WorkloadStats(500, 2.0, slo_attainment=0.95)
    ok = WorkloadStats(500, 2.0, mean_images=4.0, slo_attainment=0.95)
    bad = WorkloadStats(500, 2.0, mean_images=4.0, slo_attainment=0.5)
    same, ran = plan_and_ran(choose_plan(auto, current, ok, before, 10_000))
    assert not ran
    assert same.describe() == current.to_plan().describe()  # no shift, SLOs met: keep
    replanned, _ = plan_and_ran(choose_plan(auto, current, bad, before, 10_000))
    assert replanned.pools[Role.E] > current.to_plan().pools[Role.E]


def test_auto_replans_at_once_when_the_gpu_budget_changes() -> None:
    """A lower budget must never keep a plan that no longer fits; a higher one is used."""
    big = EPDDeploymentSpec.model_validate(
        make_spec_dict(gpuBudget=16, disaggregation={"mode": "Auto"})
    )
    current = PlanStatus.from_plan(heuristic_plan(big, None), 1)
    assert current.to_plan().num_instances == 16
    kept, ran = plan_and_ran(choose_plan(big, current, None, None, 0))
    assert not ran and kept.num_instances == 16
    small = big.model_copy(update={"gpu_budget": 4})
    shrunk, ran = plan_and_ran(
        choose_plan(small, current, None, None, 0)
    )  # interval not reached: still
    assert ran and shrunk.num_instances == 4
    grown, ran = plan_and_ran(choose_plan(big, PlanStatus.from_plan(shrunk, 2), None, None, 0))
    assert ran and grown.num_instances == 16


def test_heuristic_plan_small_budgets_and_shift() -> None:
    one = EPDDeploymentSpec.model_validate(
        make_spec_dict(gpuBudget=1, disaggregation={"mode": "Auto"})
    )
    assert heuristic_plan(one, None).method is Method.EPD
    a = WorkloadStats(100, 1.0, 100.0, 1.0, 100.0)
    assert workload_shift_percent(a, a) == 0
    assert workload_shift_percent(a, WorkloadStats(100, 1.5, 100.0, 1.0, 100.0)) == 50


def test_a_count_change_resizes_pools_in_place_without_a_switch() -> None:
    """The defect: a pool's replica count was in its name, so 2 -> 4 P instances started a
    new pool of 4 beside the old 2 (6 P GPUs held until the old drained) and switched the
    router to it; 4 -> 1 did the same the other way. Now the pool keeps its name: it grows
    within the budget, shrinks at once (its removed instances drain), routing never moves."""
    cluster = FakeCluster()
    run(cluster, OLD, budget=8, steps=3)
    before = set(cluster.pools)
    wider = Plan(method=Method.E_P_D, pools={Role.E: 1, Role.P: 4, Role.D: 1})
    history: list[Step] = []
    grown = run(cluster, wider, budget=8, steps=3, history=history)
    assert set(cluster.pools) == before and cluster.routing == frozenset(before)
    p_pool = next(p for p in r.pool_specs(make_owner(), wider) if p.role == Role.P)
    assert cluster.pools[p_pool.name].replicas == 4
    assert max(sum(p.gpus for p in s.pools.values()) for s in history) == 6
    assert [e.reason for d in grown for e in d.events] == ["ScalingUp"]
    narrower = Plan(method=Method.E_P_D, pools={Role.E: 1, Role.P: 1, Role.D: 1})
    shrunk = run(cluster, narrower, budget=8, steps=3, history=history)
    assert_never_cuts_service(history)
    assert set(cluster.pools) == before and cluster.routing == frozenset(before)
    assert sum(p.gpus for p in cluster.pools.values()) == 3
    assert [e.reason for d in shrunk for e in d.events] == ["ScalingDown"]
    assert "3 removed leave routing" in shrunk[0].events[0].message
    assert all(not d.delete for d in grown + shrunk)
    assert shrunk[-1].conditions["Progressing"].reason == "RolloutComplete"


def test_a_ratio_change_on_a_full_budget_shrinks_first_then_grows() -> None:
    """1E 2P 1D -> 2E 1P 1D with every GPU in use: the P pool gives one instance back, then
    the E pool takes it; the budget is never exceeded and every stage stays served."""
    cluster = FakeCluster()
    run(cluster, OLD, budget=4, steps=3)
    history: list[Step] = []
    flipped = Plan(method=Method.E_P_D, pools={Role.E: 2, Role.P: 1, Role.D: 1})
    steps = run(cluster, flipped, budget=4, steps=4, history=history)
    assert_never_cuts_service(history)
    assert {p.role: p.replicas for p in cluster.pools.values()} == {Role.E: 2, Role.P: 1, Role.D: 1}
    assert [e.reason for d in steps for e in d.events] == ["ScalingDown", "ScalingUp"]
    assert steps[-1].conditions["Progressing"].reason == "RolloutComplete"
