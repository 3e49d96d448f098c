"""Degraded tells crash loops, image-pull failures, OOM kills and API errors (422), with the
reason and the pods named, and posts a Warning event per new finding.

kwok runs no containers, so the kubelet's part is played here: pods of a pool are created
with a scheduler name nothing serves (so neither the scheduler nor kwok touches them) and
their container states are written through the pods' status subresource, as a kubelet
writes them. Everything else is the real controller against the real API server.
"""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from kubernetes import client

from epd_operator.kube import manifests as r
from tests.k8s.conftest import ROOT, Cluster
from tests.k8s.reconcile_once import Pass, condition

pytestmark = pytest.mark.k8s
EXAMPLE = ROOT / "examples" / "k8s" / "epd-tiny-cpu.yaml"
NAME = "tiny"


def _apply_example(cluster: Cluster, namespace: str, **engine: Any) -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    doc["spec"]["engine"].update(engine)
    cluster.kubectl("apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(doc))


def _failing_pod(
    core: client.CoreV1Api, namespace: str, pool: str, name: str, state: dict, last: dict
) -> None:
    labels = {r.LABEL_DEPLOYMENT: NAME, r.LABEL_COMPONENT: "engine", r.LABEL_POOL: pool}
    core.create_namespaced_pod(
        namespace,
        {
            "metadata": {"name": name, "labels": labels},
            "spec": {
                "schedulerName": "nobody",  # stays Pending and untouched: we are its kubelet
                "containers": [{"name": "engine", "image": "epd-engine:dev"}],
            },
        },
    )
    status = {
        "phase": "Running",
        "containerStatuses": [
            {
                "name": "engine", "image": "epd-engine:dev", "imageID": "", "ready": False,
                "restartCount": 4, "state": state, "lastState": last,
            }
        ],
    }  # fmt: skip
    core.patch_namespaced_pod_status(name, namespace, {"status": status})


def test_crash_loop_image_pull_and_oom_kill_are_degraded_naming_the_pods(
    cluster: Cluster, crd: None, namespace: str
) -> None:
    """Defect: only unschedulable pods made Degraded; these read as AsExpected."""
    api = cluster.api_client()
    core = client.CoreV1Api(api)
    reconcile = Pass(api)
    _apply_example(cluster, namespace)
    status = reconcile(namespace, NAME)
    assert condition(status, "Degraded")["status"] == "False"
    pool = status["pools"][0]["name"]

    _failing_pod(
        core, namespace, pool, "pull",
        {"waiting": {"reason": "ImagePullBackOff",
                     "message": 'Back-off pulling image "epd-engine:nope"'}},
        {},
    )  # fmt: skip
    status = reconcile(namespace, NAME)
    degraded = condition(status, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ImagePullFailed")
    assert (
        'pod pull container engine: ImagePullBackOff: Back-off pulling image "epd-engine:nope"'
        in (degraded["message"])
    )

    _failing_pod(
        core, namespace, pool, "crash",
        {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
        {"terminated": {"exitCode": 1, "reason": "Error"}},
    )  # fmt: skip
    _failing_pod(
        core, namespace, pool, "oom",
        {"waiting": {"reason": "CrashLoopBackOff", "message": "back-off 40s"}},
        {"terminated": {"exitCode": 137, "reason": "OOMKilled"}},
    )  # fmt: skip
    status = reconcile(namespace, NAME)
    degraded = condition(status, "Degraded")
    assert degraded["reason"] == "OOMKilled"  # the most telling first
    message = degraded["message"]
    assert message.startswith("pod oom container engine: OOMKilled at its memory limit")
    assert "pod crash container engine: CrashLoopBackOff: back-off 40s (last exit 1" in message
    assert "pod pull container engine: ImagePullBackOff" in message
    # the status the API server stored says the same
    stored = cluster.get("epddeployment", NAME, "-n", namespace)
    assert condition(stored["status"], "Degraded")["reason"] == "OOMKilled"

    # pod problems only (no router runs here, so routing warnings come too)
    pod_problems = {"ImagePullFailed", "OOMKilled", "CrashLoop"}
    warnings = [(reason, msg.split(":")[0]) for type_, reason, msg in reconcile.events
                if type_ == "Warning" and reason in pod_problems]  # fmt: skip
    assert warnings == [
        ("ImagePullFailed", "pod pull container engine"),
        ("OOMKilled", "pod oom container engine"),
        ("CrashLoop", "pod crash container engine"),
    ]
    reconcile(namespace, NAME)  # nothing new: no new events
    assert len([e for e in reconcile.events if e[0] == "Warning" and e[1] in pod_problems]) == 3

    for name in ("pull", "crash", "oom"):
        core.delete_namespaced_pod(name, namespace, grace_period_seconds=0)
    status = reconcile(namespace, NAME)
    assert condition(status, "Degraded")["status"] == "False"


def test_an_api_error_is_degraded_with_the_servers_message(
    cluster: Cluster, crd: None, namespace: str
) -> None:
    """Defect: a 422 from the API server (here a node selector key Kubernetes refuses, which
    the CRD cannot check) was retried every few seconds with nothing in status."""
    reconcile = Pass(cluster.api_client())
    _apply_example(cluster, namespace, nodeSelector={"bad key!": "x"})
    status = reconcile(namespace, NAME)
    degraded = condition(status, "Degraded")
    assert (degraded["status"], degraded["reason"]) == ("True", "ApiRejected")
    assert degraded["message"].startswith("API error 422: Deployment.apps")
    assert "nodeSelector" in degraded["message"]
    stored = cluster.get("epddeployment", NAME, "-n", namespace)
    assert condition(stored["status"], "Degraded")["message"] == degraded["message"]
    assert [e[1] for e in reconcile.events if e[0] == "Warning"] == ["ApiRejected"]
    reconcile(namespace, NAME)  # the same error again: no second event
    assert [e[1] for e in reconcile.events if e[0] == "Warning"] == ["ApiRejected"]

    # fixing the spec recovers on the next pass
    cluster.kubectl(
        "patch", "epd", NAME, "-n", namespace, "--type", "json",
        "-p", '[{"op": "remove", "path": "/spec/engine/nodeSelector"}]',
    )  # fmt: skip
    status = reconcile(namespace, NAME)
    assert condition(status, "Degraded")["status"] == "False"
