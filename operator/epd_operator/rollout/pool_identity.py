"""Which pools a plan asks for, under names that say what they run.

A pool's name is ``<deployment>-<role>-<hash>``, the hash over everything that makes two pools
interchangeable (role, replicas, model, engine settings, SLO, budgets): the same plan always
names the same pools, so a re-applied plan changes nothing and a changed one starts new pools
beside the old (the rollout's new-pools-first order). Both backends name pools here.
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
    """One role pool of a plan, as the operator creates it."""

    name: str
    role: Role
    replicas: int
    gpus_per_instance: int

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


def pool_specs(owner: Owner, plan: Plan) -> list[PoolSpec]:
    """The pools of ``plan`` with their deterministic names, in the method's role order."""
    spec = owner.spec
    shared = spec.model_dump(
        mode="json", include={"model", "engine", "slo", "gpu_resource_name", "router"}
    )
    pools = []
    for role in plan.method.roles:
        replicas = plan.pools[role]
        budgets = plan.budgets.get(role)
        key = {"role": role.value, "replicas": replicas, "spec": shared}
        if budgets is not None:
            key["budgets"] = budgets.model_dump()
        name = f"{base_name(owner)}-{role.value.lower()}-{content_digest(key)}"
        pools.append(PoolSpec(name, role, replicas, spec.engine.gpus_per_instance))
    return pools
