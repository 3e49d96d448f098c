"""Qwen3-VL (dense) split into the two parts that run on different instances.

``Qwen3VLVision`` (the E stage, ``qwen3_vl_vision.py``) makes each image token's embedding
and DeepStack features; ``Qwen3VLLanguage`` (P and D) is a Qwen3 decoder (no qkv bias,
RMSNorm on each head's q and k before the rotary) with interleaved M-RoPE on
``Qwen2VLLanguage``'s paged cache, decode buffers and rotary tables, which adds the DeepStack
features to the image tokens' hidden states after each of its first layers.
Parameter names mirror the hub's ``model.language_model.*`` minus that prefix, with our
fused ``qkv_proj`` / ``gate_up_proj``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from epd_engine.model.attention import AttentionBackend, AttentionMetadata
from epd_engine.model.deepstack import DeepStackRows
from epd_engine.model.layers import RMSNorm, SwiGLUMLP, apply_rope
from epd_engine.model.llava import LayerWritten
from epd_engine.model.mrope import mrope_cos_sin
from epd_engine.model.qwen2_vl import Qwen2VLLanguage
from epd_engine.model.qwen3_vl_config import Qwen3VLModelConfig
from epd_engine.model.qwen3_vl_vision import Qwen3VLVision

__all__ = ["Qwen3VLLanguage", "Qwen3VLVision"]


class Qwen3Attention(nn.Module):
    def __init__(self, config: Qwen3VLModelConfig, attention: AttentionBackend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.attention = attention

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        cos: torch.Tensor,  # [T, D]
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))  # [T, Hq, D]
        k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim))  # [T, Hkv, D]
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.attention.forward(q, k, v, kv_cache, meta, self.head_dim**-0.5)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class Qwen3DecoderLayer(nn.Module):
    def __init__(self, config: Qwen3VLModelConfig, attention: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Qwen3Attention(config, attention)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, H]
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Qwen3VLLanguage(Qwen2VLLanguage):
    """Qwen3 decoder + LM head; ``forward`` also takes the step's DeepStack features."""

    config: Qwen3VLModelConfig

    def _make_layer(self, config: Any, attention: AttentionBackend) -> nn.Module:
        return Qwen3DecoderLayer(config, attention)

    def forward(
        self,
        inputs_embeds: torch.Tensor,  # [T, H]
        positions: torch.Tensor,  # [3, T] (t, h, w) or [T] int64: rotary positions, not slots
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        layer_written: LayerWritten | None = None,
        deepstack: DeepStackRows | None = None,  # None: no image token in this step
    ) -> torch.Tensor:  # [T, H], final norm applied
        hidden = inputs_embeds.to(self.embed_tokens.weight.dtype)
        cos, sin = mrope_cos_sin(positions.to(hidden.device), self._tables(hidden.device),
                                 hidden.dtype)  # fmt: skip
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            hidden = layer(hidden, cos, sin, kv_cache, meta)
            if deepstack is not None and index < self.config.num_deepstack_levels:
                hidden = deepstack.add_level(hidden, index)
            if layer_written is not None:
                layer_written(index)
        return self.norm(hidden)
