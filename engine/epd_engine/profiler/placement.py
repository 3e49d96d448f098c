"""Which node each simulated instance runs on, so a migration is charged at its pair's link.

The operator's pools prefer their cache partners' nodes (``kube/partner_affinity.py``), so a
cluster fills node after node with a mix of the plan's pools. The model: the instances in the
simulator's order (pools in the method's order, each pool's count), interleaved by their
pool's share (a node of a 1E3P4D plan with 8 GPUs holds about 1 E, 3 P and 4 D), then packed
``instances_per_node`` to a node. ``instances_per_node`` None: every instance on one node
(local processes on one host, or a model without node sizes: one link for all).
"""

from __future__ import annotations

from collections.abc import Sequence

from epd_engine.config import Role


def instance_nodes(pools: Sequence[tuple[Role, int]], instances_per_node: int | None) -> list[int]:
    """The node index of each instance, in the order ``pools`` lists them (each pool's
    instances consecutively, as the simulator numbers them)."""
    total = sum(count for _, count in pools)
    if instances_per_node is None or instances_per_node >= total:
        return [0] * total
    if instances_per_node < 1:
        raise ValueError(f"instances_per_node must be >= 1, got {instances_per_node}")
    # each instance's position in the interleaved order: the k-th of a pool of n sits at
    # (k + 0.5) / n of the way, ties by pool order
    positions = []
    index = 0
    for pool_order, (_, count) in enumerate(pools):
        for k in range(count):
            positions.append(((k + 0.5) / count, pool_order, index))
            index += 1
    nodes = [0] * total
    for rank, (_, _, instance) in enumerate(sorted(positions)):
        nodes[instance] = rank // instances_per_node
    return nodes


def instance_groups(pools: Sequence[tuple[Role, int]]) -> list[int]:
    """Placement groups (``spec.placement.mode: Groups``, ``kube/group_pools.py``): the
    group of each instance, in ``instance_nodes``' order. The k-th instance of every pool is
    slice k, one pod, for k below the smallest pool's count; each instance beyond it runs
    in its pool's Deployment, a pod of its own. The simulator treats a group as a node: a
    hand-off inside it pays the in-pod link, any other the cross-pod one."""
    slices = min((count for _, count in pools), default=0)
    groups = []
    alone = slices
    for _, count in pools:
        for k in range(count):
            if k < slices:
                groups.append(k)
            else:
                groups.append(alone)
                alone += 1
    return groups
