"""Routing by cache affinity, bounded by load (pure Python: the router, migration sources and
the simulator place requests with it).

A request carries an *affinity key*: what its prompt starts with (a conversation's opening
messages, ``router/affinity_key.py``). Requests with the same key share a prefix, so they go
to the same instance -- the one the key ranks first by rendezvous hashing over the
candidates' ids, which every router replica and source computes alike with no shared state,
and which moves only the keys of an instance that leaves or joins. That instance holds the
prefix's KV pages and the images' embeddings from the earlier turns.

Affinity never builds a hot spot: the preferred instance is taken only while its queue
(waiting + running requests) exceeds the least-loaded candidate's by at most the bound;
otherwise the least-loaded one is (an *override*). A request with no key goes to the least
loaded, as before.
"""

from __future__ import annotations

import enum
import hashlib
from collections.abc import Sequence
from dataclasses import dataclass, field

from epd_engine.contracts.routing_policy import InstanceLoad, LeastLoaded


class Affinity(enum.StrEnum):
    """How a placement went: to the key's instance, away from it (load bound), or no key."""

    FOLLOWED = "followed"
    OVERRIDDEN = "overridden"
    NONE = "none"


@dataclass(frozen=True)
class LoadBound:
    """The preferred instance may hold ``max(slack_requests, slack_ratio x least)`` requests
    more than the least-loaded candidate's ``least``."""

    slack_requests: int = 4
    slack_ratio: float = 0.5

    def __post_init__(self) -> None:
        if self.slack_requests < 0 or self.slack_ratio < 0:
            raise ValueError(f"load bound must be >= 0, got {self}")

    def allows(self, preferred_depth: int, least_depth: int) -> bool:
        slack = max(float(self.slack_requests), self.slack_ratio * least_depth)
        return preferred_depth <= least_depth + slack


def rank(key: str, instance_id: str) -> int:
    """Rendezvous score of ``instance_id`` for ``key`` (highest wins)."""
    return int.from_bytes(hashlib.sha256(f"{key}|{instance_id}".encode()).digest()[:8], "big")


def preferred(candidates: Sequence[InstanceLoad], key: str) -> InstanceLoad:
    return max(candidates, key=lambda c: (rank(key, c.instance_id), c.instance_id))


@dataclass
class PrefixAffinity:
    """The key's instance within the load bound, else the least loaded (counts both)."""

    bound: LoadBound = field(default_factory=LoadBound)
    fallback: LeastLoaded = field(default_factory=LeastLoaded)
    counts: dict[Affinity, int] = field(default_factory=lambda: dict.fromkeys(Affinity, 0))

    def choose(self, candidates: Sequence[InstanceLoad], key: str | None = None) -> InstanceLoad:
        target, _ = self.decide(candidates, key)
        return target

    def decide(
        self, candidates: Sequence[InstanceLoad], key: str | None
    ) -> tuple[InstanceLoad, Affinity]:
        if not candidates:
            raise ValueError("no instance to choose from")
        least = self.fallback.choose(candidates)
        outcome = Affinity.NONE
        target = least
        if key:
            best = preferred(candidates, key)
            if self.bound.allows(best.queue_depth, least.queue_depth):
                target, outcome = best, Affinity.FOLLOWED
            else:
                outcome = Affinity.OVERRIDDEN
        self.counts[outcome] += 1
        return target, outcome
