"""Building blocks shared by the LLaVA vision tower and language model.

Numerics follow ``transformers`` (LLaMA / CLIP) so logits match it to float rounding.
Projections that read the same input are fused (``qkv_proj``, ``gate_up_proj``): one GEMM
instead of three or two; the loader concatenates the hub's separate tensors into them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LLaMA RMSNorm: normalise in float32, scale in the input dtype."""
    input_dtype = x.dtype
    x32 = x.float()
    variance = x32.pow(2).mean(-1, keepdim=True)
    x32 = x32 * torch.rsqrt(variance + eps)
    return weight * x32.to(input_dtype)


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        return rms_norm(x, self.weight, self.eps)


def rope_cos_sin(
    positions: torch.Tensor,  # [T] int64
    head_dim: int,
    rope_theta: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """LLaMA rotary tables for these positions: ``(cos, sin)``, each ``[T, head_dim]``.

    Computed in float32 (as transformers does) and then cast, once per forward for all layers.
    """
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float()
    inv_freq = 1.0 / (rope_theta ** (exponents / head_dim))  # [D/2]
    freqs = torch.outer(positions.float(), inv_freq)  # [T, D/2]
    angles = torch.cat((freqs, freqs), dim=-1)  # [T, D]
    return angles.cos().to(dtype), angles.sin().to(dtype)


def apply_rope(
    x: torch.Tensor,  # [T, heads, D]
    cos: torch.Tensor,  # [T, D]
    sin: torch.Tensor,  # [T, D]
) -> torch.Tensor:
    """Rotate-half RoPE (the non-interleaved layout of HF LLaMA checkpoints)."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos[:, None, :] + rotated * sin[:, None, :]


class SwiGLUMLP(nn.Module):
    """LLaMA MLP: ``down(silu(gate(x)) * up(x))`` with gate and up fused."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [T, H] -> [T, H]
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)  # [T, I] each
        return self.down_proj(F.silu(gate) * up)


def activation(name: str) -> nn.Module:
    """The activations of our ViTs: CLIP's ``quick_gelu``, LLaVA's projector's exact ``gelu``
    and SigLIP's ``gelu_pytorch_tanh``."""
    if name == "quick_gelu":
        return QuickGELU()
    if name == "gelu":
        return nn.GELU()
    if name == "gelu_pytorch_tanh":
        return nn.GELU(approximate="tanh")
    raise ValueError(f"unsupported activation {name!r}")


class QuickGELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class ClipVisionEmbeddings(nn.Module):
    """Patchify with a stride-``patch`` conv, prepend CLS, add learned positions."""

    def __init__(self, num_channels: int, hidden_size: int, image_size: int, patch_size: int):
        super().__init__()
        num_positions = (image_size // patch_size) ** 2 + 1
        self.class_embedding = nn.Parameter(torch.zeros(hidden_size))
        self.patch_embedding = nn.Conv2d(
            num_channels, hidden_size, kernel_size=patch_size, stride=patch_size, bias=False
        )
        self.position_embedding = nn.Embedding(num_positions, hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [N, C, S, S] -> [N, P+1, Hv]
        patches = self.patch_embedding(pixel_values)  # [N, Hv, S/p, S/p]
        patches = patches.flatten(2).transpose(1, 2)  # [N, P, Hv]
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)  # [N, 1, Hv]
        return torch.cat((cls, patches), dim=1) + self.position_embedding.weight  # [N, P+1, Hv]


class ClipAttention(nn.Module):
    """Bidirectional multi-head self-attention with biases (no cache: images are one shot)."""

    def __init__(self, hidden_size: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = hidden_size // num_heads
        self.qkv_proj = nn.Linear(hidden_size, 3 * hidden_size, bias=True)
        self.out_proj = nn.Linear(hidden_size, hidden_size, bias=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, L, Hv] -> [N, L, Hv]
        n, length, hidden = x.shape
        qkv = self.qkv_proj(x).view(n, length, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # [N, heads, L, D] each
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)
        return self.out_proj(out.transpose(1, 2).reshape(n, length, hidden))


class ClipMLP(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, hidden_act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(hidden_size, intermediate_size)
        self.act = activation(hidden_act)
        self.fc2 = nn.Linear(intermediate_size, hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class ClipEncoderLayer(nn.Module):
    """Pre-LN transformer block of the CLIP ViT."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, num_heads: int, eps: float, act: str
    ) -> None:
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(hidden_size, eps=eps)
        self.self_attn = ClipAttention(hidden_size, num_heads)
        self.layer_norm2 = nn.LayerNorm(hidden_size, eps=eps)
        self.mlp = ClipMLP(hidden_size, intermediate_size, act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, L, Hv] -> [N, L, Hv]
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))
