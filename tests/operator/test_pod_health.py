"""Pod findings for Degraded: a pod on a node that stopped reporting is told apart from a pod
that is merely not Ready, from the conditions the node controller and the kubelet write."""

from __future__ import annotations

from datetime import UTC, datetime

from kubernetes import client

from epd_operator.kube.pod_health import NODE_LOST, OOM_KILLED, degrade, problems_of

SINCE = datetime(2026, 1, 1, 12, 0, 5, tzinfo=UTC)


def pod(
    name: str,
    ready: str,
    containers_ready: str,
    reason: str | None = None,
    deleting: bool = False,
    oom: bool = False,
) -> client.V1Pod:
    state = client.V1ContainerState(
        terminated=client.V1ContainerStateTerminated(exit_code=137, reason="OOMKilled")
        if oom
        else None
    )
    return client.V1Pod(
        metadata=client.V1ObjectMeta(name=name, deletion_timestamp=SINCE if deleting else None),
        spec=client.V1PodSpec(
            node_name="gpu-node-3", containers=[client.V1Container(name="engine")]
        ),
        status=client.V1PodStatus(
            conditions=[
                client.V1PodCondition(
                    type="Ready", status=ready, reason=reason, last_transition_time=SINCE
                ),
                client.V1PodCondition(type="ContainersReady", status=containers_ready),
            ],
            container_statuses=[
                client.V1ContainerStatus(
                    name="engine",
                    image="i",
                    image_id="",
                    ready=containers_ready == "True",
                    restart_count=0,
                    state=state,
                )
            ],
        ),
    )


def test_a_pod_the_node_controller_marked_not_ready_is_on_a_lost_node() -> None:
    found = problems_of(
        [
            pod("llava-d-1", "True", "True"),  # healthy
            pod("llava-p-1", "False", "False"),  # starting or failing its probe: not a node
            pod("llava-e-1", "False", "True", reason="ReadinessGatesNotReady"),  # a gate
            pod("llava-d-2", "False", "True", deleting=True),  # evicted: being replaced
            pod("llava-p-2", "False", "False", oom=True),
            pod("llava-d-3", "False", "True"),  # node lost
        ]
    )
    assert [(p.reason, p.pod) for p in found] == [
        (NODE_LOST, "llava-d-3"),
        (OOM_KILLED, "llava-p-2"),
    ]
    assert "node gpu-node-3 stopped reporting" in found[0].detail
    assert "since 12:00:05Z" in found[0].detail
    conditions = {"Degraded": ("False", "AsExpected", "All pools can be scheduled")}
    status, reason, message = degrade(conditions, found)["Degraded"]
    assert (status, reason) == ("True", NODE_LOST)
    assert message.startswith("pod llava-d-3 container engine: node gpu-node-3 stopped")
