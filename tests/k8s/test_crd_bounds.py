"""The CRD's bounds, enforced by the real API server at admission (no operator needed)."""

from __future__ import annotations

import json
from typing import Any

import pytest
import yaml

from tests.k8s.conftest import ROOT, Cluster

pytestmark = pytest.mark.k8s

EXAMPLE = ROOT / "examples" / "k8s" / "epd-tiny-cpu.yaml"


def _set(path: str, value: Any) -> Any:
    def mutate(spec: dict) -> None:
        *parents, leaf = path.split(".")
        node = spec
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value

    return mutate


def _both(*mutations: Any) -> Any:
    def mutate(spec: dict) -> None:
        for mutation in mutations:
            mutation(spec)

    return mutate


@pytest.mark.parametrize(
    ("mutate", "field", "words"),
    [
        (_set("engine.gpusPerInstance", 2), "spec.engine.gpusPerInstance",
         "less than or equal to 1"),
        (_set("router.replicas", 9), "spec.router.replicas", "less than or equal to 8"),
        (_set("engine.resources.limits.memory", "8Gb"), "spec.engine.resources.limits.memory",
         "should match"),
        (_set("engine.extraArgs", ["--x"] * 65), "spec.engine.extraArgs", "at most 64"),
        (_set("capacity", {"minGPUs": 3, "maxGPUs": 2}), "spec.capacity.minGPUs",
         "capacity.minGPUs must not exceed capacity.maxGPUs"),
        (_set("capacity", {"maxGPUs": 4097}), "spec.capacity.maxGPUs",
         "less than or equal to 4096"),
        (_set("capacity", {"maxGPUs": 1000}), "spec.capacity.maxGPUs",
         "capacity.maxGPUs must not exceed gpuBudget"),
        (_set("engine.roles", {"E": {"tensorParallelSize": 2}}),
         "spec.engine.roles.E.tensorParallelSize", "an E instance does not run"),
        (_set("engine.roles", {"EPD": {"tensorParallelSize": 3}}),
         "spec.engine.roles.EPD.tensorParallelSize", "supported values"),
        (_both(_set("disaggregation", {"mode": "Auto"}),
               _set("engine.roles", {"PD": {"tensorParallelSize": 2}})),
         "spec.engine.roles", "needs disaggregation mode Fixed"),
        (_set("disaggregation.tensorParallelSizes", [1, 2]),
         "spec.disaggregation.tensorParallelSizes", "sizes above 1 are for mode Auto"),
        (_both(_set("disaggregation", {"mode": "Auto"}),
               _set("disaggregation.tensorParallelSizes", [1, 3])),
         "spec.disaggregation.tensorParallelSizes[1]", "supported values"),
        (_both(_set("engine.emulate", True), _set("placement", {"mode": "Groups"})),
         "spec.engine.emulate", "engine.emulate runs each instance as its own pod"),
    ],
    ids=["gpus-per-instance", "router-replicas", "memory-quantity", "extra-args",
         "capacity-min-over-max", "capacity-max-bound", "capacity-max-over-budget",
         "tp-on-an-encoder", "tp-size", "tp-in-auto-mode", "tp-sizes-in-fixed-mode",
         "tp-sizes-bad-size", "emulated-groups"],
)  # fmt: skip
def test_api_server_rejects_values_the_engine_cannot_run(
    cluster: Cluster, crd: None, namespace: str, mutate: Any, field: str, words: str
) -> None:
    """Defect: gpusPerInstance up to 16, router replicas up to 64 and any quantity string were
    admitted; a bad quantity then failed as a 422 on the child Deployment, retried silently."""
    doc = yaml.safe_load(EXAMPLE.read_text())
    mutate(doc["spec"])
    proc = cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(doc), check=False
    )
    assert proc.returncode != 0, proc.stdout
    assert field in proc.stderr and words in proc.stderr, proc.stderr
    assert cluster.get("epddeployment", doc["metadata"]["name"], "-n", namespace) is None


def test_api_server_accepts_the_bounds_themselves(
    cluster: Cluster, crd: None, namespace: str
) -> None:
    doc = yaml.safe_load(EXAMPLE.read_text())
    for mutate in (
        _set("engine.gpusPerInstance", 1),
        _set("router.replicas", 8),
        _set("engine.resources.limits.memory", "1536Mi"),
    ):
        mutate(doc["spec"])
    cluster.kubectl(
        "apply", "--dry-run=server", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(doc)
    )
    # the profiler may split pools at 1 or 2 ranks (mode Auto)
    doc["spec"]["disaggregation"] = {"mode": "Auto", "tensorParallelSizes": [1, 2]}
    cluster.kubectl(
        "apply", "--dry-run=server", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(doc)
    )


GPU_EXAMPLE = ROOT / "examples" / "k8s" / "epd-gpu-2x8.yaml"


def _remove(path: str) -> Any:
    def mutate(spec: dict) -> None:
        *parents, leaf = path.split(".")
        node = spec
        for key in parents:
            node = node[int(key)] if isinstance(node, list) else node[key]
        del node[leaf]

    return mutate


def _both(*mutations: Any) -> Any:
    def mutate(spec: dict) -> None:
        for m in mutations:
            m(spec)

    return mutate


@pytest.mark.parametrize(
    ("mutate", "field", "words"),
    [
        (_set("engine.env", [{"name": "EPD_INTERNAL_TOKEN", "value": "x"}]),
         "spec.engine.env[0].name", "set by the operator"),
        (_set("engine.env", [{"name": "A", "value": "x", "valueFrom": {"fieldRef": {}}}]),
         "spec.engine.env[0]", "not both"),
        (_set("engine.env", [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]),
         "spec.engine.env[1]", "Duplicate value"),
        (_set("engine.envFrom", [{"prefix": "X_"}]), "spec.engine.envFrom[0]",
         "exactly one of configMapRef or secretRef"),
        (_set("engine.volumes", [{"name": "shm", "emptyDir": {}}]),
         "spec.engine.volumes[0].name", "operator's"),
        (_set("engine.volumeMounts", [{"name": "nowhere", "mountPath": "/data"}]),
         "spec.engine.volumeMounts", "must name one of engine.volumes"),
        (_both(_set("engine.volumes", [{"name": "x", "emptyDir": {}}]),
               _set("engine.volumeMounts", [{"name": "x", "mountPath": "/dev/shm/x"}])),
         "spec.engine.volumeMounts[0].mountPath", "operator's mounts"),
        (_set("engine.shmSize", "16GB"), "spec.engine.shmSize", "should match"),
        (_set("engine.runtimeClassName", "Nvidia_GPU"), "spec.engine.runtimeClassName",
         "should match"),
        (_set("engine.podLabels", {"epd.serving.dev/pool": "x"}), "spec.engine.podLabels",
         "podLabels may not set"),
        (_set("engine.terminationGracePeriodSeconds", 5),
         "spec.engine.terminationGracePeriodSeconds", "greater than or equal to 15"),
        (_set("engine.roles.E.gpusPerInstance", 2), "spec.engine.roles.E.gpusPerInstance",
         "less than or equal to 1"),
        (_set("gpuBudget", 19), "spec.gpuBudget", "the fixed pools need more GPUs"),
        (_both(_set("disaggregation", {"mode": "Auto"}), _set("engine.gpusPerInstance", 0),
               _set("engine.roles.P", {"gpusPerInstance": 1})),
         "spec.engine.roles", "may be lower, not higher"),
        (_both(_remove("model.source.pvc"), _set("model.source.preset", "tiny-llava")),
         "spec.model.source.huggingFaceCache", "set one of them"),
        (_set("model.source.huggingFaceCache.repo", "a/b/c"),
         "spec.model.source.huggingFaceCache.repo", "should match"),
    ],
    ids=["reserved-env", "env-two-sources", "env-duplicate", "env-from-no-ref",
         "reserved-volume", "mount-without-volume", "reserved-mount-path", "shm-quantity",
         "runtime-class", "reserved-label", "grace-period", "role-gpus", "role-budget",
         "auto-role-gpus", "hf-cache-without-volume", "hf-repo"],
)  # fmt: skip
def test_api_server_rejects_pod_settings_naming_the_field(
    cluster: Cluster, crd: None, namespace: str, mutate: Any, field: str, words: str
) -> None:
    doc = yaml.safe_load(GPU_EXAMPLE.read_text())
    mutate(doc["spec"])
    proc = cluster.kubectl(
        "apply", "--dry-run=server", "-n", namespace, "-f", "-", stdin=yaml.safe_dump(doc),
        check=False,
    )  # fmt: skip
    assert proc.returncode != 0, proc.stdout
    assert field in proc.stderr and words in proc.stderr, proc.stderr


def test_api_server_admits_the_gpu_example_and_the_pods_rendered_from_it(
    cluster: Cluster, crd: None, namespace: str
) -> None:
    """The CRD keeps the pass-through objects whole (affinity, volume sources, valueFrom) and
    the API server admits the Deployments the operator renders from them, per role."""
    from epd_operator.api.spec import EPDDeployment, fixed_plan
    from epd_operator.kube import manifests as r

    doc = yaml.safe_load(GPU_EXAMPLE.read_text())
    engine = doc["spec"]["engine"]
    engine["volumes"] = [{"name": "jit", "persistentVolumeClaim": {"claimName": "jit-cache"}}]
    engine["volumeMounts"] = [{"name": "jit", "mountPath": "/cache/flashinfer"}]
    engine["envFrom"] = [{"secretRef": {"name": "hf-token"}}]
    engine["env"].append(
        {"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf", "key": "token"}}}
    )
    engine["affinity"] = {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 10,
                    "podAffinityTerm": {
                        "topologyKey": "kubernetes.io/hostname",
                        "labelSelector": {"matchLabels": {"a": "b"}},
                    },
                }
            ]
        }
    }
    engine["imagePullSecrets"] = [{"name": "registry"}]
    engine["podLabels"] = {"team": "vision"}
    created = cluster.kubectl(
        "apply", "-n", namespace, "-f", "-", "-o", "json", stdin=yaml.safe_dump(doc)
    )  # fmt: skip
    stored = json.loads(created.stdout)["spec"]["engine"]
    assert stored["affinity"] == engine["affinity"]  # not pruned
    assert stored["volumes"] == engine["volumes"]
    assert stored["env"][-1]["valueFrom"] == {"secretKeyRef": {"name": "hf", "key": "token"}}
    dep = EPDDeployment.from_dict({**doc, "spec": json.loads(created.stdout)["spec"]})
    owner = r.Owner(name=dep.name, namespace=namespace, uid="uid-1", spec=dep.spec)
    plan = fixed_plan(dep.spec)
    for pool in r.pool_specs(owner, plan):
        manifest = r.render_pool_deployment(owner, pool, plan)
        manifest["metadata"].pop("ownerReferences")  # the uid above names no object
        cluster.kubectl(
            "apply", "--dry-run=server", "-n", namespace, "-f", "-", stdin=json.dumps(manifest)
        )
