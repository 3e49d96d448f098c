"""Gemma 3's E stage: the SigLIP ViT and the projector that pools its patches into tokens.

Each image is one square ``[C, S, S]`` (the processor resizes every image to
``image_size``); the ViT's ``(S / patch) ** 2`` patch states are average-pooled to
``mm_tokens_per_image`` (a square grid), RMS-normalised (Gemma's ``1 + weight``) and
projected to the text width. Parameter names mirror the hub's ``vision_tower.*`` and
``multi_modal_projector.*`` (``vision_model.layers`` for its ``encoder.layers``), with our
fused ``qkv_proj``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from epd_engine.model.gemma3_config import Gemma3ModelConfig, SiglipConfig
from epd_engine.model.gemma3_norm import GemmaRMSNorm
from epd_engine.model.layers import ClipEncoderLayer


class SiglipEmbeddings(nn.Module):
    """Patchify with a stride-``patch`` conv (with bias), add learned positions (no CLS)."""

    def __init__(self, vc: SiglipConfig) -> None:
        super().__init__()
        self.patch_embedding = nn.Conv2d(
            vc.num_channels, vc.hidden_size, kernel_size=vc.patch_size, stride=vc.patch_size
        )
        self.position_embedding = nn.Embedding(vc.patches_per_side**2, vc.hidden_size)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, C, S, S] -> [N, P, Hv]
        weight = self.patch_embedding.weight
        patches = self.patch_embedding(pixels.to(weight.dtype)).flatten(2).transpose(1, 2)
        return patches + self.position_embedding.weight


class SiglipVisionModel(nn.Module):
    def __init__(self, vc: SiglipConfig) -> None:
        super().__init__()
        self.embeddings = SiglipEmbeddings(vc)
        self.layers = nn.ModuleList(
            ClipEncoderLayer(
                vc.hidden_size,
                vc.intermediate_size,
                vc.num_heads,
                vc.layer_norm_eps,
                vc.hidden_act,
            )
            for _ in range(vc.num_layers)
        )
        self.post_layernorm = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:  # [N, C, S, S] -> [N, P, Hv]
        hidden = self.embeddings(pixels)
        for layer in self.layers:
            hidden = layer(hidden)
        return self.post_layernorm(hidden)


class Gemma3Projector(nn.Module):
    """Average-pool the patch grid to the token grid, RMSNorm, project (a bare matrix)."""

    def __init__(self, config: Gemma3ModelConfig) -> None:
        super().__init__()
        vc = config.vision
        self.patches_per_side = vc.patches_per_side
        self.kernel = vc.patches_per_side // int(config.num_image_tokens**0.5)
        self.mm_soft_emb_norm = GemmaRMSNorm(vc.hidden_size, vc.layer_norm_eps)
        self.mm_input_projection_weight = nn.Parameter(
            torch.zeros(vc.hidden_size, config.hidden_size)
        )

    def forward(self, states: torch.Tensor) -> torch.Tensor:  # [N, P, Hv] -> [N, tokens, H]
        n, _, hidden = states.shape
        side = self.patches_per_side
        grid = states.transpose(1, 2).reshape(n, hidden, side, side)
        pooled = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)
        return torch.matmul(self.mm_soft_emb_norm(pooled), self.mm_input_projection_weight)


class Gemma3Vision(nn.Module):
    """Images ``[N, C, S, S]`` -> ``[N, mm_tokens_per_image, H]`` embeddings."""

    def __init__(self, config: Gemma3ModelConfig) -> None:
        super().__init__()
        self.config = config
        self.vision_model = SiglipVisionModel(config.vision)
        self.multi_modal_projector = Gemma3Projector(config)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        weight = self.vision_model.embeddings.patch_embedding.weight
        states = self.vision_model(pixels.to(weight.device))
        return self.multi_modal_projector(states)

    def encode_images(self, pixels: list[torch.Tensor]) -> list[torch.Tensor]:
        """One ``[C, S, S]`` per image (the processor's ``pixel_values`` rows) -> one
        ``[mm_tokens_per_image, H]`` each; the images run as one batch."""
        return list(self(torch.stack(pixels)).unbind(0))

    def tokens_of(self, pixels: torch.Tensor) -> int:
        return self.config.num_image_tokens

    def probe_pixels(self, height: int = 0, width: int = 0) -> torch.Tensor:
        """An image as ``encode_images`` takes it, for timing (every size is resized)."""
        vc = self.config.vision
        return torch.zeros(vc.num_channels, vc.image_size, vc.image_size)
