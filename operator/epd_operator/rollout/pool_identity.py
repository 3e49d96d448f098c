"""Which pools a plan asks for, under names that say what they run.

A pool's name is ``<deployment>-<role>-<hash>``, the hash over everything that makes two
instances interchangeable (role, model, SLO, budgets, the engine's cache geometry and transfer
backend, the role's GPU count and type): the same plan always names the same pools, so a
re-applied plan changes nothing, a changed one starts new pools beside the old (the rollout's
new-pools-first order), and one that changes only how many instances a role has resizes that
role's pool in place (its added instances join, its removed ones drain). Both backends name
pools here.

The replica count was once part of the hash: every scale event then started a whole new pool
beside the old and held both until the old drained, so an elastic fleet held up to twice its
GPUs at each step (``make bench-elastic``: 1.02x the GPU-hours of a static fleet at its
maximum). Upgrading past that change renames every pool once (one ordinary rollout).

What is left out may differ between two pods of one pool for a while: the image, arguments,
environment, volumes, placement, CPU and memory, the router's address. A change to them is a
change of the pool's pod template, which the pool's Deployment rolls replica by replica
(``kube/update_strategy.py``) under the same name.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from typing import Any

from epd_engine.config import Role
from epd_engine.contracts.plan import Plan
from epd_operator.api.spec import EPDDeploymentSpec

MAX_NAME_PREFIX = 40  # leaves room for "-router", "-epd-<hash8>" within a 63-char DNS label


@dataclass(frozen=True)
class Owner:
    """What a child needs to know about its EPDDeployment."""

    name: str
    namespace: str
    uid: str
    spec: EPDDeploymentSpec


@dataclass(frozen=True)
class PoolSpec:
    """One role pool of a plan, as the operator creates it; or, with ``members``, a pool of
    placement groups (``kube/group_pools.py``): pods that each run one instance of every
    member role. A group serves every stage, so its ``role`` is EPD."""

    name: str
    role: Role
    replicas: int
    gpus_per_instance: int
    members: tuple[Role, ...] = ()
    # tensor-parallel ranks of each instance (the plan's size for the role); a group
    # pool: of each member, in ``members`` order
    ranks: tuple[int, ...] = (1,)

    def ranks_of(self, role: Role) -> int:
        return self.ranks[self.members.index(role)] if self.members else self.ranks[0]

    @property
    def gpus(self) -> int:
        return self.replicas * self.gpus_per_instance


def content_digest(data: Any, length: int = 8) -> str:
    """A short, stable hash of JSON-able data (child names and manifest hashes)."""
    blob = json.dumps(data, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:length]


def base_name(owner: Owner) -> str:
    """The EPDDeployment name, shortened deterministically if too long for child names."""
    if len(owner.name) <= MAX_NAME_PREFIX:
        return owner.name
    return f"{owner.name[: MAX_NAME_PREFIX - 6].rstrip('-')}-{content_digest(owner.name, 5)}"


# Engine settings every instance of a deployment must share: page sizes and counts (a
# migration copies pages between caches of one geometry) and how pages move.
IDENTITY_ENGINE_FIELDS = {
    "kv_block_size",
    "num_kv_blocks",
    "gpu_memory_fraction",
    "num_image_blocks",
    "transfer_backend",
}


def pool_identity(spec: EPDDeploymentSpec, role: Role, ranks: int = 1) -> dict[str, Any]:
    """What a pool of ``role`` at ``ranks`` per instance hashes into its name besides its
    replica count and budgets."""
    gpus = spec.engine.gpus_for(role, ranks)
    resource = spec.engine.role_pod(role, spec.gpu_resource_name).gpu_resource_name
    engine = spec.engine.model_dump(mode="json", include=IDENTITY_ENGINE_FIELDS)
    if spec.engine.processor_max_pixels is not None:
        # an image's token count: its E and P instances must agree. Only when set, so that
        # the pools of deployments without it keep their names.
        engine["processor_max_pixels"] = spec.engine.processor_max_pixels
    identity = {
        "model": spec.model.model_dump(mode="json"),
        "slo": spec.slo.model_dump(mode="json"),
        "engine": engine,
        "gpus_per_instance": gpus,
        "gpu_resource_name": resource if gpus > 0 else None,
    }
    if ranks > 1:  # only then: the pools of one-rank plans keep their names
        identity["tensor_parallel_size"] = ranks
    if spec.engine.emulate:  # real and emulated instances never share a pool
        identity["emulate"] = True
    return identity


def role_identity(spec: EPDDeploymentSpec, plan: Plan, role: Role) -> dict[str, Any]:
    """What one instance of ``role`` hashes into its pool's name: its settings and the plan's
    budgets for it."""
    key = {"role": role.value, "spec": pool_identity(spec, role, plan.size_of(role))}
    budgets = plan.budgets.get(role)
    if budgets is not None:
        key["budgets"] = budgets.model_dump()
    return key


def pool_spec(owner: Owner, plan: Plan, role: Role, replicas: int) -> PoolSpec:
    """A pool of ``replicas`` instances of ``role`` under its deterministic name, which does
    not depend on ``replicas``."""
    digest = content_digest(role_identity(owner.spec, plan, role))
    name = f"{base_name(owner)}-{role.value.lower()}-{digest}"
    ranks = plan.size_of(role)
    return PoolSpec(name, role, replicas, owner.spec.engine.gpus_for(role, ranks), ranks=(ranks,))


def pool_specs(owner: Owner, plan: Plan) -> list[PoolSpec]:
    """The pools of ``plan`` with their deterministic names, in the method's role order."""
    return [pool_spec(owner, plan, role, plan.pools[role]) for role in plan.method.roles]
