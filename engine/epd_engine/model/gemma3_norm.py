"""Gemma's RMSNorm: scale by ``1 + weight``, all in float32, then cast (transformers'
``Gemma3RMSNorm``; LLaMA's casts before scaling, ``layers.rms_norm``)."""

from __future__ import annotations

import torch
from torch import nn


class GemmaRMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (normed * (1.0 + self.weight.float())).type_as(x)
