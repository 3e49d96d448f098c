"""Which page copies fill a PullTask: pure arithmetic, no I/O (unit-tested on its own)."""

from __future__ import annotations

from collections.abc import Sequence

from epd_engine.cache.kv_cache import blocks_needed
from epd_engine.cache.window_pages import layer_runs
from epd_engine.request import CacheKind
from epd_engine.scheduler.output import PullTask
from epd_engine.transfer.backend import PageTransfer, TransferError


def transfers_for(
    task: PullTask,
    num_layers: int,
    layers_per_group: int,
    kv_block_size: int,
    layer_windows: Sequence[int | None] = (),
) -> list[PageTransfer]:
    """Image pulls: one transfer for every image not cached here. KV pulls: one transfer
    per group of ``layers_per_group`` layers over the pages holding computed tokens, less
    those this instance's prefix cache holds already (none when it holds them all), and
    for sliding-window layers (``layer_windows``) less the pages behind their window (a
    group then splits into runs of layers that need the same pages)."""
    source = task.source
    if task.kind is CacheKind.IMAGE:
        src: list[int] = []
        dst: list[int] = []
        for index, blocks in sorted(task.image_blocks.items()):
            if index >= len(source.image_pages):
                raise TransferError(f"the source has no pages for image {index}")
            theirs = source.image_pages[index]
            if len(theirs) != len(blocks):
                raise TransferError(
                    f"image {index}: {len(theirs)} source pages for {len(blocks)} here "
                    "(different image-cache page sizes?)"
                )
            src += theirs
            dst += blocks
        if not dst:
            return []  # every image was already cached here
        return [PageTransfer(task.request_id, task.kind, tuple(src), tuple(dst))]
    num_used = blocks_needed(task.num_kv_tokens, kv_block_size)
    if num_used == 0:
        return []
    if len(source.kv_pages) < num_used or len(task.kv_blocks) < num_used:
        raise TransferError(
            f"{task.num_kv_tokens} tokens need {num_used} KV pages; the source exposes "
            f"{len(source.kv_pages)}, {len(task.kv_blocks)} were allocated here"
        )
    held = task.num_held_kv_pages
    if held >= num_used:
        return []
    step = max(1, layers_per_group)
    transfers = []
    for lo in range(0, num_layers, step):
        transfers += kv_transfers(
            task, source.kv_pages, lo, min(lo + step, num_layers), kv_block_size, layer_windows
        )
    return transfers


def kv_transfers(
    task: PullTask,
    src_pages: Sequence[int],
    lo: int,
    hi: int,
    kv_block_size: int,
    layer_windows: Sequence[int | None] = (),
) -> list[PageTransfer]:
    """The copies of layers ``[lo, hi)``: the pages from what this instance holds (its
    prefix cache) or, for a sliding layer, from its window's first page, to the last."""
    num_used = blocks_needed(task.num_kv_tokens, kv_block_size)
    transfers = []
    for start, stop, first in layer_runs(lo, hi, layer_windows, task.num_kv_tokens,
                                         kv_block_size):  # fmt: skip
        begin = max(task.num_held_kv_pages, first)
        if begin >= num_used:
            continue
        src, dst = tuple(src_pages[begin:num_used]), tuple(task.kv_blocks[begin:num_used])
        transfers.append(PageTransfer(task.request_id, task.kind, src, dst, start, stop))
    return transfers
