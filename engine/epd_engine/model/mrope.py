"""Multimodal RoPE (Qwen2-VL): three position streams (temporal, height, width).

A text token has the same position in all three streams. An image's ``t x h x w`` merged
tokens get their grid coordinates, offset past the text before them, and the text after
an image resumes at the largest position so far + 1. Positions therefore stop being the KV
slot: a request keeps its prompt's ``[3, T]`` positions and one ``delta`` (max position + 1
- prompt length), and generated token ``n`` (KV slot ``n``) sits at ``n + delta`` in every
stream. Semantics follow transformers' ``Qwen2VLModel.get_rope_index``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

Grid = tuple[int, int, int]  # (t, h, w) in patches, as the image processor's image_grid_thw


def mrope_positions(
    token_ids: Sequence[int],
    grids: Sequence[Grid],
    image_token_id: int,
    spatial_merge_size: int,
) -> tuple[torch.Tensor, int]:
    """``([3, T] int64 positions, delta)`` of a prompt whose images have ``grids``, in order."""
    pieces: list[torch.Tensor] = []
    start = 0  # next unconsumed token
    next_pos = 0  # first position of the next text run
    num_tokens = len(token_ids)
    ids = list(token_ids)
    for grid_t, grid_h, grid_w in grids:
        h, w = grid_h // spatial_merge_size, grid_w // spatial_merge_size
        try:
            image_at = ids.index(image_token_id, start)
        except ValueError:
            raise ValueError(f"{len(grids)} image grids but fewer images in the prompt") from None
        run = grid_t * h * w
        if ids[image_at : image_at + run] != [image_token_id] * run:
            raise ValueError(f"image at token {image_at} has fewer than its {run} placeholders")
        text_len = image_at - start
        pieces.append(torch.arange(text_len).expand(3, -1) + next_pos)
        t_idx = torch.arange(grid_t).view(-1, 1).expand(-1, h * w).flatten()
        h_idx = torch.arange(h).view(1, -1, 1).expand(grid_t, -1, w).flatten()
        w_idx = torch.arange(w).view(1, 1, -1).expand(grid_t, h, -1).flatten()
        image = torch.stack([t_idx, h_idx, w_idx]) + next_pos + text_len  # [3, run]
        pieces.append(image)
        next_pos = int(image.max()) + 1
        start = image_at + run
    if start < num_tokens:
        pieces.append(torch.arange(num_tokens - start).expand(3, -1) + next_pos)
    positions = torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.long)
    delta = (int(positions.max()) + 1 - num_tokens) if num_tokens else 0
    return positions.long(), delta


@dataclass(frozen=True)
class MRopeTables:
    """What every forward's cos/sin reads, made once per device: built in each forward, the
    stream index was a host-to-device copy per step, which on a GPU waits for the device."""

    inv_freq: torch.Tensor  # [D/2] float32
    stream: torch.Tensor  # [D/2] int64: the stream (t, h, w) each rotary pair reads

    @classmethod
    def build(
        cls,
        head_dim: int,
        rope_theta: float,
        mrope_section: Sequence[int],
        device: torch.device,
        interleaved: bool = False,
    ) -> MRopeTables:
        """``interleaved`` (Qwen3-VL): pairs take t, h, w in turn (``[THWTHW...TT]``, pair
        ``j`` reads stream ``j % 3`` while that stream has pairs left), else the sections
        are contiguous (Qwen2-VL: ``[TT..HH..WW..]``)."""
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float()
        inv_freq = 1.0 / (rope_theta ** (exponents / head_dim))
        if interleaved:
            stream = interleaved_streams(mrope_section)
        else:
            stream = torch.cat(
                [torch.full((n,), i, dtype=torch.long) for i, n in enumerate(mrope_section)]
            )
        return cls(inv_freq.to(device), stream.to(device))


def interleaved_streams(mrope_section: Sequence[int]) -> torch.Tensor:  # [D/2] int64
    """transformers' ``apply_interleaved_mrope``: start from all-t, then pairs
    ``1, 4, 7, ...`` below ``3 * section[1]`` read h and ``2, 5, 8, ...`` below
    ``3 * section[2]`` read w."""
    stream = torch.zeros(sum(mrope_section), dtype=torch.long)
    for dim in (1, 2):
        stream[dim : 3 * mrope_section[dim] : 3] = dim
    return stream


def mrope_cos_sin(
    positions: torch.Tensor,  # [3, T] int64 (or [T]: text, the same in all streams)
    tables: MRopeTables,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(cos, sin)``, each ``[T, head_dim]``: rotary pair ``j`` reads the stream its
    section assigns it (``mrope_section`` pairs to t, then h, then w; both halves alike).
    Device ops only: nothing is copied from the host."""
    if positions.dim() == 1:
        positions = positions.expand(3, -1)
    freqs = positions.float()[:, :, None] * tables.inv_freq  # [3, T, D/2]
    index = tables.stream.view(1, 1, -1).expand(1, freqs.shape[1], -1)
    picked = freqs.gather(0, index)[0]  # [T, D/2]
    angles = torch.cat((picked, picked), dim=-1)  # [T, D]
    return angles.cos().to(dtype), angles.sin().to(dtype)


@dataclass(frozen=True)
class MRopeState:
    """A request's rotary positions: its prompt's ``[3, T]`` and ``delta`` for what follows.

    Derived from the prompt alone (token ids and image grids), so an instance a request
    migrates to recomputes the same state from the request it receives.
    """

    prompt_positions: torch.Tensor  # [3, T] int64
    delta: int

    def text_position(self, slot: int) -> int:
        """The position of the text token at KV slot ``slot``: one number, the same in all
        three streams (a decode's token, or a text token of the prompt)."""
        if slot < self.prompt_positions.shape[1]:
            return int(self.prompt_positions[0, slot])
        return slot + self.delta

    def positions(self, start: int, num_tokens: int) -> torch.Tensor:  # [3, num_tokens]
        """Positions of the tokens at KV slots ``start .. start + num_tokens``."""
        slots = torch.arange(start, start + num_tokens)
        out = (slots + self.delta).expand(3, -1).clone()
        in_prompt = max(0, min(num_tokens, self.prompt_positions.shape[1] - start))
        out[:, :in_prompt] = self.prompt_positions[:, start : start + in_prompt]
        return out
