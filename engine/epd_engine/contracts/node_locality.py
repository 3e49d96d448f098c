"""Migration targets on the source's own node first, bounded by load (pure Python).

A cache handed to a peer on the same node goes through ``/dev/shm`` or CUDA IPC; to another
node it crosses the network (a LLaVA-7B KV cache of 640 tokens is about 335 MB). A source
therefore offers a hand-off to the least-loaded peer of the next stage on its own node
(``InstanceLoad.node``: the kernel's boot id, the same for every pod and process on one
machine) while that peer is not clearly busier than the least-loaded peer anywhere: it has no
more waiting requests than that one, and at most ``max(slack_requests, slack_ratio x its
queue)`` more queued and running. Otherwise -- a busy local peer while another is idle, no
peer on the node, a node unknown -- the choice is the plain policy's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from epd_engine.contracts.routing_policy import InstanceLoad, LeastLoaded


@dataclass(frozen=True)
class LocalityBound:
    slack_requests: int = 2
    slack_ratio: float = 0.25

    def __post_init__(self) -> None:
        if self.slack_requests < 0 or self.slack_ratio < 0:
            raise ValueError(f"locality bound must be >= 0, got {self}")

    def allows(self, local: InstanceLoad, least: InstanceLoad) -> bool:
        """Whether ``local`` may take work the least-loaded candidate ``least`` would get."""
        if local.num_waiting > least.num_waiting:
            return False  # it would queue the request where another runs it now
        slack = max(float(self.slack_requests), self.slack_ratio * least.queue_depth)
        return local.queue_depth <= least.queue_depth + slack


def on_node(candidates: Sequence[InstanceLoad], node: str) -> list[InstanceLoad]:
    """The candidates on ``node`` (none where the node is unknown)."""
    return [c for c in candidates if node and c.node == node]


def local_choice(
    candidates: Sequence[InstanceLoad],
    node: str,
    least: InstanceLoad,
    bound: LocalityBound | None = None,
) -> InstanceLoad | None:
    """The least-loaded candidate on ``node`` if ``bound`` lets it stand in for ``least``."""
    local = on_node(candidates, node)
    if not local:
        return None
    best = LeastLoaded().choose(local)
    return best if (bound or LocalityBound()).allows(best, least) else None


@dataclass
class LocalFirst:
    """A routing policy: the least-loaded peer on ``node`` within the bound, else the least
    loaded anywhere; counts how often each happened."""

    node: str
    bound: LocalityBound = field(default_factory=LocalityBound)
    fallback: LeastLoaded = field(default_factory=LeastLoaded)
    num_local: int = 0
    num_remote: int = 0

    def choose(self, candidates: Sequence[InstanceLoad]) -> InstanceLoad:
        least = self.fallback.choose(candidates)
        local = local_choice(candidates, self.node, least, self.bound)
        if local is not None:
            self.num_local += 1
            return local
        self.num_remote += 1
        return least
