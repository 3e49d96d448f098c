"""Where the simulator sends a request: the routing policy's pick among one pool's instances,
without reading every instance's load for every pick.

The router reads every candidate's load and takes the least loaded (``LeastLoaded``), or the
key's rendezvous instance within a load bound (``PrefixAffinity``). Done literally, a
256-instance plan on a 10,000-request trace builds a 256-load list per arrival and per
hand-off. ``IndexedPool`` keeps a pool's instances in a heap ordered as ``LeastLoaded``
orders them, re-keys only the instances whose load changed since its last pick
(``SimInstance.changed`` marks them), and remembers each affinity key's rendezvous instance:
the same pick, in time that grows with the changes, not with the pool. ``ScannedPool`` is
the literal reading: the reference the indexed one is tested against, and the path of any
other policy.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence

from epd_engine.contracts.affinity import Affinity, PrefixAffinity, preferred
from epd_engine.contracts.node_locality import local_choice
from epd_engine.contracts.routing_policy import InstanceLoad, LeastLoaded, RoutingPolicy
from epd_engine.profiler.sim_instance import SimInstance


def decide(
    policy: RoutingPolicy, loads: Sequence[InstanceLoad], key: str | None
) -> tuple[InstanceLoad, bool]:
    """The policy's pick; True when it followed ``key``'s affinity."""
    if isinstance(policy, PrefixAffinity):
        chosen, outcome = policy.decide(loads, key)
        return chosen, outcome is Affinity.FOLLOWED
    return policy.choose(loads), False


class ScannedPool:
    """Every pick reads every member's load (what the router computes)."""

    def __init__(self, members: Sequence[SimInstance], policy: RoutingPolicy) -> None:
        self.members = list(members)
        self.policy = policy

    def choose(self, key: str | None) -> tuple[SimInstance, bool]:
        """The policy's pick for a request with affinity ``key``; True when it followed it."""
        loads = [m.load() for m in self.members]
        chosen, followed = decide(self.policy, loads, key)
        return self.members[loads.index(chosen)], followed

    def near(self, node: str, chosen: SimInstance) -> SimInstance | None:
        """The least-loaded member on ``node`` if it may stand in for ``chosen``."""
        loads = [m.load() for m in self.members]
        local = local_choice(loads, node, chosen.load())
        return None if local is None else self.members[loads.index(local)]


class IndexedPool(ScannedPool):
    """``ScannedPool``'s picks for ``LeastLoaded`` and ``PrefixAffinity`` (over it), from a
    heap of the members' load order that only changed members re-enter."""

    def __init__(self, members: Sequence[SimInstance], policy: RoutingPolicy) -> None:
        super().__init__(members, policy)
        self._order = [m.order() for m in self.members]
        self._heap = [(order, position) for position, order in enumerate(self._order)]
        heapq.heapify(self._heap)
        self._changed: set[int] = set()  # positions whose load may differ from ``_order``
        for position, member in enumerate(self.members):
            member.watchers.append((self._changed, position))
        self._preferred: dict[str, SimInstance] = {}  # affinity key -> rendezvous member
        self._on_node: dict[str, list[SimInstance]] = {}
        for member in self.members:
            self._on_node.setdefault(member.node, []).append(member)

    def least(self) -> SimInstance:
        """``LeastLoaded().choose`` over the members' current loads."""
        order, heap = self._order, self._heap
        for position in self._changed:
            now = self.members[position].order()
            if now != order[position]:
                order[position] = now
                heapq.heappush(heap, (now, position))
        self._changed.clear()
        while heap[0][0] != order[heap[0][1]]:  # an entry from before the member changed
            heapq.heappop(heap)
        if len(heap) > 2 * len(order) + 64:  # drop the stale entries
            self._heap = heap = [(o, position) for position, o in enumerate(order)]
            heapq.heapify(heap)
        return self.members[heap[0][1]]

    def choose(self, key: str | None) -> tuple[SimInstance, bool]:
        least = self.least()
        if not isinstance(self.policy, PrefixAffinity):
            return least, False
        # The policy decides between the two members it could pick: the least loaded is the
        # least of the pair, the key's rendezvous member is the pair's preferred; its count
        # of outcomes goes on as over the whole pool.
        pair = [least]
        if key:
            best = self._preferred.get(key)
            if best is None:
                best = self._preferred[key] = self._rendezvous(key)
            pair.append(best)
        loads = [m.load() for m in pair]
        chosen, followed = decide(self.policy, loads, key)
        return pair[loads.index(chosen)], followed

    def _rendezvous(self, key: str) -> SimInstance:
        by_id = {m.instance_id: m for m in self.members}
        return by_id[preferred([m.load() for m in self.members], key).instance_id]

    def near(self, node: str, chosen: SimInstance) -> SimInstance | None:
        local = self._on_node.get(node, []) if node else []
        loads = [m.load() for m in local]
        found = local_choice(loads, node, chosen.load())
        return None if found is None else local[loads.index(found)]


def routing_pool(
    members: Sequence[SimInstance], policy: RoutingPolicy, indexed: bool = True
) -> ScannedPool:
    """An ``IndexedPool`` where the policy is one it reproduces exactly, else a scanned one."""
    fallback = policy.fallback if isinstance(policy, PrefixAffinity) else policy
    exact = type(policy) in (LeastLoaded, PrefixAffinity) and type(fallback) is LeastLoaded
    if indexed and exact and members:
        return IndexedPool(members, policy)
    return ScannedPool(members, policy)
