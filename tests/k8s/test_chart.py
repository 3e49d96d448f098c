"""The Helm chart: lint --strict clean, renders every optional piece (helm from .build/bin)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.k8s.conftest import BIN, REQUIRED, ROOT

pytestmark = pytest.mark.k8s
CHART = ROOT / "charts" / "epd-operator"


def helm(*args: str) -> subprocess.CompletedProcess:
    if not (BIN / "helm").is_file():
        reason = "helm not built; run `make cluster-bins`"
        if REQUIRED:
            pytest.fail(f"EPD_REQUIRE_K8S=1: {reason}")
        pytest.skip(reason)
    return subprocess.run([str(BIN / "helm"), *args], capture_output=True, text=True, timeout=60)


def test_helm_lint_strict_is_clean() -> None:
    proc = helm("lint", "--strict", str(CHART))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 chart(s) failed" in proc.stdout
    assert "[WARNING]" not in proc.stdout, proc.stdout


def test_template_renders_servicemonitor_and_dashboards(tmp_path: Path) -> None:
    chart = tmp_path / "epd-operator"
    shutil.copytree(CHART, chart, symlinks=False)
    (chart / "dashboards" / "epd-overview.json").write_text(
        json.dumps({"uid": "epd-test", "id": None})
    )
    proc = helm(
        "template", "epd", str(chart), "-n", "epd-system", "--kube-version", "1.34.0",
        "--set", "serviceMonitor.enabled=true", "--set", "operator.watchNamespace=team-a",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    assert ("ServiceMonitor", "epd-epd-operator") in kinds
    dashboards = [d for d in docs if d["kind"] == "ConfigMap"]
    assert dashboards and dashboards[0]["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert "epd-overview.json" in dashboards[0]["data"]
    operator = next(d for d in docs if d["kind"] == "Deployment")
    assert "--namespace=team-a" in operator["spec"]["template"]["spec"]["containers"][0]["args"]


def test_values_schema_rejects_bad_values() -> None:
    proc = helm(
        "template",
        "epd",
        str(CHART),
        "--kube-version",
        "1.34.0",
        "--set",
        "image.pullPolicy=Sometimes",
    )
    assert proc.returncode != 0
    assert "pullPolicy" in proc.stderr


def _rbac(*sets: str) -> list[dict]:
    args = [a for s in sets for a in ("--set", s)]
    proc = helm(
        "template", "epd", str(CHART), "-n", "epd-system", "--kube-version", "1.34.0", *args
    )
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    return [d for d in docs if d["apiVersion"].startswith("rbac.authorization.k8s.io")]


def test_rbac_is_namespaced_when_a_namespace_is_watched() -> None:
    """Defect: a ClusterRole bound cluster-wide even with operator.watchNamespace set."""
    scoped = _rbac("operator.watchNamespace=team-a")
    assert [(d["kind"], d["metadata"]["namespace"]) for d in scoped] == [
        ("Role", "team-a"),
        ("RoleBinding", "team-a"),
    ]
    assert scoped[1]["roleRef"]["kind"] == "Role"
    wide = _rbac()
    assert [d["kind"] for d in wide] == ["ClusterRole", "ClusterRoleBinding"]


def test_rbac_grants_no_wildcards_and_no_secret_enumeration() -> None:
    for docs in (_rbac(), _rbac("operator.watchNamespace=team-a")):
        rules = docs[0]["rules"]
        assert all("*" not in r["verbs"] and "*" not in r["resources"] for r in rules)
        secrets = [r["verbs"] for r in rules if "secrets" in r["resources"]]
        assert secrets == [["get", "create"]]
        assert not any("deletecollection" in r["verbs"] for r in rules)


def _render(*sets: str) -> list[dict]:
    args = [a for s in sets for a in ("--set", s)]
    proc = helm(
        "template", "epd", str(CHART), "-n", "epd-system", "--kube-version", "1.34.0", *args
    )
    assert proc.returncode == 0, proc.stderr
    return [d for d in yaml.safe_load_all(proc.stdout) if d]


def test_operator_metrics_port_is_served_and_scraped() -> None:
    docs = _render("serviceMonitor.enabled=true")
    operator = next(d for d in docs if d["kind"] == "Deployment")
    pod = operator["spec"]["template"]
    container = pod["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["EPD_OPERATOR_METRICS_PORT"] == "8081"  # operator_metrics.serve listens here
    assert {"name": "metrics", "containerPort": 8081} in container["ports"]
    service = next(d for d in docs if d["kind"] == "Service")
    assert service["spec"]["ports"] == [{"name": "metrics", "port": 8081, "targetPort": "metrics"}]
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()
    monitor = next(d for d in docs if d["metadata"]["name"] == "epd-epd-operator-self")
    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    assert monitor["spec"]["endpoints"][0]["port"] == "metrics"
    # the series' own namespace (the EPDDeployment's, as the dashboards filter) wins
    assert monitor["spec"]["endpoints"][0]["honorLabels"] is True


def test_operator_metrics_off() -> None:
    docs = _render("serviceMonitor.enabled=true", "operator.metricsPort=0")
    container = next(d for d in docs if d["kind"] == "Deployment")["spec"]["template"]["spec"]
    assert [p["name"] for p in container["containers"][0]["ports"]] == ["health"]
    assert not [d for d in docs if d["kind"] == "Service"]
    assert [d["metadata"]["name"] for d in docs if d["kind"] == "ServiceMonitor"] == [
        "epd-epd-operator"
    ]
