"""Which KV pages a sliding-window layer still reads.

After ``num_tokens`` tokens are in the cache, the next token (position ``num_tokens``)
and every later one see, in a layer of window ``w``, only positions from
``num_tokens + 1 - w`` on: the pages before that one hold nothing that layer will read
again. A migration leaves them out for those layers (``transfer/plan.py``), and a page
whose sliding layers were left out is never published to the prefix cache (it is not
whole).
"""

from __future__ import annotations

from collections.abc import Sequence


def first_live_page(num_tokens: int, window: int | None, block_size: int) -> int:
    """The first page a layer of ``window`` (None: global) reads from now on."""
    if window is None:
        return 0
    return max(0, num_tokens + 1 - window) // block_size


def layer_runs(
    lo: int, hi: int, windows: Sequence[int | None], num_tokens: int, block_size: int
) -> list[tuple[int, int, int]]:
    """Layers ``[lo, hi)`` as runs of neighbours with the same first live page:
    ``(start, stop, first page)``; without ``windows`` (no sliding layers) one run from 0."""
    if not windows:
        return [(lo, hi, 0)]
    runs: list[tuple[int, int, int]] = []
    for layer in range(lo, hi):
        first = first_live_page(num_tokens, windows[layer], block_size)
        if runs and runs[-1][2] == first:
            runs[-1] = (runs[-1][0], layer + 1, first)
        else:
            runs.append((layer, layer + 1, first))
    return runs
