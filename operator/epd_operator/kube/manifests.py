"""Pure rendering: (EPDDeployment, plan) -> Kubernetes manifests (plain dicts).

Nothing here talks to the API server. Child names are deterministic:

- ``<name>-config`` ConfigMap (router.json, plan.json), ``<name>-internal-token`` Secret,
- ``<name>-router`` Deployment + Service (the inference endpoint), and the headless
  ``<name>-router-pods`` Service through which instances find every router replica,
- ``<name>-<role>-<hash8>`` Deployment + headless Service per pool, where ``hash8`` covers
  what instances of one pool must share (role, replicas, model, SLO, cache geometry, transfer
  backend, the role's GPUs: ``rollout/pool_identity.py``). A pool whose identity does not
  change keeps its name across plans; a changed one is a new name, brought up next to the old
  one (blue/green per pool). The rest of a pod (image, arguments, env, volumes, placement:
  ``pod_template.py``) rolls within the pool, replica by replica (``update_strategy.py``).
- with ``spec.placement.mode: Groups``, ``<name>-group-<hash8>`` Deployment + headless Service
  of group pods, one slice of the plan each (``group_pools.py``, ``group_pods.py``), beside
  the pools of the instances left over,
- ``<name>-engine`` and ``<name>-router`` NetworkPolicies, a PodDisruptionBudget per pool
  (named like it) and ``<name>-router`` for the router (kept in step by ``guardrails.py``).

Engine and router pods run non-root with every capability dropped, no privilege escalation,
the runtime's default seccomp profile and a read-only root filesystem (``pod_template.py``);
resources a spec leaves out get defaults, so no pod is BestEffort.
"""

from __future__ import annotations

import json
from typing import Any

from epd_engine.contracts.plan import Plan
from epd_operator.api.images import ENGINE_IMAGE
from epd_operator.api.spec import API_VERSION, KIND
from epd_operator.kube.emulated_pods import served_model_name
from epd_operator.kube.group_pods import group_pod_template, member_ports, members_label
from epd_operator.kube.group_pools import deployment_pools
from epd_operator.kube.names import (
    ANNOTATION_GPUS,
    ENGINE_PORT,
    LABEL_COMPONENT,
    LABEL_DEPLOYMENT,
    LABEL_POOL,
    LABEL_ROLE,
    MODELS_DIR,
    config_name,
    label_value,
    labels,
    secret_name,
)
from epd_operator.kube.pod_template import (
    auth_env,
    container_security_context,
    engine_pod_template,
    place,
    pod_security_context,
    probe,
    pull_secrets,
    resources,
    writable_tmp,
)
from epd_operator.kube.update_strategy import update_strategy
from epd_operator.rollout.pool_identity import (
    Owner,
    PoolSpec,
    base_name,
    content_digest,
    pool_specs,
)

__all__ = [  # shared names, re-exported: callers render and name children from here
    "ANNOTATION_GPUS",
    "ENGINE_PORT",
    "LABEL_COMPONENT",
    "LABEL_DEPLOYMENT",
    "LABEL_POOL",
    "LABEL_ROLE",
    "MODELS_DIR",
    "Owner",
    "PoolSpec",
    "config_name",
    "deployment_pools",
    "label_value",
    "labels",
    "pool_specs",
    "secret_name",
]

ROUTER_CONFIG_DIR = "/etc/epd"
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
ANNOTATION_HASH = "epd.serving.dev/spec-hash"
# The router is small, so it also gets a memory limit.
DEFAULT_ROUTER_RESOURCES: dict[str, dict[str, str]] = {
    "requests": {"cpu": "250m", "memory": "256Mi"},
    "limits": {"memory": "2Gi"},
}

Manifest = dict[str, Any]


def router_name(owner: Owner) -> str:
    return f"{base_name(owner)}-router"


def router_url(owner: Owner) -> str:
    """The inference endpoint: any one replica, picked per connection."""
    return f"http://{router_name(owner)}.{owner.namespace}.svc:{owner.spec.router.port}"


def router_pods_name(owner: Owner) -> str:
    return f"{base_name(owner)}-router-pods"


def router_pods_url(owner: Owner) -> str:
    """A name whose DNS answer is every router pod's address (``--router-dns``): instances
    register with each replica and send each its own requests' events."""
    return f"http://{router_pods_name(owner)}.{owner.namespace}.svc:{owner.spec.router.port}"


def pool_selector(owner: Owner, pool: PoolSpec) -> dict[str, str]:
    """The pods of one pool: its Deployment's selector and its Service's."""
    return {LABEL_DEPLOYMENT: label_value(owner.name), LABEL_POOL: pool.name}


def router_selector(owner: Owner) -> dict[str, str]:
    """The router's pods: its Deployment's selector and its Service's."""
    return {LABEL_DEPLOYMENT: label_value(owner.name), LABEL_COMPONENT: "router"}


def owner_reference(owner: Owner) -> dict[str, Any]:
    return {
        "apiVersion": API_VERSION,
        "kind": KIND,
        "name": owner.name,
        "uid": owner.uid,
        "controller": True,
        "blockOwnerDeletion": True,
    }


def _metadata(owner: Owner, name: str, component: str, extra: dict[str, str] | None = None) -> dict:
    return {
        "name": name,
        "namespace": owner.namespace,
        "labels": {**labels(owner, component), **(extra or {})},
        "ownerReferences": [owner_reference(owner)],
    }


def with_hash(manifest: Manifest) -> Manifest:
    """Stamp the manifest's content hash so the applier can tell when it changed."""
    manifest["metadata"].setdefault("annotations", {})[ANNOTATION_HASH] = content_digest(
        manifest, 16
    )
    return manifest


# --- ConfigMap and Secret --------------------------------------------------------------------


def router_config(owner: Owner, plan: Plan, active_pools: list[str]) -> dict[str, Any]:
    """The router's /etc/epd/router.json (``epd_engine.router.settings.RouterSettings``).

    ``active_pools`` null means every registered pool; the operator sets it to the plan's pools
    at the switch (and PUTs the same set to the running router's /internal/routing).
    """
    spec = owner.spec
    return {
        "model": served_model_name(owner),
        "method": plan.method.value,
        "slo_ttft_s": spec.slo.ttft_milliseconds / 1000,
        "slo_tpot_s": spec.slo.tpot_milliseconds / 1000,
        "slo_attainment": spec.slo.attainment_percent / 100,
        "active_pools": sorted(active_pools) or None,
        "plan": {
            **plan.model_dump(mode="json"),
            "pool_names": {
                "group" if p.members else p.role.value: p.name
                for p in deployment_pools(owner, plan)
            },
        },
    }


def render_configmap(owner: Owner, plan: Plan, active_pools: list[str]) -> Manifest:
    data = {
        "router.json": json.dumps(router_config(owner, plan, active_pools), indent=2),
        "plan.json": plan.model_dump_json(indent=2),
    }
    return with_hash(
        {
            "apiVersion": "v1",
            "kind": "ConfigMap",
            "metadata": _metadata(owner, config_name(owner), "config"),
            "data": data,
        }
    )


def render_secret(owner: Owner, token: str) -> Manifest:
    """The shared internal token (``X-EPD-Token``); the caller makes it once and keeps it."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _metadata(owner, secret_name(owner), "config"),
        "type": "Opaque",
        "stringData": {"token": token},
    }


# --- pools -----------------------------------------------------------------------------------


def render_pool_deployment(owner: Owner, pool: PoolSpec, plan: Plan) -> Manifest:
    """One pool: its pods (``pod_template.py``; a group pool's: ``group_pods.py``), rolled
    replica by replica on a change."""
    pool_labels = {LABEL_POOL: pool.name, LABEL_ROLE: pool.role.value}
    router_args = ["--router-url", router_pods_url(owner), "--router-dns"]
    metadata = _metadata(owner, pool.name, "engine", pool_labels)
    if pool.members:
        metadata["labels"].update(members_label(pool))
    metadata["annotations"] = {ANNOTATION_GPUS: str(pool.gpus_per_instance)}
    template = group_pod_template if pool.members else engine_pod_template
    return with_hash(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": metadata,
            "spec": {
                "replicas": pool.replicas,
                "selector": {"matchLabels": pool_selector(owner, pool)},
                "strategy": update_strategy(owner, pool, plan),
                "template": template(owner, pool, plan, router_args),
            },
        }
    )


def render_pool_service(owner: Owner, pool: PoolSpec) -> Manifest:
    """Headless: the router and migration peers resolve each instance, not a virtual IP."""
    pool_labels = {LABEL_POOL: pool.name, LABEL_ROLE: pool.role.value}
    ports = [{"name": "http", "port": ENGINE_PORT, "targetPort": "http"}]
    if pool.members:
        ports = [
            {"name": p["name"], "port": p["containerPort"], "targetPort": p["name"]}
            for p in member_ports(owner, pool)
        ]
    return with_hash(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _metadata(owner, pool.name, "engine", pool_labels),
            "spec": {
                "clusterIP": "None",
                "selector": pool_selector(owner, pool),
                "ports": ports,
            },
        }
    )


# --- router ----------------------------------------------------------------------------------


def render_router_deployment(owner: Owner) -> Manifest:
    router = owner.spec.router
    image = router.image or owner.spec.engine.image or ENGINE_IMAGE  # the router needs no GPU
    tmp_volume, tmp_mount, tmp_env = writable_tmp()
    config_path = f"{ROUTER_CONFIG_DIR}/router.json"
    container = {
        "name": "router",
        "image": image,
        "imagePullPolicy": owner.spec.engine.image_pull_policy,
        "command": ["epdctl"],
        "args": [
            "router",
            "--host",
            "0.0.0.0",
            "--port",
            str(router.port),
            "--config",
            config_path,
        ],
        "env": [*auth_env(owner), *tmp_env],
        "ports": [{"name": "http", "containerPort": router.port, "protocol": "TCP"}],
        # Clients reach a replica only once instances have registered with it (engines find
        # it before that: the headless Service lists pods that are not Ready yet).
        "readinessProbe": probe("/health/ready", 5, 3),
        "livenessProbe": probe("/health/live", 10, 6),
        "resources": resources(
            0, "", router.resources.requests, router.resources.limits, DEFAULT_ROUTER_RESOURCES
        ),
        "securityContext": container_security_context(),
        "volumeMounts": [
            {"name": "config", "mountPath": ROUTER_CONFIG_DIR, "readOnly": True},
            tmp_mount,
        ],
    }
    pod_spec: dict[str, Any] = {
        "securityContext": pod_security_context(),
        "automountServiceAccountToken": False,  # the router never calls it
        "containers": [container],
        "volumes": [
            {"name": "config", "configMap": {"name": config_name(owner)}},
            tmp_volume,
        ],
        "enableServiceLinks": False,
    }
    place(pod_spec, router.node_selector, router.tolerations)
    if secrets := pull_secrets(owner):  # the router runs the engine image unless told
        pod_spec["imagePullSecrets"] = secrets
    selector = router_selector(owner)
    return with_hash(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": _metadata(owner, router_name(owner), "router"),
            "spec": {
                "replicas": router.replicas,
                "selector": {"matchLabels": selector},
                "template": {
                    "metadata": {
                        "labels": labels(owner, "router"),
                        "annotations": {
                            "prometheus.io/scrape": "true",
                            "prometheus.io/port": str(router.port),
                        },
                    },
                    "spec": pod_spec,
                },
            },
        }
    )


def render_router_service(owner: Owner) -> Manifest:
    router = owner.spec.router
    return with_hash(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _metadata(owner, router_name(owner), "router"),
            "spec": {
                "type": router.service_type,
                "selector": router_selector(owner),
                "ports": [{"name": "http", "port": router.port, "targetPort": "http"}],
            },
        }
    )


def render_router_pods_service(owner: Owner) -> Manifest:
    """Headless, for instances: DNS answers one address per router pod, Ready or not (a
    starting replica must learn the instances before it is Ready; a terminating one still
    needs the events of the requests it is finishing)."""
    return with_hash(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _metadata(owner, router_pods_name(owner), "router"),
            "spec": {
                "clusterIP": "None",
                "publishNotReadyAddresses": True,
                "selector": router_selector(owner),
                "ports": [{"name": "http", "port": owner.spec.router.port, "targetPort": "http"}],
            },
        }
    )


# --- guardrails: network policies and disruption budgets --------------------------------------


def render_engine_network_policy(owner: Owner) -> Manifest:
    """Engine pods accept connections only from this deployment's router and engine pods (any
    port: migration backends open their own), plus ``spec.networkPolicy.allowFromNamespaces``
    on the engine port (e.g. Prometheus scraping /metrics)."""
    same_deployment = {"podSelector": {"matchLabels": {LABEL_DEPLOYMENT: label_value(owner.name)}}}
    ingress: list[dict[str, Any]] = [{"from": [same_deployment]}]
    allowed = owner.spec.network_policy.allow_from_namespaces
    if allowed:
        ingress.append(
            {
                "from": [
                    {"namespaceSelector": {"matchLabels": {NAMESPACE_NAME_LABEL: ns}}}
                    for ns in allowed
                ],
                "ports": [{"protocol": "TCP", "port": ENGINE_PORT}],
            }
        )
    return with_hash(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": _metadata(owner, f"{base_name(owner)}-engine", "engine"),
            "spec": {
                "podSelector": {
                    "matchLabels": {
                        LABEL_DEPLOYMENT: label_value(owner.name),
                        LABEL_COMPONENT: "engine",
                    }
                },
                "policyTypes": ["Ingress"],
                "ingress": ingress,
            },
        }
    )


def render_router_network_policy(owner: Owner) -> Manifest:
    """Clients (and the operator) reach the router's pods on its one port, nothing else."""
    return with_hash(
        {
            "apiVersion": "networking.k8s.io/v1",
            "kind": "NetworkPolicy",
            "metadata": _metadata(owner, router_name(owner), "router"),
            "spec": {
                "podSelector": {"matchLabels": router_selector(owner)},
                "policyTypes": ["Ingress"],
                "ingress": [{"ports": [{"protocol": "TCP", "port": owner.spec.router.port}]}],
            },
        }
    )


def _disruption_budget(
    owner: Owner, name: str, component: str, selector: dict, extra: dict | None = None
) -> Manifest:
    # maxUnavailable 1, not minAvailable: a one-replica pool must not block node drains forever.
    return with_hash(
        {
            "apiVersion": "policy/v1",
            "kind": "PodDisruptionBudget",
            "metadata": _metadata(owner, name, component, extra),
            "spec": {"maxUnavailable": 1, "selector": {"matchLabels": selector}},
        }
    )


def render_pool_disruption_budget(owner: Owner, pool_name: str) -> Manifest:
    """At most one instance of a pool evicted at a time (node drains, cluster upgrades)."""
    selector = {LABEL_DEPLOYMENT: label_value(owner.name), LABEL_POOL: pool_name}
    return _disruption_budget(owner, pool_name, "engine", selector, {LABEL_POOL: pool_name})


def render_router_disruption_budget(owner: Owner) -> Manifest:
    return _disruption_budget(owner, router_name(owner), "router", router_selector(owner))
