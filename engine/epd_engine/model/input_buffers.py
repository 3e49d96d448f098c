"""Persistent decode inputs: token ids, positions and attention metadata in fixed buffers.

A decode-only step (every sequence appends one token) fills buffers allocated once, sized
for the largest batch, instead of building fresh tensors. Its batch is padded to the next
of a few sizes (``PAD_SIZES``, vLLM's capture sizes), so a CUDA graph captured per size
later reads the same addresses on every step.

Padded rows are harmless to real ones: each is a decode of token 0 at position 0 with a
context of one token on page 0; its K/V write goes to the *first real row's* slot with that
row's own K/V (``write_src``), so the cache ends up as without padding whatever the order
of the writes, and no real row reads a padded row (attention is per sequence, every other
op per token).

Layout: one int32 block on the device (``packed32``, FlashInfer's CSR index type) and one
int64 block (``packed64``, what torch indexing wants); the host fills a pinned staging copy
of each and sends it in one copy. Views into them are the step's tensors; their
``data_ptr`` never changes.
"""

from __future__ import annotations

import bisect
import itertools
from dataclasses import dataclass

import numpy as np
import torch

PAD_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)


def pad_sizes(max_seqs: int) -> tuple[int, ...]:
    """``PAD_SIZES`` up to the first size >= ``max_seqs`` (doubling past 256)."""
    if max_seqs < 1:
        raise ValueError(f"max_seqs must be >= 1, got {max_seqs}")
    sizes = [s for s in PAD_SIZES if s < max_seqs]
    size = PAD_SIZES[len(sizes)] if len(sizes) < len(PAD_SIZES) else PAD_SIZES[-1]
    while size < max_seqs:
        sizes.append(size)
        size *= 2
    return (*sizes, size)


@dataclass(frozen=True)
class DecodeFill:
    """What ``DecodeBuffers.fill`` wrote: the views of this step are the first rows."""

    num_seqs: int  # real decodes
    rows: int  # padded batch size: real decodes, then padding
    width: int  # most pages of any row (the torch backend's gather width)
    num_pages: int  # entries of kv_indices in use
    context_lens: list[int]  # [rows] host copy (padded rows: 1)


class DecodeBuffers:
    """Device buffers for up to ``capacity`` decodes of up to ``max_pages`` pages each."""

    def __init__(self, max_seqs: int, max_pages: int, block_size: int, device: torch.device):
        if max_pages < 1:
            raise ValueError(f"max_pages must be >= 1, got {max_pages}")
        self.sizes = pad_sizes(max_seqs)
        self.capacity = cap = self.sizes[-1]
        self.max_pages = max_pages
        self.block_size = block_size
        self.device = device
        pin = device.type == "cuda"
        # int32: qo_indptr [B+1], kv_indptr [B+1], kv_last_page_len [B], context_lens [B],
        # kv_indices [B * P]
        self._cut32 = (cap + 1, cap + 1, cap, cap, cap * max_pages)
        # int64: input_ids [B], positions [B], slot_mapping [B], write_src [B],
        # write_rows [2 * B], decode_pages [B * P]
        self._cut64 = (cap, cap, cap, cap, 2 * cap, cap * max_pages)
        self.packed32 = torch.zeros(sum(self._cut32), dtype=torch.int32, device=device)
        self.packed64 = torch.zeros(sum(self._cut64), dtype=torch.long, device=device)
        # host staging; on a CPU the buffers themselves (no copy)
        self.host32, self.host64 = self.packed32, self.packed64
        if device.type != "cpu":
            self.host32 = torch.zeros(sum(self._cut32), dtype=torch.int32, pin_memory=pin)
            self.host64 = torch.zeros(sum(self._cut64), dtype=torch.long, pin_memory=pin)
        self._host32, self._host64 = self.host32.numpy(), self.host64.numpy()  # same memory
        (self.qo_indptr, self.kv_indptr, self.kv_last_page_len, self.context_lens,
         self.kv_indices) = self.packed32.split(self._cut32)  # fmt: skip
        (self.input_ids, self.positions, self.slot_mapping, self.write_src, write_rows,
         self.decode_pages) = self.packed64.split(self._cut64)  # fmt: skip
        self.write_rows = write_rows.view(2, cap)
        # the torch backend's decode gather: K/V rows of every page slot, and the length mask
        length = max_pages * block_size
        self.decode_rows = torch.zeros(2 * cap * length, dtype=torch.long, device=device)
        self.decode_mask = torch.zeros(cap * length, dtype=torch.bool, device=device)
        self.in_page = torch.arange(block_size, device=device)
        self.key_pos = torch.arange(length, device=device)

    def padded(self, num_seqs: int) -> int:
        """The batch size ``num_seqs`` decodes run at."""
        if not 1 <= num_seqs <= self.capacity:
            raise ValueError(f"{num_seqs} decodes do not fit buffers for {self.capacity}")
        return self.sizes[bisect.bisect_left(self.sizes, num_seqs)]

    def fits(self, num_seqs: int, max_pages: int) -> bool:
        return 1 <= num_seqs <= self.capacity and max_pages <= self.max_pages

    def fill(
        self,
        token_ids: list[int],  # [n] the new token of each decode
        context_lens: list[int],  # [n] tokens in the cache after this step
        block_tables: list[list[int]],  # [n][>= pages]
        rope_positions: list[int] | None = None,  # [n] when rotary positions are not slots
    ) -> DecodeFill:
        """Write ``n`` decodes padded to ``padded(n)`` rows: one host-to-device copy per
        block. (On a GPU the staging copy is reused next step; the step's sampling
        synchronises before that.) The host side is numpy over the staging memory, with no
        Python per page: on a GPU this runs while the device waits, every step.

        ``positions`` are the rotary positions, each token's KV slot unless
        ``rope_positions`` says otherwise (M-RoPE: a text token sits past its slot)."""
        n = len(token_ids)
        rows = self.padded(n)
        bs = self.block_size
        ctx = np.ones(rows, dtype=np.int64)  # a padded row: one token on page 0
        ctx[:n] = context_lens
        pages = (ctx + bs - 1) // bs
        width = int(pages.max())
        if width > self.max_pages:
            raise ValueError(f"a decode needs {width} pages, buffers hold {self.max_pages}")
        kv = np.zeros(rows + 1, dtype=np.int64)
        np.cumsum(pages, out=kv[1:])
        indices = _first_pages(block_tables, pages[:n], int(kv[n]), rows - n)
        last = ctx - (pages - 1) * bs
        positions = ctx - 1
        slots = indices[kv[1:] - 1] * bs + positions % bs  # each row's last page holds it
        slots[n:] = slots[0]  # a padded row writes where the first real one does
        src = np.zeros(rows, dtype=np.int64)
        src[:n] = np.arange(n)
        k_rows = (slots // bs) * (2 * bs) + slots % bs
        grid = np.zeros((rows, width), dtype=np.int64)  # each row's pages, zero-padded
        row_of = np.repeat(np.arange(rows), pages)  # of each entry of indices
        column_of = np.arange(len(indices)) - np.repeat(kv[:-1], pages)
        grid[row_of, column_of] = indices
        h32, h64 = self._host32, self._host64
        c32, c64, cap = self._cut32, self._cut64, self.capacity
        at32 = [0, *itertools.accumulate(c32[:4])]
        for start, values in zip(at32, (np.arange(rows + 1), kv, last, ctx, indices), strict=True):
            h32[start : start + len(values)] = values
        at64 = [0, *itertools.accumulate(c64[:5])]
        h64[at64[0] : at64[0] + n] = token_ids
        h64[at64[0] + n : at64[0] + rows] = 0
        if rope_positions is not None:
            positions[:n] = rope_positions  # slots are computed: the rest is rotary only
        for start, values in zip(at64[1:4], (positions, slots, src), strict=True):
            h64[start : start + rows] = values
        h64[at64[4] : at64[4] + rows] = k_rows
        h64[at64[4] + cap : at64[4] + cap + rows] = k_rows + bs
        h64[at64[5] : at64[5] + grid.size] = grid.ravel()
        if self.host32 is not self.packed32:
            used32, used64 = at32[-1] + len(indices), at64[5] + grid.size
            self.packed32[:used32].copy_(self.host32[:used32], non_blocking=True)
            self.packed64[:used64].copy_(self.host64[:used64], non_blocking=True)
        return DecodeFill(n, rows, width, len(indices), ctx.tolist())


def _first_pages(
    block_tables: list[list[int]], pages: np.ndarray, total: int, pad: int
) -> np.ndarray:
    """The first ``pages[i]`` entries of each table, concatenated, then page 0 per padded
    row: ``kv_indices``. One pass over the tables in C (no per-page Python)."""
    lengths = np.fromiter((len(t) for t in block_tables), dtype=np.int64, count=len(block_tables))
    if np.any(lengths < pages):
        raise ValueError("a block table has fewer pages than its context needs")
    flat = np.fromiter(
        itertools.chain.from_iterable(block_tables), dtype=np.int64, count=int(lengths.sum())
    )
    if np.array_equal(lengths, pages):  # the usual case: tables hold exactly the pages
        chosen = flat
    else:
        starts = np.cumsum(lengths) - lengths
        offsets = np.arange(total) - np.repeat(np.cumsum(pages) - pages, pages)
        chosen = flat[np.repeat(starts, pages) + offsets]
    return np.concatenate([chosen, np.zeros(pad, dtype=np.int64)])
