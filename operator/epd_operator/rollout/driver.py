"""One rollout pass on any backend: observe, decide (``loop.rollout_step``), act, read back.

The same driver runs in the Kubernetes operator (pools are Deployments) and on local
processes; only ``PoolBackend`` differs. The order inside a pass is what keeps requests safe:

1. read the pools and every router replica (routing and in-flight in one answer each);
2. create or grow new pools;
3. if the routing must change, PUT it to every replica, then read every replica back: the
   switch counts (status, ``Switched`` event) only when all of them report it;
4. delete the old pools the decision allows: it was made on a read in which every replica
   already routed elsewhere, so their in-flight counts were read after the switch;
5. observe again and describe what is now true (status pools and conditions).

Nothing else is remembered: a pass cut short anywhere (the operator killed after creating
pools, after a PUT, after a delete, before status was written) leaves a state the next pass
reads back and goes on from. ``checkpoint`` names those points (the restart tests stop the
operator there); a switch found confirmed on every replica but not in ``state`` (made by a
pass that did not get to record it) is reported then.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime
from typing import Protocol

from epd_engine.contracts.plan import Plan
from epd_operator.rollout.pool_identity import PoolSpec
from epd_operator.rollout.router_fleet import RouterFleet
from epd_operator.rollout.state_machine import Decision, Observed, ObservedPool, rollout_step

PostEvent = Callable[[str, str, str], None]  # (type, reason, message)
Checkpoint = Callable[[str], None]  # a point of the pass reached, with its action done

# the points ``checkpoint`` is called at, in pass order
POOLS_APPLIED = "pools_applied"  # new pools created or grown
ROUTING_SENT = "routing_sent"  # the new routing PUT to every replica, not read back yet
ROUTING_CONFIRMED = "routing_confirmed"  # read back from every replica, not in status yet
POOLS_DELETED = "pools_deleted"  # drained pools deleted, not in status yet
CHECKPOINTS = (POOLS_APPLIED, ROUTING_SENT, ROUTING_CONFIRMED, POOLS_DELETED)


def no_checkpoint(_: str) -> None:
    pass


class PoolBackend(Protocol):
    def observe_pools(self) -> dict[str, ObservedPool]: ...

    def apply_pool(self, pool: PoolSpec) -> None:
        """Create the pool, or resize it to ``pool.replicas`` (only ever grown by a rollout)."""

    def delete_pool(self, name: str) -> None: ...


@dataclass(frozen=True)
class RolloutState:
    """What the status remembers between passes."""

    active_pools: frozenset[str] = frozenset()  # the last routing every replica confirmed
    draining_since: datetime | None = None


@dataclass(frozen=True)
class RolloutOutcome:
    status: Decision  # pools and conditions as observed after acting
    state: RolloutState
    switched: bool  # every replica confirmed a new routing in this pass


def _names(names: frozenset[str]) -> str:
    return ", ".join(sorted(names)) or "none"


def rollout_pass(
    backend: PoolBackend,
    fleet: RouterFleet,
    desired: list[PoolSpec],
    plan: Plan,
    state: RolloutState,
    now: datetime,
    gpu_budget: int,
    drain_timeout_s: int,
    post_event: PostEvent,
    router_ready: bool = True,
    settle_s: float | None = None,
    checkpoint: Checkpoint = no_checkpoint,
) -> RolloutOutcome:
    timing = {} if settle_s is None else {"settle_s": settle_s}
    observed = Observed(
        pools=backend.observe_pools(),
        router=fleet.read(),
        draining_since=state.draining_since,
        now=now,
        recorded_active=state.active_pools,
        router_ready=router_ready,
    )
    decision = rollout_step(desired, observed, gpu_budget, drain_timeout_s, **timing)
    by_name = {p.name: p for p in desired}
    for name, replicas in decision.replicas.items():
        backend.apply_pool(replace(by_name[name], replicas=replicas))
    if decision.scale:
        checkpoint(POOLS_APPLIED)

    view = observed.router
    switched = False
    if decision.route_to and decision.route_to != view.confirmed:
        serves_plan = decision.route_to == frozenset(by_name)
        failed = fleet.switch(decision.route_to, plan if serves_plan else None, view)
        checkpoint(ROUTING_SENT)
        view = fleet.read()
        if view.confirmed == decision.route_to:
            checkpoint(ROUTING_CONFIRMED)
            was = observed.router.confirmed or state.active_pools
            if was == decision.route_to:  # a replica that lost it (restarted) has it back
                behind = sorted(a for a, r in observed.router.routing.items() if r != was)
                post_event(
                    "Normal",
                    "RoutingRestored",
                    f"Router replica(s) {', '.join(behind) or 'none'} given the routing "
                    f"again: {_names(was)}",
                )
            else:
                switched = True
                post_event(
                    "Normal",
                    "Switched",
                    f"Every router replica ({len(view.addresses)}) now sends requests to "
                    f"{_names(decision.route_to)} (was {_names(was)})",
                )
        else:
            missing = sorted(set(failed) | set(view.unreachable)) or [
                a for a, r in view.routing.items() if r != decision.route_to
            ]
            post_event(
                "Warning",
                "RoutingNotConfirmed",
                f"Routing to {_names(decision.route_to)} not confirmed by router replica(s) "
                f"{', '.join(missing) or 'none (no router address known)'}; retrying next pass",
            )
    elif state.active_pools and decision.route_to == view.confirmed != state.active_pools:
        # every replica took a switch that a pass cut short did not record (the operator
        # restarted between its PUT and its status): the switch happened, say so now
        switched = True
        post_event(
            "Normal",
            "Switched",
            f"Every router replica ({len(view.addresses)}) now sends requests to "
            f"{_names(decision.route_to)} (was {_names(state.active_pools)}; "
            "switched by an earlier pass)",
        )
    for name in decision.delete:
        backend.delete_pool(name)
    if decision.delete:
        checkpoint(POOLS_DELETED)
    for event in decision.events:
        post_event(event.type, event.reason, event.message)

    active = view.confirmed if view.confirmed is not None else state.active_pools
    after = Observed(
        pools=backend.observe_pools(),
        router=view,
        draining_since=decision.draining_since,
        now=now,
        recorded_active=active,
        router_ready=router_ready,
    )
    status = rollout_step(desired, after, gpu_budget, drain_timeout_s, **timing)
    existing = frozenset(n for n in active if n in after.pools)
    return RolloutOutcome(status, RolloutState(existing, status.draining_since), switched)
