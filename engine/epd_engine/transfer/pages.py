"""Page arithmetic shared by every backend: runs of consecutive pages and direct copies.

A cache region is a list of layer tensors whose first dimension is the page index (KV:
``[num_blocks, 2, block_size, Hkv, D]`` per layer; the image cache is one "layer"
``[num_image_blocks, tokens, H]``). A page of one layer is therefore contiguous, and a run
of consecutive page ids is one contiguous slice: backends move runs, not pages.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def page_runs(pages: Sequence[int]) -> list[tuple[int, int]]:
    """``[start, stop)`` slices covering ``pages`` in order, consecutive ids merged."""
    runs: list[tuple[int, int]] = []
    for page in pages:
        if runs and runs[-1][1] == page:
            runs[-1] = (runs[-1][0], page + 1)
        else:
            runs.append((page, page + 1))
    return runs


def paired_runs(src: Sequence[int], dst: Sequence[int]) -> list[tuple[int, int, int]]:
    """``(src_start, dst_start, count)`` pieces where both page lists are consecutive."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source pages for {len(dst)} destination pages")
    pieces: list[tuple[int, int, int]] = []
    for s, d in zip(src, dst, strict=True):
        if pieces:
            s0, d0, n = pieces[-1]
            if s0 + n == s and d0 + n == d:
                pieces[-1] = (s0, d0, n + 1)
                continue
        pieces.append((s, d, 1))
    return pieces


def copy_pages(
    src_layers: Sequence[torch.Tensor],
    src_pages: Sequence[int],
    dst_layers: Sequence[torch.Tensor],
    dst_pages: Sequence[int],
) -> int:
    """Copy pages layer by layer, one slice copy per run; returns the bytes moved."""
    pieces = paired_runs(src_pages, dst_pages)
    moved = 0
    for src, dst in zip(src_layers, dst_layers, strict=True):
        for s, d, n in pieces:
            dst[d : d + n].copy_(src[s : s + n])
            moved += n * page_nbytes(src)
    return moved


def page_nbytes(layer: torch.Tensor) -> int:
    """Bytes of one page of one layer."""
    return layer[0].numel() * layer.element_size()


def byte_view(layer: torch.Tensor, start: int, stop: int) -> memoryview:
    """Pages ``[start, stop)`` of a CPU layer as writable raw bytes (no copy)."""
    pages = layer[start:stop]
    return memoryview(pages.view(torch.uint8).numpy()).cast("B")  # type: ignore[arg-type]
