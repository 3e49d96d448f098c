"""Which pools of a method exchange caches: the pairs a migration crosses.

A request's stages run in order (encode, prefill, decode); where two consecutive stages run in
different pools, the first pool hands its cache (image embeddings after encode, KV after
prefill) to the second. E+P+D: E→P and P→D; EP+D: EP→D; E+PD: E→PD; ED+P: ED→P (images) and
P→ED (KV); EPD: none. Placement uses these pairs (the operator's preferred pod affinity keeps
partners on one node, so ``cuda_ipc``/``shm`` can carry the cache instead of the network).
"""

from __future__ import annotations

import itertools

from epd_engine.config import STAGE_ORDER, Method, Role


def cache_handoffs(method: Method) -> tuple[tuple[Role, Role], ...]:
    """(source, target) pools of each hand-off of ``method``, in stage order."""
    pools = [method.role_for(stage) for stage in STAGE_ORDER]
    return tuple((a, b) for a, b in itertools.pairwise(pools) if a != b)


def cache_partners(method: Method, role: Role) -> tuple[Role, ...]:
    """The pools ``role`` sends caches to or receives them from under ``method``, each once,
    in stage order of the hand-offs."""
    out: list[Role] = []
    for source, target in cache_handoffs(method):
        other = target if source == role else source if target == role else None
        if other is not None and other not in out:
            out.append(other)
    return tuple(out)
