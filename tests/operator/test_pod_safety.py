"""Safe defaults of what the operator renders: pod security, default resources, network
policies and disruption budgets (the real API server admits them in tests/k8s)."""

from __future__ import annotations

from epd_engine.config import Method, Role
from epd_engine.contracts.plan import Plan
from epd_operator.kube import manifests as r
from epd_operator.kube.manifests import Owner
from tests.operator.conftest import make_owner

PLAN = Plan(method=Method.E_P_D, pools={Role.E: 1, Role.P: 2, Role.D: 1})


def _pod_specs(owner: Owner) -> dict[str, dict]:
    pool = r.pool_specs(owner, PLAN)[0]
    return {
        "engine": r.render_pool_deployment(owner, pool, PLAN)["spec"]["template"]["spec"],
        "router": r.render_router_deployment(owner)["spec"]["template"]["spec"],
    }


def test_engine_and_router_pods_run_least_privileged(owner: Owner) -> None:
    """Defect: engine and router pods had no securityContext (root, all default caps)."""
    for component, pod in _pod_specs(owner).items():
        assert pod["securityContext"]["runAsNonRoot"] is True, component
        assert pod["securityContext"]["runAsUser"] == 10001
        assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
        assert pod["automountServiceAccountToken"] is False
        container = pod["containers"][0]
        sc = container["securityContext"]
        assert sc["allowPrivilegeEscalation"] is False
        assert sc["readOnlyRootFilesystem"] is True
        assert sc["capabilities"] == {"drop": ["ALL"]}
        # the read-only root needs a writable /tmp for caches, and HOME pointing there
        assert {"name": "tmp", "mountPath": "/tmp"} in container["volumeMounts"]
        assert {"name": "HOME", "value": "/tmp"} in container["env"]
        assert {"name": "tmp", "emptyDir": {}} in pod["volumes"]


def test_pods_without_resources_get_defaults_so_none_is_best_effort(owner: Owner) -> None:
    """Defect: a spec without resources gave BestEffort pods (evicted first)."""
    pods = _pod_specs(owner)
    engine = pods["engine"]["containers"][0]["resources"]
    assert engine["requests"]["cpu"] == "1" and engine["requests"]["memory"] == "2Gi"
    assert engine["requests"]["nvidia.com/gpu"] == "1" == engine["limits"]["nvidia.com/gpu"]
    router = pods["router"]["containers"][0]["resources"]
    assert router == {"requests": {"cpu": "250m", "memory": "256Mi"}, "limits": {"memory": "2Gi"}}


def test_spec_resources_win_over_defaults_and_a_lone_limit_drops_the_default_request() -> None:
    owner = make_owner(
        engine={"gpusPerInstance": 0, "resources": {"requests": {"cpu": "4"}}},
        router={"resources": {"limits": {"memory": "128Mi"}}},
    )
    pods = _pod_specs(owner)
    engine = pods["engine"]["containers"][0]["resources"]
    assert engine == {"requests": {"cpu": "4", "memory": "2Gi"}}
    router = pods["router"]["containers"][0]["resources"]
    # a default request of 256Mi over the user's 128Mi limit would be rejected (request > limit)
    assert router == {"requests": {"cpu": "250m"}, "limits": {"memory": "128Mi"}}


def test_engine_policy_admits_only_this_deployment_and_named_namespaces() -> None:
    owner = make_owner(networkPolicy={"allowFromNamespaces": ["monitoring"]})
    policy = r.render_engine_network_policy(owner)
    spec = policy["spec"]
    assert policy["metadata"]["name"] == "demo-engine"
    assert spec["podSelector"]["matchLabels"] == {
        r.LABEL_DEPLOYMENT: "demo",
        r.LABEL_COMPONENT: "engine",
    }
    assert spec["policyTypes"] == ["Ingress"]
    same, monitoring = spec["ingress"]
    assert same == {"from": [{"podSelector": {"matchLabels": {r.LABEL_DEPLOYMENT: "demo"}}}]}
    assert monitoring["from"] == [
        {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}
    ]
    assert monitoring["ports"] == [{"protocol": "TCP", "port": r.ENGINE_PORT}]


def test_router_policy_opens_only_the_router_port(owner: Owner) -> None:
    spec = r.render_router_network_policy(owner)["spec"]
    assert spec["podSelector"]["matchLabels"] == r.router_selector(owner)
    assert spec["ingress"] == [{"ports": [{"protocol": "TCP", "port": 8080}]}]


def test_one_disruption_budget_per_pool_selects_exactly_its_pods(owner: Owner) -> None:
    for pool in r.pool_specs(owner, PLAN):
        pdb = r.render_pool_disruption_budget(owner, pool.name)
        assert pdb["metadata"]["name"] == pool.name
        assert pdb["metadata"]["labels"][r.LABEL_POOL] == pool.name
        assert pdb["spec"] == {
            "maxUnavailable": 1,
            "selector": {"matchLabels": r.pool_selector(owner, pool)},
        }
    router = r.render_router_disruption_budget(owner)
    assert router["spec"]["selector"]["matchLabels"] == r.router_selector(owner)
