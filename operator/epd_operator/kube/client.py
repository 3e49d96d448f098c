"""The operator's only door to the API server (kubernetes client, synchronous).

Every call here is one the chart's RBAC grants (charts/epd-operator/templates/rbac.yaml):
deployments (get/list/create/update/delete), services (get/create/update/delete),
configmaps (get/create/update; get also reads ``spec.profiler.costModel``), secrets
(get/create), pods (list, to explain unschedulable, crash-looping, OOM-killed or image-less
ones), networkpolicies and poddisruptionbudgets (get/list/create/update/delete).
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any

from kubernetes import client
from kubernetes.client.exceptions import ApiException

from epd_engine.config import Role
from epd_operator.kube.manifests import (
    ANNOTATION_HASH,
    LABEL_COMPONENT,
    LABEL_DEPLOYMENT,
    LABEL_POOL,
    LABEL_ROLE,
    Manifest,
    label_value,
)
from epd_operator.kube.names import ANNOTATION_GPUS
from epd_operator.rollout.state_machine import ObservedPool


def _gpus_per_pod(dep: Any, gpu_resource: str) -> int:
    """GPUs of each pod of a pool Deployment: as the operator annotated it (any resource
    name), else the limit of ``gpu_resource`` (a Deployment an older operator made)."""
    annotated = ((dep.metadata.annotations if dep.metadata else None) or {}).get(ANNOTATION_GPUS)
    if annotated is not None and annotated.isdigit():
        return int(annotated)
    pod_spec = dep.spec.template.spec
    container = pod_spec.containers[0] if pod_spec else None
    resources = container.resources if container else None
    limits = (resources.limits or {}) if resources else {}
    return int(limits.get(gpu_resource, 0))


class Kube:
    def __init__(self, api_client: client.ApiClient | None = None) -> None:
        self.core = client.CoreV1Api(api_client)
        self.apps = client.AppsV1Api(api_client)
        self.networking = client.NetworkingV1Api(api_client)
        self.policy = client.PolicyV1Api(api_client)

    # --- generic apply -----------------------------------------------------------------------

    def _ops(self, kind: str) -> tuple[Any, Any, Any]:
        ops = {
            "Deployment": (
                self.apps.read_namespaced_deployment,
                self.apps.create_namespaced_deployment,
                self.apps.replace_namespaced_deployment,
            ),
            "Service": (
                self.core.read_namespaced_service,
                self.core.create_namespaced_service,
                self.core.replace_namespaced_service,
            ),
            "ConfigMap": (
                self.core.read_namespaced_config_map,
                self.core.create_namespaced_config_map,
                self.core.replace_namespaced_config_map,
            ),
            "NetworkPolicy": (
                self.networking.read_namespaced_network_policy,
                self.networking.create_namespaced_network_policy,
                self.networking.replace_namespaced_network_policy,
            ),
            "PodDisruptionBudget": (
                self.policy.read_namespaced_pod_disruption_budget,
                self.policy.create_namespaced_pod_disruption_budget,
                self.policy.replace_namespaced_pod_disruption_budget,
            ),
        }
        return ops[kind]

    def apply(self, manifest: Manifest) -> str:
        """Create, or replace when the content hash differs. Returns created/updated/unchanged."""
        meta = manifest["metadata"]
        read, create, replace = self._ops(manifest["kind"])
        try:
            current = read(meta["name"], meta["namespace"])
        except ApiException as exc:
            if exc.status != 404:
                raise
            create(meta["namespace"], manifest)
            return "created"
        annotations = (current.metadata.annotations if current.metadata else None) or {}
        if annotations.get(ANNOTATION_HASH) == meta["annotations"][ANNOTATION_HASH]:
            return "unchanged"
        body = {
            **manifest,
            "metadata": {**meta, "resourceVersion": current.metadata.resource_version},
        }
        replace(meta["name"], meta["namespace"], body)
        return "updated"

    def ensure_secret(self, manifest_for: Any, namespace: str, name: str) -> str:
        """The internal token Secret: created once with a random token, never rewritten."""
        try:
            secret = self.core.read_namespaced_secret(name, namespace)
            data = secret.data or {}
            import base64

            return base64.b64decode(data.get("token", "")).decode()
        except ApiException as exc:
            if exc.status != 404:
                raise
        token = secrets.token_urlsafe(32)
        self.core.create_namespaced_secret(namespace, manifest_for(token))
        return token

    def read_config_map_key(self, namespace: str, name: str, key: str) -> str:
        """One data value of a ConfigMap; ValueError naming it when it or the key is missing."""
        try:
            config_map = self.core.read_namespaced_config_map(name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                raise ValueError(f"ConfigMap {namespace}/{name} not found") from None
            raise
        data = config_map.data or {}
        if key not in data:
            raise ValueError(f"ConfigMap {namespace}/{name} has no key {key!r}")
        return str(data[key])

    # --- observation -------------------------------------------------------------------------

    def observe_pools(
        self, namespace: str, owner_name: str, gpu_resource: str
    ) -> dict[str, ObservedPool]:
        selector = f"{LABEL_DEPLOYMENT}={label_value(owner_name)},{LABEL_COMPONENT}=engine"
        deployments = self.apps.list_namespaced_deployment(namespace, label_selector=selector)
        stuck = self._unschedulable(namespace, selector)
        pools = {}
        for dep in deployments.items:
            meta, spec, status = dep.metadata, dep.spec, dep.status
            if meta is None or spec is None or meta.deletion_timestamp is not None:
                continue
            labels = meta.labels or {}
            name = str(labels.get(LABEL_POOL, meta.name))
            replicas = spec.replicas or 0
            per_pod = _gpus_per_pod(dep, gpu_resource)
            pools[name] = ObservedPool(
                name=name,
                role=Role(labels.get(LABEL_ROLE, "EPD")),
                replicas=replicas,
                ready=(status.ready_replicas or 0) if status else 0,
                gpus=replicas * per_pod,
                unschedulable=stuck.get(name, ""),
            )
        return pools

    def _unschedulable(self, namespace: str, selector: str) -> dict[str, str]:
        pods = self.core.list_namespaced_pod(namespace, label_selector=selector)
        out: dict[str, str] = {}
        for pod in pods.items:
            pool = ((pod.metadata.labels if pod.metadata else None) or {}).get(LABEL_POOL, "")
            for cond in (pod.status.conditions or []) if pod.status else []:
                if (
                    cond.type == "PodScheduled"
                    and cond.status == "False"
                    and cond.reason == "Unschedulable"
                ):
                    out.setdefault(pool, cond.message or "unschedulable")
        return out

    def router_ready(self, namespace: str, name: str) -> bool:
        try:
            dep = self.apps.read_namespaced_deployment(name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return False
            raise
        return dep.status is not None and (dep.status.available_replicas or 0) >= 1

    def router_addresses(self, namespace: str, owner_name: str, port: int) -> list[str]:
        """``http://IP:port`` of every router pod that has an IP and is not terminating: each
        replica is switched and read on its own (the Service reaches only one)."""
        selector = f"{LABEL_DEPLOYMENT}={label_value(owner_name)},{LABEL_COMPONENT}=router"
        pods = self.core.list_namespaced_pod(namespace, label_selector=selector)
        return sorted(
            f"http://{pod.status.pod_ip}:{port}"
            for pod in pods.items
            if pod.status is not None
            and pod.status.pod_ip
            and pod.status.phase == "Running"
            and (pod.metadata is None or pod.metadata.deletion_timestamp is None)
        )

    def list_names(self, kind: str, namespace: str, selector: str) -> list[str]:
        """Names of the Deployments, NetworkPolicies or PodDisruptionBudgets matching a label
        selector, leaving out those being deleted."""
        lister: Callable[..., Any] = {
            "Deployment": self.apps.list_namespaced_deployment,
            "NetworkPolicy": self.networking.list_namespaced_network_policy,
            "PodDisruptionBudget": self.policy.list_namespaced_pod_disruption_budget,
        }[kind]
        items = lister(namespace, label_selector=selector).items
        return sorted(
            i.metadata.name
            for i in items
            if i.metadata is not None and i.metadata.deletion_timestamp is None
        )

    def delete(self, kind: str, namespace: str, name: str) -> None:
        """Delete a NetworkPolicy or PodDisruptionBudget; gone already is fine."""
        delete: Callable[..., Any] = {
            "NetworkPolicy": self.networking.delete_namespaced_network_policy,
            "PodDisruptionBudget": self.policy.delete_namespaced_pod_disruption_budget,
        }[kind]
        try:
            delete(name, namespace)
        except ApiException as exc:
            if exc.status != 404:
                raise

    # --- deletion ----------------------------------------------------------------------------

    def delete_pool(self, namespace: str, name: str) -> None:
        for delete in (self.apps.delete_namespaced_deployment, self.core.delete_namespaced_service):
            try:
                delete(name, namespace, propagation_policy="Background")
            except ApiException as exc:
                if exc.status != 404:
                    raise
