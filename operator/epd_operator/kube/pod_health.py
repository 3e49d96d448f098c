"""Pod failures that the Deployments' counts do not tell: crash loops, image pulls, OOM kills.

A Deployment whose pods crash-loop reports fewer ready replicas and nothing else, so status
would read "progressing" forever. Every pass reads the container states of this deployment's
engine and router pods and, when one is failing, sets Degraded with the reason and the pods
named, and posts a Warning event when that finding changes (not on every pass).
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


def problems_of(pods: list[Any]) -> list[PodProblem]:
    """The failing containers of ``pods`` (V1Pod objects), OOM kills first, then by pod name."""
    found = []
    for pod in pods:
        if pod.metadata is None or pod.status is None or pod.metadata.deletion_timestamp:
            continue
        statuses = [
            *(pod.status.init_container_statuses or []),
            *(pod.status.container_statuses or []),
        ]
        for cs in statuses:
            problem = _container_problem(pod.metadata.name, cs)
            if problem is not None:
                found.append(problem)
    return sorted(found, key=lambda p: (p.reason != OOM_KILLED, p.pod, p.container))


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
