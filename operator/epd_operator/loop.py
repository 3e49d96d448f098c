"""Pure decisions: which plan to run, and the rollout/drain state machine.

``rollout_step`` is level-triggered: it gets the desired pools and what the cluster and the
router look like now, and returns what to do next. Called again and again it converges:

1. create the plan's missing pools (next to the old ones while the GPU budget allows);
2. when every pool of the plan is Ready, switch the router to exactly those pools;
3. old pools the router no longer uses are *draining*: delete each once the router reports
   no request in flight on it, or once ``drainTimeoutSeconds`` passed if the router cannot be
   asked (e.g. no container runs, as in the kwok test cluster) — and say so;
4. if the old and the new pools together exceed the GPU budget, the old pools are drained
   first to make room (serving capacity drops; Progressing says ``BudgetForcesCapacityDrop``).

The router is never pointed at a pool that is not Ready, and old pools keep serving until
the new ones are Ready, except in case 4.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from typing import Literal

from epd_engine.config import Role
from epd_engine.plan import Plan
from epd_operator.resources import PoolSpec
from epd_operator.spec import EPDDeploymentSpec, PlanStatus, PoolStatus, fixed_plan


@dataclass(frozen=True)
class ObservedPool:
    """One pool Deployment as the API server reports it."""

    name: str
    role: Role
    replicas: int
    ready: int
    gpus: int
    unschedulable: str = ""  # the scheduler's message when some pod cannot be placed


@dataclass(frozen=True)
class Observed:
    pools: dict[str, ObservedPool]
    active_pools: frozenset[str]
    draining_since: datetime | None
    now: datetime
    in_flight: dict[str, int] | None = None  # router's per-pool in-flight; None: unreachable
    router_ready: bool = True


@dataclass(frozen=True)
class ConditionState:
    status: str  # "True" | "False"
    reason: str
    message: str


@dataclass(frozen=True)
class Event:
    type: str  # "Normal" | "Warning"
    reason: str
    message: str


@dataclass
class Decision:
    create: list[PoolSpec] = field(default_factory=list)
    route_to: frozenset[str] = frozenset()
    delete: list[str] = field(default_factory=list)
    draining_since: datetime | None = None
    conditions: dict[str, ConditionState] = field(default_factory=dict)
    pools: list[PoolStatus] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)

    @property
    def routing_changed(self) -> bool:
        return bool(self.events) and any(e.reason == "Switched" for e in self.events)


def _names(names: set[str] | frozenset[str]) -> str:
    return ", ".join(sorted(names)) or "none"


def rollout_step(
    desired: list[PoolSpec], obs: Observed, gpu_budget: int, drain_timeout_s: int
) -> Decision:
    d = Decision()
    wanted = {p.name for p in desired}
    old = {n: p for n, p in obs.pools.items() if n not in wanted}
    active = frozenset(n for n in obs.active_pools if n in obs.pools)
    ready = {
        p.name for p in desired if p.name in obs.pools and obs.pools[p.name].ready >= p.replicas
    }
    all_ready = ready == wanted
    gpus_in_use = sum(p.gpus for p in obs.pools.values())
    surge_gpus = sum(p.gpus for p in desired if p.name not in obs.pools)
    budget_forces = bool(old) and gpus_in_use + surge_gpus > gpu_budget

    # 1. create missing pools within the budget
    room = gpu_budget - gpus_in_use
    for pool in desired:
        if pool.name not in obs.pools and pool.gpus <= room:
            d.create.append(pool)
            room -= pool.gpus

    # 2. switch routing once every pool of the plan is Ready
    if all_ready:
        d.route_to = frozenset(wanted)
    elif budget_forces:
        d.route_to = active - set(old)
    else:
        d.route_to = active
    if d.route_to != active and all_ready:
        d.events.append(
            Event(
                "Normal",
                "Switched",
                f"Router now sends requests to {_names(d.route_to)} (was {_names(active)})",
            )
        )
    if budget_forces and active & set(old):
        d.events.append(
            Event(
                "Warning",
                "CapacityDrop",
                f"GPU budget {gpu_budget} cannot hold old and new pools together "
                f"({gpus_in_use + surge_gpus} GPUs); draining {_names(set(old))} first",
            )
        )

    # 3. drain and delete old pools that no longer get traffic
    draining = {n for n in old if n not in d.route_to}
    d.draining_since = (obs.draining_since or obs.now) if draining else None
    waited_s = (obs.now - d.draining_since).total_seconds() if d.draining_since else 0.0
    router_known = obs.in_flight is not None
    for name in sorted(draining):
        if router_known and obs.in_flight is not None and obs.in_flight.get(name, 0) == 0:
            d.delete.append(name)
            d.events.append(
                Event("Normal", "Drained", f"Pool {name} has no request in flight; deleting it")
            )
        elif waited_s >= drain_timeout_s:
            d.delete.append(name)
            why = (
                "router unreachable, so in-flight requests could not be checked"
                if not router_known
                else "requests still in flight"
            )
            d.events.append(
                Event(
                    "Warning" if router_known else "Normal",
                    "DrainTimeout",
                    f"Deleting pool {name} after the {drain_timeout_s} s drain timeout ({why})",
                )
            )

    # status: pools and conditions
    for pool in desired:
        seen = obs.pools.get(pool.name)
        state: Literal["Starting", "Active", "Draining"] = (
            "Active" if pool.name in d.route_to else "Starting"
        )
        d.pools.append(
            PoolStatus(
                name=pool.name,
                role=pool.role,
                desired=pool.replicas,
                ready=seen.ready if seen else 0,
                gpus=pool.gpus,
                state=state,
            )
        )
    for name, seen in sorted(old.items()):
        state = "Active" if name in d.route_to else "Draining"
        d.pools.append(
            PoolStatus(
                name=name,
                role=seen.role,
                desired=seen.replicas,
                ready=seen.ready,
                gpus=seen.gpus,
                state=state,
            )
        )
    d.conditions = _conditions(
        desired, obs, d, ready, draining, budget_forces, waited_s, drain_timeout_s
    )
    return d


def _conditions(
    desired: list[PoolSpec],
    obs: Observed,
    d: Decision,
    ready: set[str],
    draining: set[str],
    budget_forces: bool,
    waited_s: float,
    drain_timeout_s: int,
) -> dict[str, ConditionState]:
    wanted = {p.name for p in desired}
    stuck = [
        (p.name, obs.pools[p.name].unschedulable)
        for p in desired
        if p.name in obs.pools and obs.pools[p.name].unschedulable
    ]
    if stuck:
        insufficient = any("Insufficient" in msg for _, msg in stuck)
        detail = "; ".join(f"pool {n}: {msg}" for n, msg in stuck)
        degraded = ConditionState(
            "True",
            "InsufficientGPUs" if insufficient else "Unschedulable",
            f"Pods cannot be scheduled, the cluster lacks capacity for this plan: {detail}",
        )
    else:
        degraded = ConditionState("False", "AsExpected", "All pools can be scheduled")

    serving = bool(d.route_to) and all(
        n in obs.pools and obs.pools[n].ready >= 1 for n in d.route_to
    )
    if not obs.router_ready:
        ready_c = ConditionState(
            "False", "RouterNotReady", "The router Deployment is not available"
        )
    elif d.route_to == wanted and ready == wanted:
        ready_c = ConditionState("True", "AllPoolsReady", f"Serving with {len(wanted)} Ready pools")
    elif serving:
        ready_c = ConditionState(
            "True", "ServingPreviousPlan", "The previous plan serves while the new one rolls out"
        )
    else:
        missing = wanted - ready
        ready_c = ConditionState(
            "False", "PoolsNotReady", f"Pools not Ready yet: {_names(missing)}"
        )

    if budget_forces and (draining or wanted - ready):
        progressing = ConditionState(
            "True",
            "BudgetForcesCapacityDrop",
            "The GPU budget cannot hold the old and the new pools at once: serving capacity "
            f"drops while {_names(draining) if draining else 'the old pools'} drain and the "
            "new pools start",
        )
    elif wanted - ready:
        progressing = ConditionState(
            "True",
            "WaitingForPools",
            f"Waiting for new pools to be Ready: {_names(wanted - ready)}",
        )
    elif draining:
        how = (
            "until the router reports no request in flight"
            if obs.in_flight is not None
            else f"router unreachable: waiting the {drain_timeout_s} s drain timeout "
            f"({int(waited_s)} s so far)"
        )
        progressing = ConditionState("True", "Draining", f"Draining {_names(draining)} {how}")
    else:
        progressing = ConditionState("False", "RolloutComplete", "All pools match the plan")
    return {"Ready": ready_c, "Progressing": progressing, "Degraded": degraded}


# --- which plan ------------------------------------------------------------------------------


@dataclass(frozen=True)
class WorkloadStats:
    """The live workload over the profiler's trace window (the router's trace, or Prometheus)."""

    num_requests: int
    request_rate_rps: float
    mean_prompt_tokens: float | None = None  # None: not exported by the router (yet)
    mean_images: float | None = None
    mean_output_tokens: float | None = None
    slo_attainment: float | None = None  # share of requests meeting both SLOs


# Makes a plan from the spec and the live workload. ``heuristic_plan`` is one; the operator
# passes ``planner.auto_planner(...)``, which also holds the trace window and the cost model
# and runs the trace-replay profiler when the window has enough requests.
Planner = Callable[[EPDDeploymentSpec, WorkloadStats | None], Plan]


def instances_allowed(spec: EPDDeploymentSpec) -> int:
    """Instances the GPU budget pays for (at least one: a CPU engine needs no GPU)."""
    return max(spec.gpu_budget // max(spec.engine.gpus_per_instance, 1), 1)


def budget_changed(spec: EPDDeploymentSpec, current: PlanStatus) -> bool:
    """The plan no longer has the instances the GPU budget pays for (lowered or raised)."""
    return current.to_plan().num_instances != instances_allowed(spec)


def heuristic_plan(spec: EPDDeploymentSpec, stats: WorkloadStats | None, why: str = "") -> Plan:
    """The ``mode: Auto`` plan when the trace-replay profiler cannot run (``why`` says why,
    e.g. no trace yet). Splits the instances the budget allows in proportion to rough
    per-stage work: image count for E, prompt tokens for P, output tokens for D (decode
    weighted 2x: memory-bound)."""
    from epd_engine.config import Method

    n = instances_allowed(spec)
    note = f" ({why})" if why else ""
    if n <= 1:
        return Plan(
            method=Method.EPD, pools={Role.EPD: 1}, reason="budget fits one instance" + note
        )
    if n == 2:
        return Plan(
            method=Method.EP_D, pools={Role.EP: 1, Role.D: 1}, reason="budget fits two" + note
        )
    images = stats.mean_images if stats and stats.mean_images is not None else 1.0
    prompt = stats.mean_prompt_tokens if stats and stats.mean_prompt_tokens is not None else 512.0
    output = stats.mean_output_tokens if stats and stats.mean_output_tokens is not None else 256.0
    work_e, work_p, work_d = images * 576, prompt, 2 * output
    total = work_e + work_p + work_d or 1.0
    counts = {r: max(1, int(n * w / total)) for r, w in ((Role.E, work_e), (Role.P, work_p))}
    counts[Role.D] = max(1, n - counts[Role.E] - counts[Role.P])
    while sum(counts.values()) > n:
        biggest = max(counts, key=lambda r: counts[r])
        counts[biggest] -= 1
    if stats is not None and stats.num_requests > 0:
        reason = f"heuristic split of the GPU budget on {stats.num_requests} requests{note}"
    else:
        reason = "heuristic split of the GPU budget (no trace yet" + (f": {why})" if why else ")")
    return Plan(method=Method.E_P_D, pools=counts, reason=reason)


def workload_shift_percent(before: WorkloadStats, now: WorkloadStats) -> float:
    """Largest relative change (in %) of rate, prompt length, images or output length."""
    pairs = [
        (before.request_rate_rps, now.request_rate_rps),
        (before.mean_prompt_tokens, now.mean_prompt_tokens),
        (before.mean_images, now.mean_images),
        (before.mean_output_tokens, now.mean_output_tokens),
    ]
    return max(
        abs(b - a) / max(abs(a), 1e-9) * 100 for a, b in pairs if a is not None and b is not None
    )


def replan_due(
    spec: EPDDeploymentSpec, current: PlanStatus | None, seconds_since_plan: float
) -> bool:
    """Whether ``choose_plan`` may call the planner this pass (Auto): no plan yet, the GPU
    budget changed, or the interval passed. The operator reads the workload only then."""
    if spec.disaggregation.mode == "Fixed":
        return False
    return (
        current is None
        or budget_changed(spec, current)
        or seconds_since_plan >= spec.profiler.interval_seconds
    )


def choose_plan(
    spec: EPDDeploymentSpec,
    current: PlanStatus | None,
    stats: WorkloadStats | None,
    planned_on: WorkloadStats | None,
    seconds_since_plan: float,
    planner: Planner = heuristic_plan,
) -> tuple[Plan, bool]:
    """The plan to run now. Fixed: the spec's. Auto: ``planner`` makes the first plan and a
    new one when the GPU budget changed; otherwise keep the current plan unless the interval
    passed, the window has enough requests, and the workload shifted enough or the live SLO
    attainment fell below the target. Returns (plan, whether the planner ran)."""
    if spec.disaggregation.mode == "Fixed":
        return fixed_plan(spec), False
    if current is None or budget_changed(spec, current):
        return planner(spec, stats), True  # first plan, or the GPU budget changed
    prof = spec.profiler
    if (
        stats is not None
        and seconds_since_plan >= prof.interval_seconds
        and stats.num_requests >= prof.min_requests
        and (
            planned_on is None
            or workload_shift_percent(planned_on, stats) >= prof.shift_threshold_percent
            or (
                stats.slo_attainment is not None
                and stats.slo_attainment * 100 < spec.slo.attainment_percent
            )
        )
    ):
        return planner(spec, stats), True
    return current.to_plan(), False


def same_plan(a: Plan, b: Plan) -> bool:
    return a.method == b.method and dict(a.pools) == dict(b.pools) and a.budgets == b.budgets
