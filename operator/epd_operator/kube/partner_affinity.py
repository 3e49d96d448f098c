"""Preferred pod affinity that keeps pools exchanging caches on one node.

A migration between pods on one node can go through ``/dev/shm`` (or CUDA IPC where the GPUs
are visible) instead of the pod network: a LLaVA-7B KV cache of 640 tokens is about 335 MB.
Each engine pool prefers nodes that already run a pod of a pool it exchanges caches with
(``contracts/cache_partners.py``: E→P and P→D under E+P+D, EP→D, E→PD, ED↔P), same
deployment, by ``preferredDuringSchedulingIgnoredDuringExecution`` on ``kubernetes.io/hostname``.
The scheduler also scores an incoming pod by the preferred terms of the pods already placed,
so the preference holds whichever pool's pod comes first.

It is a preference, not a rule: a partner that does not fit (GPUs, a node selector) lands
elsewhere and migrates over the network. A pair whose node selectors exclude each other (a key
both set, to different values: encoders on an L4 tier, prefill on H100s) gets no term. The
spec's own ``affinity`` is kept whole; these terms are appended to its preferred pod
affinity.
"""

from __future__ import annotations

import copy
from typing import Any

from epd_engine.config import Role
from epd_engine.contracts.cache_partners import cache_partners
from epd_engine.contracts.plan import Plan
from epd_operator.kube.names import LABEL_DEPLOYMENT, LABEL_ROLE, label_value
from epd_operator.rollout.pool_identity import Owner

HOSTNAME_KEY = "kubernetes.io/hostname"
# The largest a preferred term may weigh (1-100): above the default scheduler's spreading
# scores, so partners that fit share a node.
PARTNER_WEIGHT = 100
_PREFERRED = "preferredDuringSchedulingIgnoredDuringExecution"


def _excludes(a: dict[str, str], b: dict[str, str]) -> bool:
    """Whether no node can match both selectors (a key both set, to different values)."""
    return any(key in b and b[key] != value for key, value in a.items())


def partner_terms(owner: Owner, plan: Plan, role: Role) -> list[dict[str, Any]]:
    """Weighted pod affinity terms of ``role``'s pods toward their cache partners' pods."""
    spec = owner.spec
    own = spec.engine.role_pod(role, spec.gpu_resource_name).node_selector
    terms: list[dict[str, Any]] = []
    for partner in cache_partners(plan.method, role):
        theirs = spec.engine.role_pod(partner, spec.gpu_resource_name).node_selector
        if _excludes(own, theirs):
            continue
        selector = {LABEL_DEPLOYMENT: label_value(owner.name), LABEL_ROLE: partner.value}
        term = {"labelSelector": {"matchLabels": selector}, "topologyKey": HOSTNAME_KEY}
        terms.append({"weight": PARTNER_WEIGHT, "podAffinityTerm": term})
    return terms


def with_partner_affinity(
    user_affinity: dict[str, Any] | None, terms: list[dict[str, Any]]
) -> dict[str, Any] | None:
    """The spec's affinity with ``terms`` appended to its preferred pod affinity (a copy; the
    spec's own terms first and untouched). None when both are empty."""
    if not terms:
        return copy.deepcopy(user_affinity) if user_affinity else None
    out = copy.deepcopy(user_affinity) if user_affinity else {}
    pod_affinity = out.setdefault("podAffinity", {})
    preferred = pod_affinity.setdefault(_PREFERRED, [])
    preferred.extend(t for t in terms if t not in preferred)
    return out
