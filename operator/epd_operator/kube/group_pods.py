"""Pure rendering of a group pool's pod template: one slice of the plan in one pod.

The pod runs ``epdctl group`` (``epd_engine/commands/group.py``) with one ``--member`` per role
of the method, each an ``epdctl serve`` of that role registered under the group pool's name.
The members share the pod's network, ``/dev/shm``, IPC namespace and GPUs, so the ``auto``
backend moves their caches through ``cuda_ipc`` (``shm`` on CPU); caches to instances in other
pods go over the network as before. A member's exit ends the group, and the kubelet restarts
the pod whole.

- GPUs: the pod asks for the sum of its members' (``gpusPerInstance`` each, a role's own where
  set); every member sees all of them and takes its own, ``--device cuda:<k>`` in member order.
- Ports: member ``i`` listens on ``8000 + i`` (the container port ``http-<role>``) and
  advertises that port at the pod's IP; its instance id is ``<pod>-<role>``.
- A preset checkpoint (made at start) is made by each member in a directory of its own under
  the model volume: one member would otherwise load the files another is still writing.
- CPU and memory: the sum of what each member would request as a pod of its own; a limit only
  where every member has one (a sum that leaves a member out would cap it at nothing).
- Probes: the kubelet probes one thing per container, so each probe asks every member's
  health endpoint on loopback (a short Python script, as the image has no curl): the pod is
  Ready when every member is.

Everything else (environment, volumes, security, pod-level settings) is what every engine pod
gets (``pod_template.py``). The spec's rules for groups (one image, GPU resource, node selector
and tolerations for all roles; ``transferBackend: auto``) are in ``api/placement.py``.
"""

from __future__ import annotations

import copy
import shlex
from dataclasses import dataclass
from typing import Any

from epd_engine.config import Role
from epd_engine.contracts.plan import Plan
from epd_operator.api.images import default_engine_image
from epd_operator.kube.names import ENGINE_PORT, LABEL_POOL, LABEL_ROLE
from epd_operator.kube.pod_template import (
    DEFAULT_ENGINE_RESOURCES,
    engine_container,
    engine_pod,
    engine_probes,
    model_dir,
    resources,
    serve_args,
)
from epd_operator.kube.quantities import sum_quantities
from epd_operator.rollout.pool_identity import Owner, PoolSpec

# On a group pool's pods and Deployment: its member roles in order, e.g. ``E.P.D``.
LABEL_MEMBERS = "epd.serving.dev/group-members"
# Seconds each member's health endpoint gets within one probe.
MEMBER_PROBE_TIMEOUT_S = 2
# argv: the health path, then every member's port; any answer but 2xx (or none) fails it.
PROBE_SCRIPT = (
    "import sys, urllib.request\n"
    "for port in sys.argv[2:]:\n"
    "    urllib.request.urlopen("
    f"f'http://127.0.0.1:{{port}}{{sys.argv[1]}}', timeout={MEMBER_PROBE_TIMEOUT_S})\n"
)


@dataclass(frozen=True)
class Member:
    """One instance of a group pod."""

    role: Role
    port: int
    device: str  # cuda:<k> (the k-th of the pod's GPUs) or cpu

    @property
    def port_name(self) -> str:
        return f"http-{self.role.value.lower()}"


def members_label(pool: PoolSpec) -> dict[str, str]:
    """The label that names a group pool's member roles (on its Deployment and pods)."""
    return {LABEL_MEMBERS: ".".join(role.value for role in pool.members)}


def members(owner: Owner, pool: PoolSpec) -> list[Member]:
    """The members of ``pool``'s pods in role order, each with its port and device."""
    out, next_gpu = [], 0
    for i, role in enumerate(pool.members):
        gpus = owner.spec.engine.gpus_for(role, pool.ranks_of(role))
        device = f"cuda:{next_gpu}" if gpus > 0 else "cpu"
        next_gpu += gpus
        out.append(Member(role, ENGINE_PORT + i, device))
    return out


def member_ports(owner: Owner, pool: PoolSpec) -> list[dict[str, Any]]:
    """The container ports of a group pod (also its Service's)."""
    return [
        {"name": m.port_name, "containerPort": m.port, "protocol": "TCP"}
        for m in members(owner, pool)
    ]


def _member_model_dir(owner: Owner, role: Role) -> str | None:
    """A preset's own directory per member (None: the spec's checkpoint, shared read-only)."""
    if owner.spec.model.source.preset is None:
        return None
    return f"{model_dir(owner)}/{role.value.lower()}"


def group_args(owner: Owner, pool: PoolSpec, plan: Plan, router_args: list[str]) -> list[str]:
    """``epdctl group`` arguments: one ``--member`` per role, shell-quoted ``serve`` args."""
    args = ["group", "--stop-timeout", str(owner.spec.engine.termination_grace_period_seconds)]
    for m in members(owner, pool):
        serve = serve_args(
            owner,
            plan,
            m.role,
            pool.name,
            router_args,
            instance_id=f"$(POD_NAME)-{m.role.value.lower()}",
            port=m.port,
            device=m.device,
            model=_member_model_dir(owner, m.role),
        )
        args += ["--member", shlex.join(serve)]
    return args


def _summed(parts: list[dict[str, str]], every: bool) -> dict[str, str]:
    """Per resource name, the sum over ``parts``; with ``every``, only names all parts set."""
    names = {n for part in parts for n in part}
    if every:
        names = {n for n in names if all(n in part for part in parts)}
    return {n: sum_quantities(part[n] for part in parts if n in part) for n in sorted(names)}


def group_resources(owner: Owner, pool: PoolSpec) -> dict[str, Any]:
    """The container's resources: its members' CPU and memory summed, and their GPUs."""
    spec = owner.spec
    alone = []
    for role in pool.members:
        settings = spec.engine.role_pod(role, spec.gpu_resource_name)
        alone.append(resources(0, "", settings.requests, settings.limits, DEFAULT_ENGINE_RESOURCES))
    requests = _summed([r.get("requests", {}) for r in alone], every=False)
    limits = _summed([r.get("limits", {}) for r in alone], every=True)
    none: dict[str, dict[str, str]] = {"requests": {}, "limits": {}}
    return resources(pool.gpus_per_instance, spec.gpu_resource_name, requests, limits, none)


def _probe_check(ports: list[int]) -> Any:
    def check(path: str) -> dict[str, Any]:
        return {"exec": {"command": ["python", "-c", PROBE_SCRIPT, path, *map(str, ports)]}}

    return check


def group_pod_template(
    owner: Owner, pool: PoolSpec, plan: Plan, router_args: list[str]
) -> dict[str, Any]:
    """The group pool Deployment's ``spec.template``."""
    engine = owner.spec.engine
    ports = [m.port for m in members(owner, pool)]
    container = engine_container(
        owner,
        engine.image or default_engine_image(pool.gpus_per_instance),
        group_args(owner, pool, plan, router_args),
        member_ports(owner, pool),
        engine_probes(_probe_check(ports), MEMBER_PROBE_TIMEOUT_S * len(ports) + 1),
        group_resources(owner, pool),
    )
    pool_labels = {LABEL_POOL: pool.name, LABEL_ROLE: pool.role.value, **members_label(pool)}
    affinity = copy.deepcopy(engine.affinity)  # the partners are in the pod: no terms
    return engine_pod(
        owner, container, engine.node_selector, engine.tolerations, affinity, pool_labels
    )
