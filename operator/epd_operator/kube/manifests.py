"""Pure rendering: (EPDDeployment, plan) -> Kubernetes manifests (plain dicts).

Nothing here talks to the API server. Child names are deterministic:

- ``<name>-config`` ConfigMap (router.json, plan.json), ``<name>-internal-token`` Secret,
- ``<name>-router`` Deployment + Service (the inference endpoint), and the headless
  ``<name>-router-pods`` Service through which instances find every router replica,
- ``<name>-<role>-<hash8>`` Deployment + headless Service per pool, where ``hash8`` covers
  everything that shapes the pool's pods (role, replicas, model, engine settings, SLOs). A pool
  whose inputs do not change keeps its name across plans and is left alone by a rollout; a
  changed pool is a new name, so it is brought up next to the old one (blue/green per pool).
- ``<name>-engine`` and ``<name>-router`` NetworkPolicies, a PodDisruptionBudget per pool
  (named like it) and ``<name>-router`` for the router (kept in step by ``guardrails.py``).

Engine and router pods run non-root with every capability dropped, no privilege escalation,
the runtime's default seccomp profile and a read-only root filesystem (``/tmp`` and
``/dev/shm`` are emptyDirs, ``HOME`` points into ``/tmp``); resources a spec leaves out get
the defaults below, so no pod is BestEffort.
"""

from __future__ import annotations

import json
from typing import Any

from epd_engine.contracts.plan import Plan
from epd_operator.api.spec import API_VERSION, KIND, Toleration
from epd_operator.rollout.pool_identity import (
    Owner,
    PoolSpec,
    base_name,
    content_digest,
    pool_specs,
)

ENGINE_PORT = 8000
MODELS_DIR = "/models"
ROUTER_CONFIG_DIR = "/etc/epd"
LABEL_DEPLOYMENT = "epd.serving.dev/deployment"
LABEL_POOL = "epd.serving.dev/pool"
LABEL_ROLE = "epd.serving.dev/role"
LABEL_COMPONENT = "app.kubernetes.io/component"
NAMESPACE_NAME_LABEL = "kubernetes.io/metadata.name"
ANNOTATION_HASH = "epd.serving.dev/spec-hash"
RUN_AS_USER = 10001  # the images' user (docker/*.Dockerfile)
TMP_DIR = "/tmp"
# Requests only for the engine (a checkpoint's host memory varies too much for a default
# limit); the router is small, so it also gets a memory limit.
DEFAULT_ENGINE_RESOURCES: dict[str, dict[str, str]] = {
    "requests": {"cpu": "1", "memory": "2Gi"},
    "limits": {},
}
DEFAULT_ROUTER_RESOURCES: dict[str, dict[str, str]] = {
    "requests": {"cpu": "250m", "memory": "256Mi"},
    "limits": {"memory": "2Gi"},
}

Manifest = dict[str, Any]


def config_name(owner: Owner) -> str:
    return f"{base_name(owner)}-config"


def secret_name(owner: Owner) -> str:
    return f"{base_name(owner)}-internal-token"


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


def label_value(name: str) -> str:
    """An object name as a label value (at most 63 characters)."""
    return name[:63]


def labels(owner: Owner, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "epd",
        "app.kubernetes.io/instance": label_value(owner.name),
        "app.kubernetes.io/managed-by": "epd-operator",
        LABEL_COMPONENT: component,
        LABEL_DEPLOYMENT: label_value(owner.name),
    }


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
        "model": spec.model.name,
        "method": plan.method.value,
        "slo_ttft_s": spec.slo.ttft_milliseconds / 1000,
        "slo_tpot_s": spec.slo.tpot_milliseconds / 1000,
        "slo_attainment": spec.slo.attainment_percent / 100,
        "active_pools": sorted(active_pools) or None,
        "plan": {
            **plan.model_dump(mode="json"),
            "pool_names": {p.role.value: p.name for p in pool_specs(owner, plan)},
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


def _auth_env(owner: Owner) -> list[dict[str, Any]]:
    """The deployment's secret, and its id: the EPDDeployment's uid, which a deployment of
    the same name created later does not share, so the router refuses a pod left over from
    an earlier one (``X-EPD-Deployment``) even in the same namespace."""
    ref = {"name": secret_name(owner), "key": "token"}
    return [
        {"name": "EPD_INTERNAL_TOKEN", "valueFrom": {"secretKeyRef": ref}},
        {"name": "EPD_DEPLOYMENT_ID", "value": owner.uid},
    ]


def _pod_identity_env() -> list[dict[str, Any]]:
    """The downward API's pod IP and name, for the engine's advertise URL and instance id."""
    return [
        {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}
        for name, path in (("POD_IP", "status.podIP"), ("POD_NAME", "metadata.name"))
    ]


def _model_volume(owner: Owner) -> dict[str, Any]:
    source = owner.spec.model.source
    if source.pvc is not None:
        return {"name": "model", "persistentVolumeClaim": {"claimName": source.pvc.claim_name}}
    if source.host_path is not None:
        return {"name": "model", "hostPath": {"path": source.host_path.path, "type": "Directory"}}
    return {"name": "model", "emptyDir": {}}


def _model_mount(owner: Owner) -> dict[str, Any]:
    source = owner.spec.model.source
    mount: dict[str, Any] = {"name": "model", "mountPath": f"{MODELS_DIR}/{owner.spec.model.name}"}
    if source.pvc is not None and source.pvc.path:
        mount["subPath"] = source.pvc.path.strip("/")
    if source.preset is None:
        mount["readOnly"] = True
    return mount


def engine_args(owner: Owner, pool: PoolSpec, plan: Plan) -> list[str]:
    spec = owner.spec
    engine = spec.engine
    args = [
        "serve",
        "--model", f"{MODELS_DIR}/{spec.model.name}",
        "--role", pool.role.value,
        "--host", "0.0.0.0",
        "--port", str(ENGINE_PORT),
        "--router-url", router_pods_url(owner), "--router-dns",
        "--pool", pool.name,
        "--dtype", spec.model.dtype,
        "--device", "cuda" if engine.gpus_per_instance > 0 else "cpu",
        "--kv-block-size", str(engine.kv_block_size),
        *engine.kv_cache_args(),
        "--num-image-blocks", str(engine.num_image_blocks),
        "--served-model-name", spec.model.name,
        "--slo-ttft", f"{spec.slo.ttft_milliseconds / 1000:g}",
        "--slo-tpot", f"{spec.slo.tpot_milliseconds / 1000:g}",
        "--transfer-backend", engine.transfer_backend,
        # Peers and the router reach each replica at its own pod IP, under its pod name;
        # Kubernetes expands $(VAR) in args from the container's env (_pod_identity_env).
        "--advertise-url", f"http://$(POD_IP):{ENGINE_PORT}",
        "--instance-id", "$(POD_NAME)",
    ]  # fmt: skip
    if spec.model.source.preset is not None:
        args += ["--preset", spec.model.source.preset]
    budgets = plan.budgets.get(pool.role)
    if budgets is not None:
        args += ["--image-budget", str(budgets.image_budget)]
        args += ["--token-budget", str(budgets.token_budget)]
    return args + list(engine.extra_args)


def _resources(
    owner: Owner, gpus: int, requests: dict, limits: dict, defaults: dict[str, dict[str, str]]
) -> dict[str, Any]:
    """The spec's requests and limits over ``defaults`` (a name the spec sets wins)."""
    out = {
        "requests": {**defaults["requests"], **requests},
        "limits": {**defaults["limits"], **limits},
    }
    # A default request above the user's limit would be rejected (request > limit): drop it.
    for name in limits:
        if name not in requests and name in defaults["requests"]:
            del out["requests"][name]
    if gpus > 0:
        out["requests"][owner.spec.gpu_resource_name] = str(gpus)
        out["limits"][owner.spec.gpu_resource_name] = str(gpus)
    return {k: v for k, v in out.items() if v}


def pod_security_context() -> dict[str, Any]:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_USER,
        "runAsGroup": RUN_AS_USER,
        "fsGroup": RUN_AS_USER,  # emptyDir and PVC model volumes writable by the user
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def container_security_context() -> dict[str, Any]:
    return {
        "allowPrivilegeEscalation": False,
        "readOnlyRootFilesystem": True,
        "capabilities": {"drop": ["ALL"]},
    }


def _writable_tmp() -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """(volume, mount, env): with a read-only root, caches (torch, HF, matplotlib) go to /tmp."""
    env = [
        {"name": "HOME", "value": TMP_DIR},
        {"name": "XDG_CACHE_HOME", "value": f"{TMP_DIR}/.cache"},
    ]
    return {"name": "tmp", "emptyDir": {}}, {"name": "tmp", "mountPath": TMP_DIR}, env


def _probe(path: str, period_s: int, failures: int) -> dict[str, Any]:
    return {
        "httpGet": {"path": path, "port": "http"},
        "periodSeconds": period_s,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


def render_pool_deployment(owner: Owner, pool: PoolSpec, plan: Plan) -> Manifest:
    engine = owner.spec.engine
    pool_labels = {LABEL_POOL: pool.name, LABEL_ROLE: pool.role.value}
    selector = pool_selector(owner, pool)
    tmp_volume, tmp_mount, tmp_env = _writable_tmp()
    container = {
        "name": "engine",
        "image": engine.image,
        "imagePullPolicy": engine.image_pull_policy,
        "command": ["epdctl"],
        "args": engine_args(owner, pool, plan),
        "env": [*_auth_env(owner), *_pod_identity_env(), *tmp_env],
        "ports": [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        "readinessProbe": _probe("/health/ready", 5, 3),
        "livenessProbe": _probe("/health/live", 10, 6),
        # Loading weights and the start-up budget search can take minutes on real checkpoints.
        "startupProbe": _probe("/health/live", 10, 90),
        "resources": _resources(
            owner,
            pool.gpus_per_instance,
            engine.resources.requests,
            engine.resources.limits,
            DEFAULT_ENGINE_RESOURCES,
        ),
        "securityContext": container_security_context(),
        "volumeMounts": [
            _model_mount(owner),
            {"name": "shm", "mountPath": "/dev/shm"},
            tmp_mount,
        ],
    }
    pod_spec: dict[str, Any] = {
        "securityContext": pod_security_context(),
        "automountServiceAccountToken": False,  # engines never call the API server
        "containers": [container],
        "volumes": [
            _model_volume(owner),
            {"name": "shm", "emptyDir": {"medium": "Memory"}},
            tmp_volume,
        ],
        "terminationGracePeriodSeconds": 60,
        "enableServiceLinks": False,
    }
    _place(pod_spec, engine.node_selector, engine.tolerations)
    template_meta = {
        "labels": {**labels(owner, "engine"), **pool_labels},
        "annotations": {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(ENGINE_PORT),
            "prometheus.io/path": "/metrics",
        },
    }
    return with_hash(
        {
            "apiVersion": "apps/v1",
            "kind": "Deployment",
            "metadata": _metadata(owner, pool.name, "engine", pool_labels),
            "spec": {
                "replicas": pool.replicas,
                "selector": {"matchLabels": selector},
                "strategy": {"type": "Recreate"},
                "template": {"metadata": template_meta, "spec": pod_spec},
            },
        }
    )


def render_pool_service(owner: Owner, pool: PoolSpec) -> Manifest:
    """Headless: the router and migration peers resolve each instance, not a virtual IP."""
    pool_labels = {LABEL_POOL: pool.name, LABEL_ROLE: pool.role.value}
    return with_hash(
        {
            "apiVersion": "v1",
            "kind": "Service",
            "metadata": _metadata(owner, pool.name, "engine", pool_labels),
            "spec": {
                "clusterIP": "None",
                "selector": pool_selector(owner, pool),
                "ports": [{"name": "http", "port": ENGINE_PORT, "targetPort": "http"}],
            },
        }
    )


def _place(
    pod_spec: dict[str, Any], node_selector: dict[str, str], tolerations: list[Toleration]
) -> None:
    """The spec's node selector and tolerations on a pod spec (left out when empty)."""
    if node_selector:
        pod_spec["nodeSelector"] = dict(node_selector)
    if tolerations:
        pod_spec["tolerations"] = [t.model_dump(exclude_defaults=True) for t in tolerations]


# --- router ----------------------------------------------------------------------------------


def render_router_deployment(owner: Owner) -> Manifest:
    router = owner.spec.router
    image = router.image or owner.spec.engine.image
    tmp_volume, tmp_mount, tmp_env = _writable_tmp()
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
        "env": [*_auth_env(owner), *tmp_env],
        "ports": [{"name": "http", "containerPort": router.port, "protocol": "TCP"}],
        # Clients reach a replica only once instances have registered with it (engines find
        # it before that: the headless Service lists pods that are not Ready yet).
        "readinessProbe": _probe("/health/ready", 5, 3),
        "livenessProbe": _probe("/health/live", 10, 6),
        "resources": _resources(
            owner, 0, router.resources.requests, router.resources.limits, DEFAULT_ROUTER_RESOURCES
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
    _place(pod_spec, router.node_selector, router.tolerations)
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
