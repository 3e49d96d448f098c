"""Hand-off targets in the source's placement group first, bounded by load (pure Python).

A placement group (``epdctl group``, one pod; ``docs/kubernetes.md``, "Group pods") runs the
instances of one slice of the plan side by side, every member seeing the pod's GPUs and
``/dev/shm``, so a cache handed over inside it moves through CUDA IPC or shared memory, never
the pod network: the plan grouped them for that. A source therefore hands a request to the
least-loaded peer of the next stage in its own group while that peer is within the locality
bound of the least-loaded peer anywhere (``node_locality.LocalityBound``, the node-local
choice's bound). Otherwise -- the group's peer is busier, the source is in no group -- the
usual choice: the affinity key's instance within its load bound (``affinity.py``), else the
least loaded on the source's node within the bound, else the least loaded.

The group comes before the affinity key: the router places a conversation's turns on the
same entry instance by its key, and so in the same group, whose peers then hold its pages.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from typing import NamedTuple

from epd_engine.contracts.affinity import Affinity, PrefixAffinity
from epd_engine.contracts.node_locality import LocalityBound, local_choice
from epd_engine.contracts.routing_policy import InstanceLoad, LeastLoaded


class Locality(enum.StrEnum):
    """Where a hand-off's target runs, seen from its source (the closest that holds)."""

    GROUP = "group"  # the source's placement group: in-pod shm / CUDA IPC
    NODE = "node"  # the source's machine, another pod or process
    REMOTE = "remote"  # another machine, or a node not known


def locality(source: InstanceLoad, target: InstanceLoad) -> Locality:
    if source.group and source.group == target.group:
        return Locality.GROUP
    if source.node and source.node == target.node:
        return Locality.NODE
    return Locality.REMOTE


def group_choice(
    candidates: Sequence[InstanceLoad],
    group: str,
    least: InstanceLoad,
    bound: LocalityBound | None = None,
) -> InstanceLoad | None:
    """The least-loaded candidate in ``group`` if ``bound`` lets it stand in for ``least``."""
    members = [c for c in candidates if group and c.group == group]
    if not members:
        return None
    best = LeastLoaded().choose(members)
    return best if (bound or LocalityBound()).allows(best, least) else None


class Handoff(NamedTuple):
    target: InstanceLoad
    # how the affinity key weighed; None: the group's peer was taken, no key consulted
    affinity: Affinity | None


def choose_handoff(
    policy: PrefixAffinity,
    candidates: Sequence[InstanceLoad],
    key: str | None,
    source: InstanceLoad,
    bound: LocalityBound | None = None,
) -> Handoff:
    """The next stage's instance for a request ``source`` hands on (``candidates`` not empty)."""
    grouped = group_choice(candidates, source.group, policy.fallback.choose(candidates), bound)
    if grouped is not None:
        return Handoff(grouped, None)
    target, affinity = policy.decide(candidates, key)
    if affinity is not Affinity.FOLLOWED:  # no cached prefix to follow: stay on the node
        target = local_choice(candidates, source.node, target, bound) or target
    return Handoff(target, affinity)
