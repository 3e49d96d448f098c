"""The Deployments a plan asks for under ``spec.placement.mode``.

``Pools``: one per pool of the plan (``rollout/pool_identity.py``). ``Groups``: a plan of two or
more pools is cut into slices, each one instance of every pool (1E 2P 4D: one slice of E, P and
D), and the slices are one Deployment of group pods (``group_pods.py``), named
``<deployment>-group-<hash8>``; what is left over (1 P and 3 D) stays in ordinary per-pool
Deployments, so the plan's instance counts and GPUs are unchanged.

To the rollout a group pool is one more pool: its members register with the router under the
group pool's name, so routing to it, draining it and deleting it go as for any pool, and since
a slice serves every stage its role is EPD. A changed member (settings, budgets) is a new group
pool, brought up beside the old one; a changed slice count resizes the group pool in place.
"""

from __future__ import annotations

from epd_engine.config import Role
from epd_engine.contracts.plan import Plan
from epd_operator.rollout.pool_identity import (
    Owner,
    PoolSpec,
    base_name,
    content_digest,
    pool_spec,
    pool_specs,
    role_identity,
)


def group_slices(owner: Owner, plan: Plan) -> int:
    """How many group pods ``plan`` gets: the smallest pool's count (0 when not grouped)."""
    roles = plan.method.roles
    if not owner.spec.placement.grouped or len(roles) < 2:
        return 0
    return min(plan.pools[role] for role in roles)


def group_pool(owner: Owner, plan: Plan, slices: int) -> PoolSpec:
    """The pool of ``slices`` group pods, one member per role of the method."""
    members = plan.method.roles
    key = {"group": [role_identity(owner.spec, plan, role) for role in members]}
    ranks = tuple(plan.size_of(role) for role in members)
    gpus = sum(owner.spec.engine.gpus_for(r, n) for r, n in zip(members, ranks, strict=True))
    name = f"{base_name(owner)}-group-{content_digest(key)}"
    return PoolSpec(name, Role.EPD, slices, gpus, members=members, ranks=ranks)


def deployment_pools(owner: Owner, plan: Plan) -> list[PoolSpec]:
    """The pools the operator creates for ``plan``: the group pool first (when grouped), then
    each role's instances outside the groups, in the method's role order."""
    slices = group_slices(owner, plan)
    if slices == 0:
        return pool_specs(owner, plan)
    rest = [
        pool_spec(owner, plan, role, plan.pools[role] - slices)
        for role in plan.method.roles
        if plan.pools[role] > slices
    ]
    return [group_pool(owner, plan, slices), *rest]
