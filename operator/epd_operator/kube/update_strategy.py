"""How a pool's Deployment replaces its pods when their template changes.

A new image, new arguments, new pod settings or a new operator rendering keep the pool's name
(``rollout/pool_identity.py``), so the Deployment rolls it: never ``Recreate`` (every engine
pod of the pool down at once). Each replaced pod is SIGTERMed and drains first: it leaves
routing, finishes its in-flight requests and exits (``epdctl serve --drain-timeout``).

- Surge one, drain one (``maxSurge: 1, maxUnavailable: 0``): the pool never serves with fewer
  instances than its plan. A GPU pool takes this while ``gpuBudget`` has room for one more
  instance of it beside the plan; pools take that room in the method's role order.
- Drain one, then start one (``maxSurge: 0, maxUnavailable: 1``) for a GPU pool with several
  replicas and no room: the budget holds, the others serve meanwhile.
- A pool of one GPU instance without room surges anyway: one instance over the budget while
  its successor starts beats a stage with nobody serving it (if no GPU is free the new pod
  stays Pending and the old one keeps serving).
"""

from __future__ import annotations

from typing import Any

from epd_engine.contracts.plan import Plan
from epd_operator.kube.group_pools import deployment_pools
from epd_operator.rollout.pool_identity import Owner, PoolSpec

SURGE_ONE = {"maxSurge": 1, "maxUnavailable": 0}
DRAIN_ONE = {"maxSurge": 0, "maxUnavailable": 1}


def surge_room(owner: Owner, plan: Plan) -> set[str]:
    """Pools of ``plan`` that may start one extra instance within ``gpuBudget``."""
    pools = deployment_pools(owner, plan)
    room = owner.spec.gpu_budget - sum(p.gpus for p in pools)
    fits = set()
    for pool in pools:  # the method's role order
        if pool.gpus_per_instance <= room:
            fits.add(pool.name)
            room -= pool.gpus_per_instance
    return fits


def update_strategy(owner: Owner, pool: PoolSpec, plan: Plan) -> dict[str, Any]:
    """The Deployment's ``spec.strategy``."""
    if pool.gpus_per_instance == 0 or pool.name in surge_room(owner, plan) or pool.replicas < 2:
        rolling = SURGE_ONE
    else:
        rolling = DRAIN_ONE
    return {"type": "RollingUpdate", "rollingUpdate": dict(rolling)}
