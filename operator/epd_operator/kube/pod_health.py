"""Pod failures that the Deployments' counts do not tell: crash loops, image pulls, OOM kills,
and pods on a node that stopped reporting.

A Deployment whose pods crash-loop reports fewer ready replicas and nothing else, so status
would read "progressing" forever. Every pass reads the container states of this deployment's
engine and router pods and, when one is failing, sets Degraded with the reason and the pods
named, and posts a Warning event when that finding changes (not on every pass).

A lost node (its kubelet stopped, the machine down or cut off) is read from the pods too, so
the operator needs no access to Node objects: when a node stops reporting for the node
controller's grace period (``--node-monitor-grace-period``, 50 s by default) the controller
turns its pods' ``Ready`` condition False and leaves ``ContainersReady`` as the kubelet last
set it. A pod that is not Ready while its containers are is on such a node (``NodeLost``,
listed first: it takes every pool there). The controller evicts the pods after their
toleration of ``node.kubernetes.io/unreachable`` (300 s unless the pod says otherwise) and the
Deployment starts them again where they fit; an evicted pod is not reported again.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from epd_operator.api.spec import Condition
from epd_operator.kube import manifests as r
from epd_operator.kube.client import Kube

# container waiting reason (set by the kubelet) -> Degraded reason
WAITING_REASONS = {
    "CrashLoopBackOff": "CrashLoop",
    "ErrImagePull": "ImagePullFailed",
    "ImagePullBackOff": "ImagePullFailed",
    "InvalidImageName": "ImagePullFailed",
    "ErrImageNeverPull": "ImagePullFailed",
    "CreateContainerConfigError": "ContainerConfigError",
    "CreateContainerError": "ContainerConfigError",
}
OOM_KILLED = "OOMKilled"
NODE_LOST = "NodeLost"
MAX_NAMED = 3  # pods named in the condition message; the rest are counted

ConditionTuples = dict[str, tuple[str, str, str]]  # type -> (status, reason, message)
PostEvent = Callable[[str, str, str], None]  # (type, reason, message)


@dataclass(frozen=True)
class PodProblem:
    reason: str  # a Degraded reason: CrashLoop, ImagePullFailed, OOMKilled, ...
    pod: str
    container: str
    detail: str

    def describe(self) -> str:
        return f"pod {self.pod} container {self.container}: {self.detail}"


def _container_problem(pod: str, cs: Any) -> PodProblem | None:
    state, last = cs.state, cs.last_state
    waiting = state.waiting if state else None
    terminated = state.terminated if state else None
    last_terminated = last.terminated if last else None
    if terminated is not None and terminated.reason == OOM_KILLED:
        detail = f"OOMKilled (exit {terminated.exit_code}) at its memory limit"
        return PodProblem(OOM_KILLED, pod, cs.name, detail)
    if waiting is None or waiting.reason not in WAITING_REASONS:
        return None
    if last_terminated is not None and last_terminated.reason == OOM_KILLED:
        detail = f"OOMKilled at its memory limit, restarted {cs.restart_count} times"
        return PodProblem(OOM_KILLED, pod, cs.name, detail)
    detail = str(waiting.reason)
    if waiting.message:
        detail += f": {waiting.message}"
    if last_terminated is not None and last_terminated.exit_code is not None:
        detail += f" (last exit {last_terminated.exit_code}, {cs.restart_count} restarts)"
    return PodProblem(WAITING_REASONS[waiting.reason], pod, cs.name, detail)


def _node_lost(pod: Any) -> PodProblem | None:
    """The pod is on a node that stopped reporting: the node controller, not the kubelet,
    made it not Ready (the kubelet sets Ready from the containers' readiness)."""
    conditions = {c.type: c for c in pod.status.conditions or []}
    ready, containers = conditions.get("Ready"), conditions.get("ContainersReady")
    if ready is None or containers is None or pod.spec is None or not pod.spec.node_name:
        return None
    if ready.status != "False" or containers.status != "True":
        return None
    if ready.reason == "ReadinessGatesNotReady":  # not Ready for a gate of its own
        return None
    since = ready.last_transition_time
    when = f" since {since.strftime('%H:%M:%SZ')}" if since is not None else ""
    container = pod.spec.containers[0].name if pod.spec.containers else ""
    detail = (
        f"node {pod.spec.node_name} stopped reporting (the pod is not Ready{when}, its "
        "containers last reported ready); the pod is replaced once the node controller evicts it"
    )
    return PodProblem(NODE_LOST, pod.metadata.name, container, detail)


def problems_of(pods: list[Any]) -> list[PodProblem]:
    """The failing containers of ``pods`` (V1Pod objects): pods on a lost node first, then OOM
    kills, then by pod name."""
    found = []
    for pod in pods:
        if pod.metadata is None or pod.status is None or pod.metadata.deletion_timestamp:
            continue
        lost = _node_lost(pod)
        if lost is not None:
            found.append(lost)
            continue
        statuses = [
            *(pod.status.init_container_statuses or []),
            *(pod.status.container_statuses or []),
        ]
        for cs in statuses:
            problem = _container_problem(pod.metadata.name, cs)
            if problem is not None:
                found.append(problem)
    order = {NODE_LOST: 0, OOM_KILLED: 1}
    return sorted(found, key=lambda p: (order.get(p.reason, 2), p.pod, p.container))


def observe(kube: Kube, owner: r.Owner) -> list[PodProblem]:
    """The failing containers of this EPDDeployment's engine and router pods."""
    selector = f"{r.LABEL_DEPLOYMENT}={r.label_value(owner.name)}"
    pods = kube.core.list_namespaced_pod(owner.namespace, label_selector=selector).items
    return problems_of(pods)


def degrade(conditions: ConditionTuples, problems: list[PodProblem]) -> ConditionTuples:
    """``conditions`` with Degraded set by ``problems`` (first problem's reason). A Degraded
    already True (say Unschedulable) keeps its reason and gets the pods' message appended."""
    if not problems:
        return conditions
    named = "; ".join(p.describe() for p in problems[:MAX_NAMED])
    if len(problems) > MAX_NAMED:
        named += f"; and {len(problems) - MAX_NAMED} more"
    status, reason, message = conditions["Degraded"]
    if status == "True":
        return {**conditions, "Degraded": ("True", reason, f"{message}; {named}")}
    return {**conditions, "Degraded": ("True", problems[0].reason, named)}


def events(problems: list[PodProblem], previous_degraded_message: str) -> list[tuple[str, str]]:
    """(reason, message) of a Warning event per problem not already in the last Degraded."""
    # keyed on the pod and container: the detail (restart count, back-off) changes every pass
    return [
        (p.reason, p.describe())
        for p in problems
        if f"pod {p.pod} container {p.container}:" not in previous_degraded_message
    ]


def report(
    kube: Kube,
    owner: r.Owner,
    conditions: ConditionTuples,
    previous: list[Condition],
    post_event: PostEvent,
) -> ConditionTuples:
    """The reconcile pass's hook: observe, post new findings as events, degrade."""
    problems = observe(kube, owner)
    before = next((c.message for c in previous if c.type == "Degraded"), "")
    for reason, message in events(problems, before):
        post_event("Warning", reason, message)
    return degrade(conditions, problems)
