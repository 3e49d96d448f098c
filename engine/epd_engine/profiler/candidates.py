"""The search space: every method and every instance ratio for a GPU budget.

One instance per GPU. For N instances, EP+D, ED+P and E+PD have C(N-1, 1) ratios, E+P+D has
C(N-1, 2) and EPD one (HydraInfer's count). ``proportional_split`` is HydraInfer's heuristic
partition: instances in proportion to each pool's work per request.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from epd_engine.config import Method, Role

ALL_METHODS: tuple[Method, ...] = tuple(Method)


@dataclass(frozen=True, order=True)
class Candidate:
    """A method and its instance counts, in ``method.roles`` order."""

    method: Method
    counts: tuple[int, ...]

    @property
    def pools(self) -> dict[Role, int]:
        return dict(zip(self.method.roles, self.counts, strict=True))

    @property
    def num_instances(self) -> int:
        return sum(self.counts)

    def describe(self) -> str:
        ratio = "".join(
            f"{n}{r.value}" for r, n in zip(self.method.roles, self.counts, strict=True)
        )
        return f"{self.method.value} {ratio}"


def compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every way to write ``total`` as ``parts`` positive integers, in order."""
    if parts < 1 or total < parts:
        return
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(parts))


def enumerate_candidates(num_gpus: int, methods: Sequence[Method] = ALL_METHODS) -> list[Candidate]:
    if num_gpus < 1:
        raise ValueError(f"the GPU budget must be >= 1, got {num_gpus}")
    return [
        Candidate(method, counts)
        for method in methods
        for counts in compositions(num_gpus, len(method.roles))
    ]


def proportional_split(num_gpus: int, weights: Sequence[float]) -> tuple[int, ...] | None:
    """Largest-remainder split of ``num_gpus`` by ``weights``, each part >= 1.

    None when there are fewer GPUs than parts.
    """
    parts = len(weights)
    if num_gpus < parts:
        return None
    total = sum(weights)
    exact = [num_gpus * (w / total if total > 0 else 1 / parts) for w in weights]
    counts = [max(1, int(x)) for x in exact]
    while sum(counts) < num_gpus:  # hand out the rest by largest remainder
        counts[max(range(parts), key=lambda i: exact[i] - counts[i])] += 1
    while sum(counts) > num_gpus:  # the minimum of one each overshot: take from the richest
        counts[
            max((i for i in range(parts) if counts[i] > 1), key=lambda i: counts[i] - exact[i])
        ] -= 1
    return tuple(counts)
