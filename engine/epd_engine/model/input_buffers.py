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
    ) -> DecodeFill:
        """Write ``n`` decodes padded to ``padded(n)`` rows: one host-to-device copy per
        block. (On a GPU the staging copy is reused next step; the step's sampling
        synchronises before that.)"""
        n = len(token_ids)
        rows = self.padded(n)
        bs = self.block_size
        pages = [-(-ctx // bs) for ctx in context_lens]
        width = max(pages)
        if width > self.max_pages:
            raise ValueError(f"a decode needs {width} pages, buffers hold {self.max_pages}")
        pad = rows - n
        ctx = context_lens + [1] * pad
        pages += [1] * pad
        tables = [t[:p] for t, p in zip(block_tables, pages, strict=False)] + [[0]] * pad
        qo = list(range(rows + 1))
        kv = [0]
        for p in pages:
            kv.append(kv[-1] + p)
        last = [c - (p - 1) * bs for c, p in zip(ctx, pages, strict=True)]
        indices = [page for table in tables for page in table]
        h32 = self.host32
        c32 = self._cut32
        offsets32 = [0, *itertools.accumulate(c32[:4])]
        for start, values in zip(offsets32, (qo, kv, last, ctx, indices), strict=True):
            h32[start : start + len(values)] = torch.tensor(values, dtype=torch.int32)
        positions = [c - 1 for c in ctx]
        slots = [t[p // bs] * bs + p % bs for t, p in zip(tables, positions, strict=True)]
        slots[n:] = [slots[0]] * pad  # a padded row writes where the first real one does
        src = list(range(n)) + [0] * pad
        k_rows = [(s // bs) * 2 * bs + s % bs for s in slots]
        v_rows = [r + bs for r in k_rows]
        page_grid = [t + [0] * (width - len(t)) for t in tables]
        flat_grid = [page for row in page_grid for page in row]
        ids = token_ids + [0] * pad
        h64 = self.host64
        c = self._cut64
        cap = self.capacity
        starts64 = (0, *itertools.accumulate(c[:3]))
        for start, values in zip(starts64, (ids, positions, slots, src), strict=True):
            h64[start : start + rows] = torch.tensor(values, dtype=torch.long)
        rows_at = sum(c[:4])
        h64[rows_at : rows_at + rows] = torch.tensor(k_rows, dtype=torch.long)
        h64[rows_at + cap : rows_at + cap + rows] = torch.tensor(v_rows, dtype=torch.long)
        grid_at = rows_at + 2 * cap
        h64[grid_at : grid_at + len(flat_grid)] = torch.tensor(flat_grid, dtype=torch.long)
        if h32 is not self.packed32:
            used32, used64 = offsets32[-1] + len(indices), grid_at + len(flat_grid)
            self.packed32[:used32].copy_(h32[:used32], non_blocking=True)
            self.packed64[:used64].copy_(h64[:used64], non_blocking=True)
        return DecodeFill(n, rows, width, len(indices), ctx)
