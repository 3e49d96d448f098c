"""Pure rendering of an engine pool's pod template, and the pod pieces the router shares.

A pool's pods run ``epdctl serve`` as the pool's role with what the spec gives that role
(``EngineSpec.role_pod``: image, GPUs, resources, placement, arguments) and what every engine
pod gets (``PodSettings``: environment, extra volumes, ``/dev/shm``, runtime and priority
class, pull secrets, labels, annotations, affinity, topology spread, grace period), and a
preference for the nodes of the pools it exchanges caches with (``partner_affinity.py``).

Everything here may change without a new pool name: the Deployment rolls its pods replica by
replica (``update_strategy.py``) and each terminating engine drains first. What must not be
mixed inside a pool (model, cache geometry, transfer backend, GPU count and type) is in the
pool's name instead (``rollout/pool_identity.py``).

Pods run non-root with every capability dropped, no privilege escalation, the runtime's
default seccomp profile and a read-only root filesystem (``/tmp`` and ``/dev/shm`` are
emptyDirs, ``HOME`` points into ``/tmp``); resources a spec leaves out get defaults, so no
pod is BestEffort.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from epd_engine.config import Role
from epd_engine.contracts.plan import Plan
from epd_engine.contracts.serve_args import ServeCommand, plan_budget_flags
from epd_operator.api.spec import Toleration
from epd_operator.kube.emulated_pods import (
    EMULATED_RESOURCES,
    cost_model_volumes,
    emulate_args,
    emulated,
)
from epd_operator.kube.names import (
    ENGINE_PORT,
    LABEL_POOL,
    LABEL_ROLE,
    MODELS_DIR,
    labels,
    secret_name,
)
from epd_operator.kube.partner_affinity import partner_terms, with_partner_affinity
from epd_operator.rollout.pool_identity import Owner, PoolSpec
from epd_operator.rollout.serve_settings import engine_settings, role_engine_args

RUN_AS_USER = 10001  # the images' user (docker/*.Dockerfile)
TMP_DIR = "/tmp"
SHM_DIR = "/dev/shm"
# Requests only for the engine (a checkpoint's host memory varies too much for a default
# limit); the router is small, so it also gets a memory limit.
DEFAULT_ENGINE_RESOURCES: dict[str, dict[str, str]] = {
    "requests": {"cpu": "1", "memory": "2Gi"},
    "limits": {},
}
# Loading weights and the start-up budget search can take minutes on real checkpoints.
STARTUP_PROBE_FAILURES = 90
# (probe, health path, period s, failures) of every engine container
ENGINE_PROBES = (
    ("readinessProbe", "/health/ready", 5, 3),
    ("livenessProbe", "/health/live", 10, 6),
    ("startupProbe", "/health/live", 10, STARTUP_PROBE_FAILURES),
)


# --- pieces the router's pod shares ----------------------------------------------------------


def auth_env(owner: Owner) -> list[dict[str, Any]]:
    """The deployment's secret, and its id: the EPDDeployment's uid, which a deployment of
    the same name created later does not share, so the router refuses a pod left over from
    an earlier one (``X-EPD-Deployment``) even in the same namespace."""
    ref = {"name": secret_name(owner), "key": "token"}
    return [
        {"name": "EPD_INTERNAL_TOKEN", "valueFrom": {"secretKeyRef": ref}},
        {"name": "EPD_DEPLOYMENT_ID", "value": owner.uid},
    ]


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


def writable_tmp() -> tuple[dict[str, Any], dict[str, Any], list[dict[str, Any]]]:
    """(volume, mount, env): with a read-only root, caches (torch, HF, matplotlib) go to /tmp."""
    env = [
        {"name": "HOME", "value": TMP_DIR},
        {"name": "XDG_CACHE_HOME", "value": f"{TMP_DIR}/.cache"},
    ]
    return {"name": "tmp", "emptyDir": {}}, {"name": "tmp", "mountPath": TMP_DIR}, env


def http_check(path: str) -> dict[str, Any]:
    """A probe's handler: GET ``path`` on the container's ``http`` port."""
    return {"httpGet": {"path": path, "port": "http"}}


def probe(path: str, period_s: int, failures: int) -> dict[str, Any]:
    return {
        **http_check(path),
        "periodSeconds": period_s,
        "failureThreshold": failures,
        "timeoutSeconds": 5,
    }


def resources(
    gpus: int,
    gpu_resource_name: str,
    requests: dict[str, str],
    limits: dict[str, str],
    defaults: dict[str, dict[str, str]],
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
        out["requests"][gpu_resource_name] = str(gpus)
        out["limits"][gpu_resource_name] = str(gpus)
    return {k: v for k, v in out.items() if v}


def place(
    pod_spec: dict[str, Any], node_selector: dict[str, str], tolerations: list[Toleration]
) -> None:
    """A node selector and tolerations on a pod spec (left out when empty)."""
    if node_selector:
        pod_spec["nodeSelector"] = dict(node_selector)
    if tolerations:
        pod_spec["tolerations"] = [
            t.model_dump(exclude_defaults=True, by_alias=True) for t in tolerations
        ]


def pull_secrets(owner: Owner) -> list[dict[str, Any]]:
    """``imagePullSecrets`` of engine and router pods (the router runs the engine image)."""
    return [s.model_dump(exclude_none=True) for s in owner.spec.engine.image_pull_secrets]


# --- the engine container ---------------------------------------------------------------------


def _pod_identity_env() -> list[dict[str, Any]]:
    """The downward API's pod IP and name, for the engine's advertise URL and instance id."""
    return [
        {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}
        for name, path in (("POD_IP", "status.podIP"), ("POD_NAME", "metadata.name"))
    ]


def _model_volume(owner: Owner) -> dict[str, Any]:
    source = owner.spec.model.source
    if source.pvc is not None:
        # readOnly: the pods only read weights, and a ReadOnlyMany claim attaches read-only
        claim = {"claimName": source.pvc.claim_name, "readOnly": True}
        return {"name": "model", "persistentVolumeClaim": claim}
    if source.host_path is not None:
        return {"name": "model", "hostPath": {"path": source.host_path.path, "type": "Directory"}}
    return {"name": "model", "emptyDir": {}}


def model_dir(owner: Owner) -> str:
    """The checkpoint directory the engine loads (``--model``)."""
    spec = owner.spec.model
    mount = f"{MODELS_DIR}/{spec.name}"
    cache = spec.source.hugging_face_cache
    if cache is None:
        return mount
    inside = spec.source.pvc.path.strip("/") if spec.source.pvc is not None else ""
    return "/".join(p for p in (mount, inside, cache.snapshot_path()) if p)


def _model_mount(owner: Owner) -> dict[str, Any]:
    source = owner.spec.model.source
    mount: dict[str, Any] = {"name": "model", "mountPath": f"{MODELS_DIR}/{owner.spec.model.name}"}
    # A Hugging Face cache is mounted whole: its snapshot files are symlinks into ../../blobs.
    whole = source.hugging_face_cache is not None
    if source.pvc is not None and source.pvc.path and not whole:
        mount["subPath"] = source.pvc.path.strip("/")
    if source.preset is None:
        mount["readOnly"] = True
    return mount


def serve_args(
    owner: Owner,
    plan: Plan,
    role: Role,
    pool_name: str,
    router_args: list[str],
    instance_id: str = "$(POD_NAME)",
    port: int = ENGINE_PORT,
    device: str | None = None,
    model: str | None = None,
) -> list[str]:
    """``epdctl serve`` arguments of one instance of ``role``; ``router_args`` tell it where
    the router is (manifests.py owns the router's names). Unset ``device``: ``cuda`` where
    the role has a GPU, else ``cpu``; unset ``model``: the spec's checkpoint directory."""
    spec = owner.spec
    engine = spec.engine
    settings = engine.role_pod(role, spec.gpu_resource_name)
    if emulated(owner):  # a name to serve under, no checkpoint, no device
        model, device = spec.model.name, "cpu"
    if device is None:
        device = "cuda" if settings.gpus_per_rank > 0 else "cpu"
    pod_settings = [
        # Peers and the router reach each replica at its own pod IP; Kubernetes expands
        # $(VAR) in args from the container's env (_pod_identity_env).
        "--advertise-url", f"http://$(POD_IP):{port}",
        # SIGTERM: leave routing, finish in-flight requests, then exit within the grace period
        "--drain-timeout", str(engine.drain_timeout_s),
    ]  # fmt: skip
    if emulated(owner):
        pod_settings += emulate_args(owner)
    elif spec.model.source.preset is not None:
        pod_settings += ["--preset", spec.model.source.preset]
    pod_settings += role_engine_args(plan.size_of(role))
    return ServeCommand(
        model=model or model_dir(owner),
        served_model_name=spec.model.name,
        role=role,
        pool=pool_name,
        instance_id=instance_id,
        host="0.0.0.0",
        port=port,
        router=router_args,
        dtype=spec.model.dtype,
        device=device,
        settings=[*engine_settings(spec), *pod_settings],
        budgets=plan_budget_flags(plan.budgets.get(role)),
        extra=settings.extra_args,
    ).argv()


def engine_args(owner: Owner, pool: PoolSpec, plan: Plan, router_args: list[str]) -> list[str]:
    """``epdctl serve`` arguments of a pool's pods."""
    return serve_args(owner, plan, pool.role, pool.name, router_args)


def _env(owner: Owner, tmp_env: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The operator's variables, then the spec's (one the spec names replaces ours: HOME)."""
    own = [e.model_dump(by_alias=True, exclude_none=True) for e in owner.spec.engine.env]
    named = {e["name"] for e in own}
    ours = [*auth_env(owner), *_pod_identity_env(), *tmp_env]
    return [e for e in ours if e["name"] not in named] + own


def _volumes(owner: Owner, tmp_volume: dict[str, Any]) -> list[dict[str, Any]]:
    engine = owner.spec.engine
    shm: dict[str, Any] = {"medium": "Memory"}
    if engine.shm_size is not None:
        shm["sizeLimit"] = engine.shm_size
    extra = [v.manifest() for v in engine.volumes]
    own = cost_model_volumes(owner)[0] if emulated(owner) else [_model_volume(owner)]
    return [*own, {"name": "shm", "emptyDir": shm}, tmp_volume, *extra]


def engine_probes(
    check: Callable[[str], dict[str, Any]] = http_check, timeout_s: int = 5
) -> dict[str, dict[str, Any]]:
    """Readiness, liveness and start-up probes of an engine container; ``check(path)`` is how
    one health path is probed (an HTTP GET on the engine's port by default)."""
    return {
        name: {
            **check(path),
            "periodSeconds": period_s,
            "failureThreshold": failures,
            "timeoutSeconds": timeout_s,
        }
        for name, path, period_s, failures in ENGINE_PROBES
    }


def engine_container(
    owner: Owner,
    image: str,
    args: list[str],
    ports: list[dict[str, Any]],
    probes: dict[str, dict[str, Any]],
    container_resources: dict[str, Any],
) -> dict[str, Any]:
    """The engine container: ``epdctl`` with ``args``, and what every engine container gets
    (environment, mounts, security context)."""
    engine = owner.spec.engine
    _, tmp_mount, tmp_env = writable_tmp()
    container = {
        "name": "engine",
        "image": image,
        "imagePullPolicy": engine.image_pull_policy,
        "command": ["epdctl"],
        "args": args,
        "env": _env(owner, tmp_env),
        "ports": ports,
        **probes,
        "resources": container_resources,
        "securityContext": container_security_context(),
        "volumeMounts": [
            *(cost_model_volumes(owner)[1] if emulated(owner) else [_model_mount(owner)]),
            {"name": "shm", "mountPath": SHM_DIR},
            tmp_mount,
            *(m.manifest() for m in engine.volume_mounts),
        ],
    }
    if engine.env_from:
        container["envFrom"] = [
            e.model_dump(by_alias=True, exclude_defaults=True) for e in engine.env_from
        ]
    return container


def engine_pod(
    owner: Owner,
    container: dict[str, Any],
    node_selector: dict[str, str],
    tolerations: list[Toleration],
    affinity: dict[str, Any] | None,
    pool_labels: dict[str, str],
) -> dict[str, Any]:
    """A Deployment's ``spec.template`` around ``container``: the pod settings every engine
    pod gets, the placement given, and the spec's pod-level settings where set."""
    engine = owner.spec.engine
    tmp_volume, _, _ = writable_tmp()
    pod_spec: dict[str, Any] = {
        "securityContext": pod_security_context(),
        "automountServiceAccountToken": False,  # engines never call the API server
        "containers": [container],
        "volumes": _volumes(owner, tmp_volume),
        "terminationGracePeriodSeconds": engine.termination_grace_period_seconds,
        "enableServiceLinks": False,
    }
    place(pod_spec, node_selector, tolerations)
    optional = {
        "runtimeClassName": engine.runtime_class_name,
        "priorityClassName": engine.priority_class_name,
        "imagePullSecrets": pull_secrets(owner),
        "affinity": affinity,
        "topologySpreadConstraints": list(engine.topology_spread_constraints),
    }
    pod_spec.update({k: v for k, v in optional.items() if v})
    annotations = {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": str(ENGINE_PORT),
        "prometheus.io/path": "/metrics",
        **engine.pod_annotations,
    }
    return {
        "metadata": {
            "labels": {**engine.pod_labels, **labels(owner, "engine"), **pool_labels},
            "annotations": annotations,
        },
        "spec": pod_spec,
    }


def engine_pod_template(
    owner: Owner, pool: PoolSpec, plan: Plan, router_args: list[str]
) -> dict[str, Any]:
    """The pool Deployment's ``spec.template``: one ``epdctl serve`` of the pool's role, with
    a preference for the nodes of its cache partners (partner_affinity.py)."""
    spec = owner.spec
    on_cpu = emulated(owner)  # a small CPU process: the CPU image unless one is named
    role = spec.engine.role_pod(pool.role, spec.gpu_resource_name, without_gpus=on_cpu)
    gpus, defaults = pool.gpus_per_instance, DEFAULT_ENGINE_RESOURCES
    if on_cpu:
        gpus, defaults = 0, EMULATED_RESOURCES
    container = engine_container(
        owner,
        role.image,
        engine_args(owner, pool, plan, router_args),
        [{"name": "http", "containerPort": ENGINE_PORT, "protocol": "TCP"}],
        engine_probes(),
        resources(gpus, role.gpu_resource_name, role.requests, role.limits, defaults),
    )
    affinity = with_partner_affinity(spec.engine.affinity, partner_terms(owner, plan, pool.role))
    pool_labels = {LABEL_POOL: pool.name, LABEL_ROLE: pool.role.value}
    return engine_pod(owner, container, role.node_selector, role.tolerations, affinity, pool_labels)
