"""The fast path: an SLO alarm (``alarm``) adds an instance to the bottleneck stage's pool at
once, without waiting for the trace-replay re-plan (the slow path), within ``maxGPUs``.

One instance a decision, to the pool whose role runs the alarmed stage (E when encode
queues, P when prefill does or TTFT misses there, D when TPOT misses; the shared pool of a
combined role such as EP), same method and budgets. It never scales down: a smaller plan
comes only from the slow path, after the stabilisation window. The next re-plan confirms or
corrects the result (``plan_pass`` makes it due).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from epd_engine.config import Role, Stage
from epd_engine.contracts.plan import Plan
from epd_operator.api.spec import EPDDeploymentSpec
from epd_operator.planning.alarm import SloAlarm
from epd_operator.planning.choice import instance_range


@dataclass(frozen=True)
class FastStep:
    alarm: SloAlarm
    role: Role  # the pool grown
    before: Plan
    after: Plan

    @property
    def sizes(self) -> str:
        """E.g. ``P 1 -> 2``."""
        return f"{self.role} {self.before.pools[self.role]} -> {self.after.pools[self.role]}"


def role_running(plan: Plan, stage: Stage) -> Role:
    """The plan's pool that runs ``stage`` (a method covers each stage exactly once)."""
    return next(role for role in plan.pools if role.runs(stage))


def can_grow(spec: EPDDeploymentSpec, plan: Plan) -> bool:
    """Auto mode, and one more instance stays within ``maxGPUs``."""
    return spec.disaggregation.mode == "Auto" and plan.num_ranks < instance_range(spec)[1]


def fast_step(spec: EPDDeploymentSpec, plan: Plan, alarms: Sequence[SloAlarm]) -> FastStep | None:
    """One more instance for the first alarm's stage; None without an alarm, in Fixed mode,
    or when the plan already holds the most instances ``spec.capacity`` allows."""
    if not alarms or not can_grow(spec, plan):
        return None
    alarm = alarms[0]
    role = role_running(plan, alarm.stage)
    if plan.num_ranks + plan.size_of(role) > instance_range(spec)[1]:
        return None  # one more instance of a split pool would not fit
    pools = {**plan.pools, role: plan.pools[role] + 1}
    after = Plan(
        method=plan.method,
        pools=pools,
        budgets=plan.budgets,
        tensor_parallel=plan.tensor_parallel,
        reason=f"fast path: {alarm.reason}; {role} {plan.pools[role]} -> {pools[role]}",
    )
    return FastStep(alarm, role, plan, after)
