"""The chart's RBAC with operator.watchNamespace set: a Role in that namespace only, enough
for a full reconcile pass (children, network policies, disruption budgets, status), and
nothing outside it. The pass runs with a token of the chart's ServiceAccount.

NetworkPolicy enforcement is not tested here: kwok runs no pods and the local control plane
has no CNI. The API server admits the rendered policies and they select exactly the pods
they should (see tests/operator/test_pod_safety.py for their content).
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import yaml
from kubernetes import config

from tests.k8s.conftest import ROOT, Cluster, _service_account_kubeconfig
from tests.k8s.reconcile_once import Pass, condition

pytestmark = pytest.mark.k8s
RELEASE = "epd-scoped"
RELEASE_NS = "epd-scoped-system"
WATCHED = "e2e-scoped-watched"
OTHER = "e2e-scoped-other"
SA = f"{RELEASE}-epd-operator"


@pytest.fixture(scope="module")
def scoped_chart(cluster: Cluster) -> Iterator[str]:
    """The chart installed to watch one namespace; returns the ServiceAccount's user name."""
    for ns in (WATCHED, OTHER):
        cluster.kubectl("create", "namespace", ns, check=False)
    cluster.run("helm", "uninstall", RELEASE, "-n", RELEASE_NS, "--wait", check=False)
    cluster.run(
        "helm", "install", RELEASE, str(ROOT / "charts" / "epd-operator"),
        "-n", RELEASE_NS, "--create-namespace",
        "--set", f"operator.watchNamespace={WATCHED}", "--set", "dashboards.enabled=false",
        timeout_s=180,
    )  # fmt: skip
    yield f"system:serviceaccount:{RELEASE_NS}:{SA}"
    cluster.run("helm", "uninstall", RELEASE, "-n", RELEASE_NS, check=False)
    for ns in (WATCHED, OTHER, RELEASE_NS):
        cluster.kubectl("delete", "namespace", ns, "--wait=false", check=False)


def can(cluster: Cluster, user: str, *args: str) -> bool:
    proc = cluster.kubectl("auth", "can-i", *args, "--as", user, check=False)
    return proc.stdout.strip() == "yes"


def test_a_watched_namespace_gets_a_role_not_a_cluster_role(
    cluster: Cluster, scoped_chart: str
) -> None:
    """Defect: a ClusterRole bound cluster-wide even with watchNamespace set."""
    assert cluster.get("clusterrole", SA) is None
    assert cluster.get("clusterrolebinding", SA) is None
    assert cluster.get("role", SA, "-n", WATCHED) is not None
    user = scoped_chart
    assert can(cluster, user, "create", "deployments.apps", "-n", WATCHED)
    assert can(cluster, user, "watch", "epddeployments.epd.serving.dev", "-n", WATCHED)
    assert can(
        cluster, user, "patch", "epddeployments.epd.serving.dev", "--subresource=status",
        "-n", WATCHED,
    )  # fmt: skip
    # nothing outside the watched namespace
    for verb, resource in [
        ("delete", "deployments.apps"),
        ("delete", "services"),
        ("get", "secrets"),
        ("list", "pods"),
        ("watch", "epddeployments.epd.serving.dev"),
    ]:
        assert not can(cluster, user, verb, resource, "-n", OTHER), (verb, resource)
    assert not can(cluster, user, "delete", "deployments.apps", "--all-namespaces")
    # Secrets: read back by name only, never listed or watched (no enumeration)
    assert can(cluster, user, "get", "secrets", "-n", WATCHED)
    assert not can(cluster, user, "list", "secrets", "-n", WATCHED)
    assert not can(cluster, user, "watch", "secrets", "-n", WATCHED)
    assert not can(cluster, user, "update", "secrets", "-n", WATCHED)


def test_a_full_pass_works_with_exactly_the_namespaced_role(
    cluster: Cluster, scoped_chart: str
) -> None:
    kubeconfig = _service_account_kubeconfig(cluster, SA, RELEASE_NS, name="scoped-operator")
    reconcile = Pass(config.new_client_from_config(config_file=str(kubeconfig)))
    doc = yaml.safe_load((ROOT / "examples" / "k8s" / "epd-tiny-cpu.yaml").read_text())
    cluster.kubectl("apply", "-n", WATCHED, "-f", "-", stdin=yaml.safe_dump(doc))
    status = reconcile(WATCHED, "tiny")
    assert condition(status, "Degraded")["status"] == "False", status
    pools = sorted(p["name"] for p in status["pools"])
    assert len(pools) == 3

    def names(kind: str) -> list[str]:
        return sorted(i["metadata"]["name"] for i in cluster.items(kind, "-n", WATCHED))

    assert names("networkpolicy") == ["tiny-engine", "tiny-router"]
    assert names("poddisruptionbudget") == sorted([*pools, "tiny-router"])
    assert names("secret") == ["tiny-internal-token"]
    router = cluster.get("deployment", "tiny-router", "-n", WATCHED)
    pod = router["spec"]["template"]["spec"]
    assert pod["securityContext"]["runAsNonRoot"] is True
    assert pod["containers"][0]["securityContext"]["readOnlyRootFilesystem"] is True
    # a second pass reads the token back and changes nothing
    again = reconcile(WATCHED, "tiny")
    assert sorted(p["name"] for p in again["pools"]) == pools
