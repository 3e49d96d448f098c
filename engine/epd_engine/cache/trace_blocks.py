"""A prompt's prefix identity for the live trace: ``hash_ids``, one per full block.

The entry instance tokenizes every request, so it names the prompt's prefixes with the
prefix cache's own hash chain (``PageHasher``: token ids, the images each block covers, a
salt), over blocks of ``TRACE_BLOCK_TOKENS`` instead of KV pages, so that a trace line stays
short. Block ``b``'s id stands for the whole prefix up to its end: two prompts' ids agree
from the start exactly as far as their tokens and images do, which is what the simulator's
prefix model needs (``profiler/sim_prefix.py``). The router copies the ids into the trace.
"""

from __future__ import annotations

from collections.abc import Sequence

from epd_engine.cache.prefix_hash import PageHasher
from epd_engine.request import ImageRef

TRACE_BLOCK_TOKENS = 64  # fine enough for short chat turns, coarse enough for short lines
MAX_TRACE_BLOCKS = 512  # 32,768 tokens: a longer prompt's tail goes unnamed (never a hit)
_SALT = "epd-trace"  # one trace, one model: any fixed salt
_ID_BITS = 63  # non-negative int64, as Mooncake's ids


def trace_hash_ids(token_ids: Sequence[int], images: Sequence[ImageRef]) -> list[int]:
    """The ids of the prompt's full blocks (at most ``MAX_TRACE_BLOCKS``)."""
    hasher = PageHasher(TRACE_BLOCK_TOKENS, _SALT)
    keys: list[str] = []
    known = min(len(token_ids), TRACE_BLOCK_TOKENS * MAX_TRACE_BLOCKS)
    hasher.extend(keys, lambda start, stop: list(token_ids[start:stop]), images, known)
    return [int(key[:16], 16) >> (64 - _ID_BITS) for key in keys]
