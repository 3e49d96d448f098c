"""Routing policy seam (pure Python: the simulator uses the same classes).

The router picks the entry pool by modality (images enter an encode-capable pool, text
skips E), then the least-loaded instance in it; a source picks its migration target the
same way among instances of the next stage's pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import asdict, dataclass, fields
from typing import Any, Protocol

from epd_engine.config import Method, Role, Stage


@dataclass(frozen=True)
class InstanceLoad:
    """What an instance reports in its heartbeat."""

    instance_id: str
    url: str
    role: Role
    pool: str
    num_waiting: int = 0
    num_running: int = 0
    free_kv_blocks: int = 0
    free_image_blocks: int = 0
    # why the instance is out of service for good (a device error, a stuck engine thread:
    # engine/health.py); the router takes it out of routing when it says so. "": it serves
    unhealthy_reason: str = ""
    # shutting down (a pod being replaced): takes no new request or migration, finishes
    # what it holds (server/drain.py)
    draining: bool = False
    # the machine it runs on (its kernel's boot id, contracts/host.py): peers on
    # one node exchange caches through shared memory (contracts/node_locality.py). "": unknown
    node: str = ""
    # the placement group it is a member of (``epdctl group``: one pod, whose members hand
    # caches over through shared memory or CUDA IPC; contracts/group_locality.py). "": none
    group: str = ""

    @property
    def queue_depth(self) -> int:
        return self.num_waiting + self.num_running

    def to_json(self) -> dict[str, Any]:
        data = {**asdict(self), "role": self.role.value}
        if not self.draining:  # a peer of an earlier version refuses keys it does not know
            del data["draining"]
        if not self.node:
            del data["node"]
        if not self.group:
            del data["group"]
        if not self.unhealthy_reason:
            del data["unhealthy_reason"]
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> InstanceLoad:
        """Fields this version does not know are ignored (a router and its instances may run
        different versions during an upgrade)."""
        known = {k: v for k, v in data.items() if k in _LOAD_FIELDS}
        return cls(**{**known, "role": Role(str(data["role"]))})


_LOAD_FIELDS = frozenset(f.name for f in fields(InstanceLoad))


class RoutingPolicy(Protocol):
    """Contract: return one of ``candidates`` (never empty); must not mutate them."""

    def choose(self, candidates: Sequence[InstanceLoad]) -> InstanceLoad: ...


class LeastLoaded:
    """Fewest queued+running requests; ties go to more free cache pages, then the id."""

    def choose(self, candidates: Sequence[InstanceLoad]) -> InstanceLoad:
        if not candidates:
            raise ValueError("no instance to choose from")
        return min(candidates, key=load_order)


def load_order(load: InstanceLoad) -> tuple[int, int, str]:
    """``LeastLoaded``'s order, least first."""
    return (load.queue_depth, -(load.free_kv_blocks + load.free_image_blocks), load.instance_id)


def first_stage(has_images: bool) -> Stage:
    """Text-only requests skip encode."""
    return Stage.ENCODE if has_images else Stage.PREFILL


def entry_role(method: Method, has_images: bool) -> Role:
    return method.role_for(first_stage(has_images))


def entry_candidates(instances: Sequence[InstanceLoad], has_images: bool) -> list[InstanceLoad]:
    """Instances whose role runs the request's first stage (works for any set of pools)."""
    stage = first_stage(has_images)
    return [i for i in instances if i.role.runs(stage)]
