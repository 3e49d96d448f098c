"""Qwen3-VL's vision tower (the E stage): patches -> the embedding and the DeepStack
features of every merged 2x2 patch group.

Against Qwen2-VL's ViT: the patch embedding has a bias; learned position embeddings on a
``side x side`` grid are interpolated bilinearly to each image's patch grid and added before
the blocks (the 2-D rotary stays); the MLP is ``linear_fc1`` / ``linear_fc2`` with tanh GELU;
after each block in ``deepstack_indexes`` a merger of its own (normalised after the 2x2
shuffle) makes one more feature per token. Parameter names mirror the hub's
``model.visual.*`` minus that prefix.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from epd_engine.model.mrope import Grid
from epd_engine.model.qwen2_vl import VisionAttention, vision_rotary
from epd_engine.model.qwen3_vl_config import Qwen3VLModelConfig


class Qwen3PatchEmbed(nn.Module):
    """A stride-equal-kernel Conv3d (with bias) over ``(t, p, p)`` patches: one matmul."""

    def __init__(self, config: Qwen3VLModelConfig) -> None:
        super().__init__()
        vc = config.vision
        kernel = (vc.temporal_patch_size, vc.patch_size, vc.patch_size)
        self.embed_dim = vc.embed_dim
        self.proj = nn.Conv3d(vc.in_channels, vc.embed_dim, kernel, stride=kernel, bias=True)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:  # [P, C*t*p*p] -> [P, E]
        weight = self.proj.weight.view(self.embed_dim, -1)
        return F.linear(patches.to(weight.dtype), weight, self.proj.bias)


class Qwen3VisionMlp(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, hidden_act: str) -> None:
        super().__init__()
        self.linear_fc1 = nn.Linear(dim, hidden_dim)
        self.act = nn.GELU(approximate="tanh" if hidden_act == "gelu_pytorch_tanh" else "none")
        self.linear_fc2 = nn.Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3VisionBlock(nn.Module):
    """Pre-norm block: LayerNorm (eps 1e-6), attention within each image, GELU MLP."""

    def __init__(self, config: Qwen3VLModelConfig) -> None:
        super().__init__()
        vc = config.vision
        self.norm1 = nn.LayerNorm(vc.embed_dim, eps=1e-6)
        self.norm2 = nn.LayerNorm(vc.embed_dim, eps=1e-6)
        self.attn = VisionAttention(vc.embed_dim, vc.num_heads)
        self.mlp = Qwen3VisionMlp(vc.embed_dim, vc.mlp_hidden_dim, vc.hidden_act)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spans: Sequence[int]
    ) -> torch.Tensor:  # [P, E] -> [P, E]
        x = x + self.attn(self.norm1(x), cos, sin, spans)
        return x + self.mlp(self.norm2(x))


class Qwen3PatchMerger(nn.Module):
    """Each group of ``merge ** 2`` neighbouring patches -> one text-width feature. The main
    merger normalises each patch first; a DeepStack merger (``postshuffle``) the group."""

    def __init__(self, config: Qwen3VLModelConfig, postshuffle: bool) -> None:
        super().__init__()
        vc = config.vision
        self.hidden = vc.embed_dim * vc.spatial_merge_size**2
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.hidden if postshuffle else vc.embed_dim, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.hidden, self.hidden)
        self.act = nn.GELU()
        self.linear_fc2 = nn.Linear(self.hidden, vc.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [P, E] -> [P / merge^2, H]
        if self.postshuffle:
            x = self.norm(x.view(-1, self.hidden))
        else:
            x = self.norm(x).view(-1, self.hidden)
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3VLVision(nn.Module):
    """Flattened patches of N images -> ``sum(t*h*w) / merge^2`` rows of
    ``[embedding | DeepStack level 0 | ...]`` (``config.image_row_size``), images in order."""

    def __init__(self, config: Qwen3VLModelConfig) -> None:
        super().__init__()
        self.config = config
        vc = config.vision
        self.patch_embed = Qwen3PatchEmbed(config)
        self.pos_embed = nn.Embedding(vc.num_position_embeddings, vc.embed_dim)
        self.blocks = nn.ModuleList(Qwen3VisionBlock(config) for _ in range(vc.depth))
        self.merger = Qwen3PatchMerger(config, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList(
            Qwen3PatchMerger(config, postshuffle=True) for _ in vc.deepstack_indexes
        )

    def num_tokens(self, grid: Grid) -> int:
        t, h, w = grid
        return t * h * w // self.config.merge_unit

    def position_embeddings(self, grids: Sequence[Grid]) -> torch.Tensor:  # [P, E]
        """The learned grid resampled to each image's ``h x w`` patches (bilinear, corners
        aligned; transformers' ``fast_pos_embed_interpolate``), in merge-group order."""
        vc = self.config.vision
        side, merge = vc.position_grid_side, vc.spatial_merge_size
        weight = self.pos_embed.weight
        parts = []
        for t, h, w in grids:
            rows = torch.linspace(0, side - 1, h)  # float32 on the host, as transformers
            cols = torch.linspace(0, side - 1, w)
            row0, col0 = rows.int(), cols.int()
            row1, col1 = (row0 + 1).clip(max=side - 1), (col0 + 1).clip(max=side - 1)
            dr, dc = (rows - row0)[:, None], (cols - col0)[None, :]  # [h, 1], [1, w]
            index = torch.stack(
                [
                    row0[:, None] * side + col0[None, :],
                    row0[:, None] * side + col1[None, :],
                    row1[:, None] * side + col0[None, :],
                    row1[:, None] * side + col1[None, :],
                ]
            ).flatten(1)  # [4, h*w]
            mix = [(1 - dr) * (1 - dc), (1 - dr) * dc, dr * (1 - dc), dr * dc]
            weights = torch.stack(mix).flatten(1)  # [4, h*w]
            corners = self.pos_embed(index.long().to(weight.device))  # [4, h*w, E]
            corners = corners * weights.to(weight.device, weight.dtype)[:, :, None]
            embed = corners[0] + corners[1] + corners[2] + corners[3]  # [h*w, E]
            grouped = embed.repeat(t, 1).view(t, h // merge, merge, w // merge, merge, -1)
            parts.append(grouped.permute(0, 1, 3, 2, 4, 5).flatten(0, 4))
        return torch.cat(parts)

    def encode_images(self, pixels: list[torch.Tensor]) -> list[torch.Tensor]:
        """One ``[h, w, C*t*p*p]`` patch grid per image -> one
        ``[h * w / merge^2, image_row_size]`` each; the images run as one batch."""
        grids = [(1, int(p.shape[0]), int(p.shape[1])) for p in pixels]
        rows = self(torch.cat([p.flatten(0, 1) for p in pixels]), grids)
        return list(rows.split([self.num_tokens(grid) for grid in grids]))

    def tokens_of(self, pixels: torch.Tensor) -> int:
        return self.num_tokens((1, int(pixels.shape[0]), int(pixels.shape[1])))

    def probe_pixels(self, height: int = 512, width: int = 512) -> torch.Tensor:
        """An image's patch grid as ``encode_images`` takes it, for timing."""
        vc = self.config.vision
        return torch.zeros(height // vc.patch_size, width // vc.patch_size, vc.patch_dim)

    def forward(
        self, patches: torch.Tensor, grids: Sequence[Grid]
    ) -> torch.Tensor:  # [P, C*t*p*p] -> [P / merge^2, (1 + levels) * H]
        expected = sum(t * h * w for t, h, w in grids)
        if patches.shape[0] != expected:
            raise ValueError(f"{patches.shape[0]} patches for grids totalling {expected}")
        device = self.pos_embed.weight.device
        hidden = self.patch_embed(patches.to(device)) + self.position_embeddings(grids)
        vc = self.config.vision
        cos, sin = vision_rotary(vc.head_dim, vc.spatial_merge_size, grids, device)
        spans = [h * w for t, h, w in grids for _ in range(t)]  # one span per frame
        levels: list[torch.Tensor] = []
        for index, block in enumerate(self.blocks):
            hidden = block(hidden, cos, sin, spans)
            if index in vc.deepstack_indexes:
                merger = self.deepstack_merger_list[vc.deepstack_indexes.index(index)]
                levels.append(merger(hidden))  # [P / merge^2, H]
        return torch.cat([self.merger(hidden), *levels], dim=-1)
