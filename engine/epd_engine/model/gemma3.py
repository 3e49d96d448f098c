"""Gemma 3 split into the two parts that run on different instances.

``Gemma3Vision`` (the E stage, ``gemma3_vision.py``) turns each image into
``mm_tokens_per_image`` embeddings; ``Gemma3Language`` (P and D) is the Gemma 3 decoder on
the paged KV cache: embeddings scaled by ``sqrt(hidden)``, Gemma's ``1 + weight`` RMSNorm
before *and after* each sublayer, q/k norms per head, a GELU-tanh gated MLP, attention
scaled by ``query_pre_attn_scalar``, and per layer either a sliding window (local rotary
base) or global attention (global base, linear scaling): ``config.layer_windows``.
The LM head is the embedding matrix (tied). Parameter names mirror the hub's
``language_model.model.*`` minus that prefix, with our fused ``qkv_proj`` / ``gate_up_proj``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from epd_engine.model.attention import AttentionBackend, AttentionBatch, AttentionMetadata
from epd_engine.model.attention_torch import TorchPagedAttention
from epd_engine.model.gemma3_config import Gemma3ModelConfig
from epd_engine.model.gemma3_norm import GemmaRMSNorm
from epd_engine.model.gemma3_vision import Gemma3Vision
from epd_engine.model.input_buffers import DecodeBuffers, DecodeFill
from epd_engine.model.layers import apply_rope
from epd_engine.model.llava import LayerWritten
from epd_engine.transfer.memory import CacheMemory, PrivateMemory

__all__ = ["Gemma3Language", "Gemma3Vision", "gemma3_rope"]

Rope = tuple[torch.Tensor, torch.Tensor]  # (cos, sin), each [T, D]


def gemma3_rope(
    positions: torch.Tensor, head_dim: int, theta: float, factor: float, dtype: torch.dtype
) -> Rope:
    """Rotary tables as transformers builds them (float32, inverse frequencies divided by
    the linear scaling ``factor``, then cast)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float()
    inv_freq = 1.0 / (theta ** (exponents / head_dim)) / factor  # [D/2]
    freqs = torch.outer(positions.float(), inv_freq)  # [T, D/2]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


class Gemma3Attention(nn.Module):
    def __init__(
        self, config: Gemma3ModelConfig, attention: AttentionBackend, window: int | None
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.q_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = GemmaRMSNorm(config.head_dim, config.rms_norm_eps)
        self.scale = config.query_pre_attn_scalar**-0.5
        self.window = window  # None: a global layer
        self.attention = attention

    def forward(
        self, x: torch.Tensor, rope: Rope, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:  # [T, H] -> [T, H]
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = self.q_norm(q.reshape(num_tokens, self.num_heads, self.head_dim))
        k = self.k_norm(k.reshape(num_tokens, self.num_kv_heads, self.head_dim))
        cos, sin = rope
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = v.reshape(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.attention.forward(q, k, v, kv_cache, meta, self.scale, window=self.window)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class GeluGatedMLP(nn.Module):
    """``down(gelu_tanh(gate(x)) * up(x))`` with gate and up fused."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(F.gelu(gate, approximate="tanh") * up)


class Gemma3DecoderLayer(nn.Module):
    def __init__(
        self, config: Gemma3ModelConfig, attention: AttentionBackend, window: int | None
    ) -> None:
        super().__init__()
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.is_sliding = window is not None
        self.input_layernorm = GemmaRMSNorm(hidden, eps)
        self.self_attn = Gemma3Attention(config, attention, window)
        self.post_attention_layernorm = GemmaRMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(hidden, eps)
        self.mlp = GeluGatedMLP(hidden, config.intermediate_size)
        self.post_feedforward_layernorm = GemmaRMSNorm(hidden, eps)

    def forward(
        self, hidden: torch.Tensor, rope: Rope, kv_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        attended = self.self_attn(self.input_layernorm(hidden), rope, kv_cache, meta)
        hidden = hidden + self.post_attention_layernorm(attended)
        mlp_out = self.mlp(self.pre_feedforward_layernorm(hidden))
        return hidden + self.post_feedforward_layernorm(mlp_out)


class Gemma3Language(nn.Module):
    """Gemma 3 decoder + tied LM head over a flat batch (prefill chunks and decodes mixed)."""

    def __init__(self, config: Gemma3ModelConfig, attention: AttentionBackend | None = None):
        super().__init__()
        self.config = config
        self.attention: AttentionBackend = attention or TorchPagedAttention()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            Gemma3DecoderLayer(config, self.attention, window) for window in config.layer_windows
        )
        self.norm = GemmaRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def prepare(self, batch: AttentionBatch) -> AttentionMetadata:
        return self.attention.prepare(batch, self.embed_tokens.weight.device)

    def decode_buffers(self, max_seqs: int, max_pages: int, block_size: int) -> DecodeBuffers:
        return DecodeBuffers(max_seqs, max_pages, block_size, self.embed_tokens.weight.device)

    def prepare_decode(self, buffers: DecodeBuffers, fill: DecodeFill) -> AttentionMetadata:
        return self.attention.prepare_decode(buffers, fill)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        """Token embeddings times ``sqrt(hidden)``, the factor rounded to the weights' dtype
        as transformers does (image rows replacing placeholders are not scaled)."""
        weight = self.embed_tokens.weight
        scale = torch.tensor(self.config.hidden_size**0.5).to(weight.dtype)
        return self.embed_tokens(input_ids.to(weight.device)) * scale

    def forward(
        self,
        inputs_embeds: torch.Tensor,  # [T, H]
        positions: torch.Tensor,  # [T] int64 absolute positions
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        layer_written: LayerWritten | None = None,
    ) -> torch.Tensor:  # [T, H], final norm applied
        config = self.config
        hidden = inputs_embeds.to(self.embed_tokens.weight.dtype)
        positions = positions.to(hidden.device)
        global_rope = gemma3_rope(positions, config.head_dim, config.rope_theta,
                                  config.rope_scaling_factor, hidden.dtype)  # fmt: skip
        local_rope = gemma3_rope(positions, config.head_dim, config.rope_local_theta, 1.0,
                                 hidden.dtype)  # fmt: skip
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            rope = local_rope if layer.is_sliding else global_rope
            hidden = layer(hidden, rope, kv_cache, meta)
            if layer_written is not None:
                layer_written(index)
        return self.norm(hidden)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, H] -> [S, V] float32
        return self.lm_head(hidden).float()

    def allocate_kv_cache(
        self, num_blocks: int, block_size: int, memory: CacheMemory | None = None
    ) -> list[torch.Tensor]:
        weight = self.embed_tokens.weight
        memory = memory or PrivateMemory(weight.device)
        shape = (num_blocks, 2, block_size, self.config.num_kv_heads, self.config.head_dim)
        return [memory.zeros(f"kv.{i}", shape, weight.dtype) for i in range(self.config.num_layers)]
