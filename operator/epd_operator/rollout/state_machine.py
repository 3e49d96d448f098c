"""The rollout/drain state machine: how to get from the pools that exist to the plan's.

``rollout_step`` is level-triggered and knows no backend: it gets the desired pools, the pools
that exist and what every router replica answered this pass, and returns what to do next
(the Kubernetes controller and the local backend both act on it). Called again and again it
converges, and at every step every stage (encode, prefill, decode) has a Ready pool the
routers send requests to:

1. create the plan's missing pools next to the old ones, as far as the GPU budget allows; a
   pool the plan keeps with another count (its name does not change with it) is resized in
   place: grown within the budget, shrunk at once (the instances removed drain themselves:
   they leave routing, finish what they hold and exit, ``api/draining.py``);
2. when every pool of the plan is Ready at full size, route to exactly those pools;
3. when the budget cannot hold old and new pools together, go in steps: start what fits of
   the new pools (a pool may start with fewer replicas and grow), route to them next to the
   old ones as they become Ready, and take old pools out of routing only while the pools left
   still serve every stage; when no such step exists, wait and say how many GPUs it needs;
4. an old pool is deleted only once every router replica has confirmed (read back) that it no
   longer routes to it, a settle time passed (instances learn the new peers from heartbeats)
   and the same read reports no request in flight there; after ``drainTimeoutSeconds`` of a
   confirmed drain it is deleted even with requests left, and a Warning says so. A router that
   cannot be asked confirms nothing, so nothing is deleted.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from datetime import datetime
from typing import Literal

from epd_engine.config import STAGE_ORDER, Role, Stage
from epd_operator.api.conditions import ConditionState
from epd_operator.api.spec import PoolStatus
from epd_operator.rollout.pool_identity import PoolSpec

ALL_STAGES = frozenset(STAGE_ORDER)
SETTLE_S = 3.0  # after a confirmed switch: several heartbeats, so instances drop old peers


@dataclass(frozen=True)
class ObservedPool:
    """One pool as the backend reports it (a Deployment, or local processes)."""

    name: str
    role: Role
    replicas: int
    ready: int
    gpus: int
    unschedulable: str = ""  # the scheduler's message when some pod cannot be placed


@dataclass(frozen=True)
class RouterView:
    """Every router replica's ``GET /internal/pools``, read this pass.

    ``routing``: per replica that answered, the pools it sends new requests to (None: every
    registered pool, a router nobody switched yet). ``in_flight``: requests in flight per pool,
    summed over the replicas that answered, read in the same answers as ``routing``.
    """

    addresses: tuple[str, ...] = ()
    routing: dict[str, frozenset[str] | None] = field(default_factory=dict)
    in_flight: dict[str, int] = field(default_factory=dict)

    @property
    def unreachable(self) -> list[str]:
        return [a for a in self.addresses if a not in self.routing]

    @property
    def confirmed(self) -> frozenset[str] | None:
        """The routing every replica reported, if all answered and agree on an explicit set."""
        if not self.addresses or self.unreachable:
            return None
        sets = set(self.routing.values())
        if len(sets) != 1:
            return None
        only = next(iter(sets))
        return only if only is not None else None


@dataclass(frozen=True)
class Observed:
    pools: dict[str, ObservedPool]
    router: RouterView
    draining_since: datetime | None
    now: datetime
    recorded_active: frozenset[str] = frozenset()  # status.activePools: last confirmed routing
    router_ready: bool = True  # the router Deployment (or process) is up


@dataclass(frozen=True)
class Event:
    type: str  # "Normal" | "Warning"
    reason: str
    message: str


@dataclass
class Decision:
    scale: dict[str, PoolSpec] = field(default_factory=dict)  # pools to create or grow
    shrink: dict[str, int] = field(default_factory=dict)  # pools of the plan resized down
    replicas: dict[str, int] = field(default_factory=dict)  # every new pool's size this step
    route_to: frozenset[str] = frozenset()
    delete: list[str] = field(default_factory=list)
    draining_since: datetime | None = None
    conditions: dict[str, ConditionState] = field(default_factory=dict)
    pools: list[PoolStatus] = field(default_factory=list)
    events: list[Event] = field(default_factory=list)

    @property
    def create(self) -> list[PoolSpec]:
        return list(self.scale.values())


def _names(names: set[str] | frozenset[str]) -> str:
    return ", ".join(sorted(names)) or "none"


def stages_served(
    pools: set[str] | frozenset[str], observed: dict[str, ObservedPool]
) -> set[Stage]:
    """Stages that some Ready instance of ``pools`` runs."""
    return {
        stage
        for name in pools
        if name in observed and observed[name].ready >= 1
        for stage in observed[name].role.stages
    }


def _missing(pools: frozenset[str], observed: dict[str, ObservedPool]) -> str:
    return ", ".join(s.value for s in STAGE_ORDER if s not in stages_served(pools, observed))


def _grow(
    desired: list[PoolSpec], obs: Observed, room: int
) -> tuple[dict[str, PoolSpec], dict[str, int]]:
    """New pools to create or grow within ``room`` GPUs. One instance of every pool first (so
    the new pools serve every stage as early as possible and old pools can go), pools that run
    more stages first; then the rest. Returns the changes and every desired pool's size."""
    order = sorted(desired, key=lambda p: -len(p.role.stages))
    size = {
        p.name: min(obs.pools[p.name].replicas, p.replicas) if p.name in obs.pools else 0
        for p in desired
    }
    start = dict(size)
    for first_instance_only in (True, False):
        for pool in order:
            want = 1 if first_instance_only else pool.replicas
            per = pool.gpus_per_instance
            add = max(0, want - size[pool.name])
            if per:
                add = min(add, room // per)
            size[pool.name] += add
            room -= add * per
    scale = {
        p.name: replace(p, replicas=size[p.name])
        for p in desired
        if size[p.name] > start[p.name] or (p.name not in obs.pools and size[p.name] > 0)
    }
    return scale, size


def rollout_step(
    desired: list[PoolSpec],
    obs: Observed,
    gpu_budget: int,
    drain_timeout_s: int,
    settle_s: float = SETTLE_S,
) -> Decision:
    d = Decision()
    wanted = frozenset(p.name for p in desired)
    old = {n: p for n, p in obs.pools.items() if n not in wanted}
    confirmed = obs.router.confirmed
    current = frozenset(
        n for n in (confirmed if confirmed is not None else obs.recorded_active) if n in obs.pools
    )
    full = {
        p.name
        for p in desired
        if p.name in obs.pools
        and obs.pools[p.name].replicas >= p.replicas
        and obs.pools[p.name].ready >= p.replicas
    }
    gpus_in_use = sum(p.gpus for p in obs.pools.values())
    held_by_new = sum(
        min(obs.pools[p.name].replicas, p.replicas) * p.gpus_per_instance
        for p in desired
        if p.name in obs.pools
    )
    growth = sum(p.gpus for p in desired) - held_by_new
    constrained = bool(old) and growth > gpu_budget - gpus_in_use

    # 1. create or grow new pools within the budget
    d.scale, sizes = _grow(desired, obs, gpu_budget - gpus_in_use)
    d.replicas = {name: n for name, n in sizes.items() if n > 0}
    d.shrink = {
        p.name: p.replicas
        for p in desired
        if p.name in obs.pools and obs.pools[p.name].replicas > p.replicas
    }
    d.events.extend(_resize_events(d, obs))

    # 2. the routing target: the whole plan once complete; else the old pools (blue/green), or
    #    in steps when the budget forces it; never a set that leaves a stage unserved
    released: set[str] = set()
    if full == wanted:
        target = wanted
    elif not constrained:
        target = current
    else:
        serving_new = {p.name for p in desired if p.name in obs.pools and obs.pools[p.name].ready}
        target = current | serving_new
        need = growth - (gpu_budget - gpus_in_use)
        need -= sum(p.gpus for n, p in old.items() if n not in current)  # already draining
        for name in sorted(set(old) & target, key=lambda n: (-old[n].gpus, n)):
            if need <= 0:
                break
            if stages_served(target - {name}, obs.pools) == ALL_STAGES:
                target -= {name}
                released.add(name)
                need -= old[name].gpus
    if stages_served(target, obs.pools) != ALL_STAGES:
        target = current  # e.g. the first rollout before its pools are Ready
    d.route_to = frozenset(target)
    if released:
        d.events.append(
            Event(
                "Normal",
                "SteppedRollout",
                f"GPU budget {gpu_budget} cannot hold the old and the new pools together: "
                f"taking {_names(released)} out of routing, {_names(target)} still serve "
                "every stage",
            )
        )
    starting = any(
        p.name in obs.pools and obs.pools[p.name].ready < obs.pools[p.name].replicas
        for p in desired
    )
    blocked = constrained and not d.scale and not released and not starting and set(old) <= target

    # 3. drain and delete old pools no router replica sends requests to any more
    draining = {n for n in old if n not in d.route_to}
    d.draining_since = (obs.draining_since or obs.now) if draining else None
    waited_s = (obs.now - d.draining_since).total_seconds() if d.draining_since else 0.0
    # A request held by a draining pool may still hand over to another draining pool (it was
    # offered before the switch), so they go together, once none of them holds a request.
    left_total = sum(obs.router.in_flight.get(n, 0) for n in draining)
    for name in sorted(draining):
        if confirmed is None or name in confirmed or waited_s < settle_s:
            continue  # the switch away from it is not confirmed (long enough) yet
        left = obs.router.in_flight.get(name, 0)
        if left_total == 0:
            d.delete.append(name)
            d.events.append(
                Event("Normal", "Drained", f"Pool {name} has no request in flight; deleting it")
            )
        elif waited_s >= drain_timeout_s:
            d.delete.append(name)
            d.events.append(
                Event(
                    "Warning",
                    "DrainTimeout",
                    f"Deleting pool {name} after the {drain_timeout_s} s drain timeout with "
                    f"{left} request(s) in flight on it ({left_total} on draining pools)",
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
        desired,
        obs,
        d,
        _Progress(
            full=full,
            draining=draining,
            constrained=constrained,
            blocked=blocked,
            gpus_in_use=gpus_in_use,
            gpu_budget=gpu_budget,
            first_instances_gpus=sum(
                p.gpus_per_instance for p in desired if not obs.pools.get(p.name)
            ),
            waited_s=waited_s,
            drain_timeout_s=drain_timeout_s,
        ),
    )
    return d


def _resize_events(d: Decision, obs: Observed) -> list[Event]:
    """One event per pool of the plan resized in place this pass."""
    events = []
    for name, pool in sorted(d.scale.items()):
        if name in obs.pools:
            was = obs.pools[name].replicas
            events.append(
                Event("Normal", "ScalingUp", f"Pool {name}: {was} -> {pool.replicas} instances")
            )
    for name, n in sorted(d.shrink.items()):
        was = obs.pools[name].replicas
        events.append(
            Event(
                "Normal",
                "ScalingDown",
                f"Pool {name}: {was} -> {n} instances; the {was - n} removed leave routing "
                "and finish their requests before they exit",
            )
        )
    return events


@dataclass(frozen=True)
class _Progress:
    full: set[str]
    draining: set[str]
    constrained: bool
    blocked: bool
    gpus_in_use: int
    gpu_budget: int
    first_instances_gpus: int  # one instance of each new pool that has none
    waited_s: float
    drain_timeout_s: int


def _conditions(
    desired: list[PoolSpec], obs: Observed, d: Decision, pr: _Progress
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

    router = obs.router
    confirmed = router.confirmed
    answered = {a: r for a, r in router.routing.items() if r is not None}
    serving = bool(answered) and all(
        stages_served(r, obs.pools) == ALL_STAGES for r in answered.values()
    )
    if not obs.router_ready:
        ready_c = ConditionState(
            "False", "RouterNotReady", "The router Deployment is not available"
        )
    elif not router.routing:
        ready_c = ConditionState(
            "False",
            "RouterUnreachable",
            f"No router replica answered ({_names(set(router.addresses))}): serving cannot be "
            "confirmed",
        )
    elif confirmed == wanted and pr.full == wanted:
        ready_c = ConditionState("True", "AllPoolsReady", f"Serving with {len(wanted)} Ready pools")
    elif serving:
        ready_c = ConditionState(
            "True",
            "ServingDuringRollout",
            "Every router replica routes to Ready pools serving every stage while the plan "
            "rolls out",
        )
    else:
        gaps = "; ".join(
            f"{a}: routes to {_names(r)}, no Ready pool for {_missing(r, obs.pools)}"
            for a, r in sorted(answered.items())
            if stages_served(r, obs.pools) != ALL_STAGES
        )
        ready_c = ConditionState(
            "False", "PoolsNotReady", gaps or f"Pools not Ready yet: {_names(wanted - pr.full)}"
        )

    if pr.blocked:
        progressing = ConditionState(
            "True",
            "BudgetBlocksRollout",
            f"GPU budget {pr.gpu_budget} is used by the serving pools ({pr.gpus_in_use} GPUs) and "
            "no old pool can leave routing without leaving a stage unserved: the rollout waits. "
            f"With gpuBudget {pr.gpus_in_use + pr.first_instances_gpus} (one instance of each "
            "new pool next to the old ones) it can proceed",
        )
    elif router.unreachable and (d.route_to != confirmed or pr.draining):
        progressing = ConditionState(
            "True",
            "RouterUnreachable",
            f"Router replica(s) {_names(set(router.unreachable))} did not answer: routing "
            "cannot be confirmed, so no old pool is deleted yet",
        )
    elif d.route_to != (confirmed or frozenset()) and (d.route_to or confirmed):
        disagree = {a for a, r in router.routing.items() if r != d.route_to}
        progressing = ConditionState(
            "True",
            "SwitchingRouting",
            f"Routing to {_names(d.route_to)} not yet confirmed by router replica(s) "
            f"{_names(disagree)}",
        )
    elif pr.constrained and wanted - pr.full:
        progressing = ConditionState(
            "True",
            "SteppedRollout",
            f"GPU budget {pr.gpu_budget} cannot hold the old and the new pools together: going "
            "pool by pool, every stage keeps a Ready pool in routing; waiting for "
            f"{_names(wanted - pr.full)}",
        )
    elif wanted - pr.full:
        progressing = ConditionState(
            "True",
            "WaitingForPools",
            f"Waiting for new pools to be Ready: {_names(wanted - pr.full)}",
        )
    elif pr.draining:
        left = {n: router.in_flight.get(n, 0) for n in sorted(pr.draining)}
        how = ", ".join(f"{n}: {k} in flight" for n, k in left.items())
        progressing = ConditionState(
            "True",
            "Draining",
            f"Draining {_names(pr.draining)} until the routers report no request in flight "
            f"({how}; {int(pr.waited_s)} s of at most {pr.drain_timeout_s} s)",
        )
    else:
        progressing = ConditionState("False", "RolloutComplete", "All pools match the plan")
    return {"Ready": ready_c, "Progressing": progressing, "Degraded": degraded}
