"""NetworkPolicies and PodDisruptionBudgets of one EPDDeployment, kept in step with its pools.

One call per reconcile pass, after the pools and the router are written: a budget for every
pool Deployment that exists and is not being deleted (a draining old pool included) and one
for the router; budgets of pools that are gone are deleted; the two NetworkPolicies are
applied (or deleted when ``spec.networkPolicy.enabled`` is false). Manifests: resources.py.
"""

from __future__ import annotations

from epd_operator.kube import manifests as r
from epd_operator.kube.client import Kube


def _selector(owner: r.Owner, component: str) -> str:
    return f"{r.LABEL_DEPLOYMENT}={r.label_value(owner.name)},{r.LABEL_COMPONENT}={component}"


def converge(kube: Kube, owner: r.Owner) -> None:
    ns = owner.namespace
    pool_names = set(kube.list_names("Deployment", ns, _selector(owner, "engine")))
    for name in sorted(pool_names):
        kube.apply(r.render_pool_disruption_budget(owner, name))
    for stale in kube.list_names("PodDisruptionBudget", ns, _selector(owner, "engine")):
        if stale not in pool_names:
            kube.delete("PodDisruptionBudget", ns, stale)
    kube.apply(r.render_router_disruption_budget(owner))

    policies = [r.render_engine_network_policy(owner), r.render_router_network_policy(owner)]
    for policy in policies:
        if owner.spec.network_policy.enabled:
            kube.apply(policy)
        else:
            kube.delete("NetworkPolicy", ns, policy["metadata"]["name"])
