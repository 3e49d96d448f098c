"""The search space: every method and every instance ratio for a GPU budget, and with
tensor-parallel sizes allowed, every size of each pool's instances.

One instance per GPU at size 1. For N instances, EP+D, ED+P and E+PD have C(N-1, 1) ratios,
E+P+D has C(N-1, 2) and EPD one (HydraInfer's count). With sizes, a pool of n instances of
size s takes n x s GPUs, every pool that runs the language model takes each allowed size
(an encoder runs whole: size 1), and the pools' GPUs add up to the budget.
``proportional_split`` is HydraInfer's heuristic partition: instances in proportion to each
pool's work per request.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from epd_engine.config import Method, Role
from epd_engine.contracts.plan import describe_pools

ALL_METHODS: tuple[Method, ...] = tuple(Method)


@dataclass(frozen=True, order=True)
class Candidate:
    """A method and its instance counts, in ``method.roles`` order, and their
    tensor-parallel sizes in the same order (empty: every instance one rank)."""

    method: Method
    counts: tuple[int, ...]
    sizes: tuple[int, ...] = ()

    @property
    def pools(self) -> dict[Role, int]:
        return dict(zip(self.method.roles, self.counts, strict=True))

    @property
    def tensor_parallel(self) -> dict[Role, int]:
        """Each pool's size, where above 1 (``Plan.tensor_parallel``)."""
        if not self.sizes:
            return {}
        return {r: s for r, s in zip(self.method.roles, self.sizes, strict=True) if s > 1}

    def size_of(self, role: Role) -> int:
        return self.tensor_parallel.get(role, 1)

    @property
    def num_instances(self) -> int:
        return sum(self.counts)

    @property
    def num_gpus(self) -> int:
        return sum(n * self.size_of(r) for r, n in self.pools.items())

    def describe(self) -> str:
        """As its plan says it (``Plan.describe``)."""
        return describe_pools(self.method, self.pools, self.tensor_parallel)


def order_key(candidate: Candidate) -> tuple[str, tuple[int, ...], tuple[int, ...]]:
    """A candidate's own order (``order=True``) as a tuple of builtins: sorting by it compares
    in C, not through the dataclass's ``__lt__`` (a fifth of a second over 33,151 candidates)."""
    return (candidate.method, candidate.counts, candidate.sizes)


def compositions(total: int, parts: int) -> Iterator[tuple[int, ...]]:
    """Every way to write ``total`` as ``parts`` positive integers, in order."""
    if parts < 1 or total < parts:
        return
    for cuts in itertools.combinations(range(1, total), parts - 1):
        bounds = (0, *cuts, total)
        yield tuple(bounds[i + 1] - bounds[i] for i in range(parts))


def sized_compositions(total: int, sizes: Sequence[int]) -> Iterator[tuple[int, ...]]:
    """Every tuple of positive counts whose sum of count x size is ``total``, in order."""
    if sizes and all(size == 1 for size in sizes):  # the common case, no recursion
        yield from compositions(total, len(sizes))
        return
    if not sizes:
        if total == 0:
            yield ()
        return
    first, rest = sizes[0], sizes[1:]
    for count in range(1, (total - sum(rest)) // first + 1):
        for tail in sized_compositions(total - count * first, rest):
            yield (count, *tail)


def enumerate_candidates(
    num_gpus: int, methods: Sequence[Method] = ALL_METHODS, tp_sizes: Sequence[int] = (1,)
) -> list[Candidate]:
    """Every method, ratio and (``tp_sizes`` beyond 1) size of each pool that runs the
    language model, using exactly ``num_gpus``."""
    if num_gpus < 1:
        raise ValueError(f"the GPU budget must be >= 1, got {num_gpus}")
    out = []
    for method in methods:
        choices = [tp_sizes if role.needs_language else (1,) for role in method.roles]
        for sizes in itertools.product(*choices):
            kept = sizes if any(s > 1 for s in sizes) else ()
            for counts in sized_compositions(num_gpus, sizes):
                out.append(Candidate(method, counts, kept))
    return out


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
