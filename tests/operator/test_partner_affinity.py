"""Pools that exchange caches prefer their partners' nodes (kube/partner_affinity.py), on the
rendered manifests; tests/k8s/test_partner_placement.py runs them through the scheduler."""

from __future__ import annotations

from typing import Any

import pytest

from epd_engine.config import Method, Role
from epd_engine.contracts.cache_partners import cache_handoffs, cache_partners
from epd_engine.contracts.plan import Plan
from epd_operator.kube import manifests as r
from epd_operator.kube.manifests import Owner
from epd_operator.kube.partner_affinity import HOSTNAME_KEY, PARTNER_WEIGHT
from tests.operator.conftest import make_owner

PREFERRED = "preferredDuringSchedulingIgnoredDuringExecution"
ALL_ONE = {m: Plan(method=m, pools=dict.fromkeys(m.roles, 1)) for m in Method}


def _affinities(owner: Owner, plan: Plan) -> dict[Role, dict[str, Any] | None]:
    return {
        pool.role: r.render_pool_deployment(owner, pool, plan)["spec"]["template"]["spec"].get(
            "affinity"
        )
        for pool in r.pool_specs(owner, plan)
    }


def _partner_roles(affinity: dict[str, Any] | None) -> list[str]:
    if affinity is None:
        return []
    out = []
    for term in affinity["podAffinity"][PREFERRED]:
        assert term["weight"] == PARTNER_WEIGHT
        assert term["podAffinityTerm"]["topologyKey"] == HOSTNAME_KEY
        labels = term["podAffinityTerm"]["labelSelector"]["matchLabels"]
        assert labels[r.LABEL_DEPLOYMENT] == "demo"  # only this deployment's pods
        out.append(labels[r.LABEL_ROLE])
    return out


@pytest.mark.parametrize(
    ("method", "handoffs"),
    [
        (Method.E_P_D, [("E", "P"), ("P", "D")]),
        (Method.EP_D, [("EP", "D")]),
        (Method.ED_P, [("ED", "P"), ("P", "ED")]),
        (Method.E_PD, [("E", "PD")]),
        (Method.EPD, []),
    ],
)
def test_handoffs_per_method(method: Method, handoffs: list[tuple[str, str]]) -> None:
    assert [(a.value, b.value) for a, b in cache_handoffs(method)] == handoffs


@pytest.mark.parametrize("method", list(Method))
def test_each_pool_prefers_the_nodes_of_the_pools_it_exchanges_caches_with(
    method: Method,
) -> None:
    affinities = _affinities(make_owner(), ALL_ONE[method])
    for role, affinity in affinities.items():
        assert _partner_roles(affinity) == [p.value for p in cache_partners(method, role)]
    if method is Method.EPD:
        assert affinities == {Role.EPD: None}  # nothing to keep together
    if method is Method.E_P_D:
        assert _partner_roles(affinities[Role.P]) == ["E", "D"]


def test_the_spec_affinity_is_kept_and_the_partner_terms_appended() -> None:
    own_term = {
        "weight": 10,
        "podAffinityTerm": {
            "labelSelector": {"matchLabels": {"app": "cache"}},
            "topologyKey": "topology.kubernetes.io/zone",
        },
    }
    user = {
        "nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [
                    {"matchExpressions": [{"key": "gpu", "operator": "In", "values": ["h100"]}]}
                ]
            }
        },
        "podAffinity": {PREFERRED: [own_term]},
        "podAntiAffinity": {
            PREFERRED: [
                {
                    "weight": 5,
                    "podAffinityTerm": {
                        "labelSelector": {"matchLabels": {"noisy": "true"}},
                        "topologyKey": HOSTNAME_KEY,
                    },
                }
            ]
        },
    }
    owner = make_owner(engine={"affinity": user})
    affinity = _affinities(owner, ALL_ONE[Method.EP_D])[Role.D]
    assert affinity is not None
    assert affinity["nodeAffinity"] == user["nodeAffinity"]
    assert affinity["podAntiAffinity"] == user["podAntiAffinity"]
    preferred = affinity["podAffinity"][PREFERRED]
    assert preferred[0] == own_term  # the user's first, untouched
    assert _partner_roles({"podAffinity": {PREFERRED: preferred[1:]}}) == ["EP"]
    # the spec itself is not changed by rendering (a second render gives the same)
    assert owner.spec.engine.affinity == user
    assert _affinities(owner, ALL_ONE[Method.EP_D])[Role.D] == affinity


def test_pairs_on_exclusive_node_tiers_get_no_term() -> None:
    """Encoders on L4 nodes never share a node with H100 prefill: no term toward them, while
    P and D (both H100) still prefer each other."""
    engine = {
        "nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
        "roles": {"E": {"nodeSelector": {"nvidia.com/gpu.product": "NVIDIA-L4"}}},
    }
    affinities = _affinities(make_owner(engine=engine), ALL_ONE[Method.E_P_D])
    assert affinities[Role.E] is None
    assert _partner_roles(affinities[Role.P]) == ["D"]
    assert _partner_roles(affinities[Role.D]) == ["P"]
    # a selector on another key does not exclude: E may share a node with P
    engine["roles"] = {"E": {"nodeSelector": {"pool": "vision"}}}
    affinities = _affinities(make_owner(engine=engine), ALL_ONE[Method.E_P_D])
    assert _partner_roles(affinities[Role.E]) == ["P"]
