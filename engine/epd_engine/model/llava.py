"""LLaVA-1.5 split into the two parts that run on different instances.

``LlavaVision`` (the E stage) turns images into embeddings the size of text embeddings;
``LlavaLanguage`` (P and D) is a LLaMA decoder over a flat, ragged batch of tokens with a
paged KV cache behind an injected ``AttentionBackend``. Parameter names mirror the hub's
(minus prefixes, with fused ``qkv_proj`` / ``gate_up_proj``) so the loader maps them 1:1.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from epd_engine.model.attention import AttentionBackend, AttentionBatch, AttentionMetadata
from epd_engine.model.attention_torch import TorchPagedAttention
from epd_engine.model.input_buffers import DecodeBuffers, DecodeFill
from epd_engine.model.layer_ops import LayerOps, layer_ops_for
from epd_engine.model.layers import (
    ClipEncoderLayer,
    ClipVisionEmbeddings,
    RMSNorm,
    SwiGLUMLP,
    activation,
)
from epd_engine.model.model_config import LlavaModelConfig
from epd_engine.transfer.memory import CacheMemory, PrivateMemory

LayerWritten = Callable[[int], None]  # called with a layer's index once its KV is written


class ClipVisionModel(nn.Module):
    """CLIP ViT truncated after the layer LLaVA reads (``vision_feature_layer``)."""

    def __init__(self, config: LlavaModelConfig) -> None:
        super().__init__()
        vc = config.vision
        self.embeddings = ClipVisionEmbeddings(
            vc.num_channels, vc.hidden_size, vc.image_size, vc.patch_size
        )
        self.pre_layrnorm = nn.LayerNorm(vc.hidden_size, eps=vc.layer_norm_eps)  # hub spelling
        self.layers = nn.ModuleList(
            ClipEncoderLayer(
                vc.hidden_size, vc.intermediate_size, vc.num_heads, vc.layer_norm_eps, vc.hidden_act
            )
            for _ in range(vc.num_layers_used)
        )

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [N, C, S, S] -> [N, P+1, Hv]
        hidden = self.pre_layrnorm(self.embeddings(pixel_values))
        for layer in self.layers:
            hidden = layer(hidden)
        return hidden


class LlavaProjector(nn.Module):
    """Two linears with GELU between: vision width -> text width."""

    def __init__(self, config: LlavaModelConfig) -> None:
        super().__init__()
        bias = config.projector_bias
        self.linear_1 = nn.Linear(config.vision.hidden_size, config.hidden_size, bias=bias)
        self.act = activation(config.projector_hidden_act)
        self.linear_2 = nn.Linear(config.hidden_size, config.hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [N, P, Hv] -> [N, P, H]
        return self.linear_2(self.act(self.linear_1(x)))


class LlavaVision(nn.Module):
    """Images -> ``num_image_tokens`` embeddings each, ready to replace ``<image>`` tokens."""

    def __init__(self, config: LlavaModelConfig) -> None:
        super().__init__()
        self.config = config
        self.vision_model = ClipVisionModel(config)
        self.multi_modal_projector = LlavaProjector(config)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:  # [N, 3, S, S] -> [N, I, H]
        weight = self.multi_modal_projector.linear_1.weight
        features = self.vision_model(pixel_values.to(weight.device, weight.dtype))  # [N, P+1, Hv]
        if not self.config.vision.keep_cls:
            features = features[:, 1:]  # [N, P, Hv]: "default" strategy drops CLS
        return self.multi_modal_projector(features)

    def encode_images(self, pixels: list[torch.Tensor]) -> list[torch.Tensor]:
        """One ``[3, S, S]`` per image -> one ``[num_image_tokens, H]`` each (one batch)."""
        return list(self(torch.stack(pixels)))

    def tokens_of(self, pixels: torch.Tensor) -> int:
        """Embeddings ``encode_images`` makes of this image's pixels."""
        return self.config.num_image_tokens

    def probe_pixels(self) -> torch.Tensor:
        """An image's pixels as ``encode_images`` takes them, for timing (LLaVA: one size)."""
        size = self.config.image_size
        return torch.zeros(3, size, size)


class LlamaAttention(nn.Module):
    def __init__(
        self, config: LlavaModelConfig, attention: AttentionBackend, ops: LayerOps
    ) -> None:
        super().__init__()
        self.ops = ops
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=False)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.attention = attention

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        rope: Any,  # LayerOps.rope_state of this forward's positions
        kv_cache: torch.Tensor,  # [num_blocks, 2, block_size, Hkv, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:  # [T, H]
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q, k = self.ops.rope(q, k, rope, self.head_dim)  # [T, Hq, D], [T, Hkv, D]
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)  # [T, Hkv, D]
        out = self.attention.forward(q, k, v, kv_cache, meta, self.head_dim**-0.5)  # [T, Hq, D]
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: LlavaModelConfig, attention: AttentionBackend, ops: LayerOps):
        super().__init__()
        self.ops = ops
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, attention, ops)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        hidden: torch.Tensor,  # [T, H]: the previous layer's MLP output (or the embeddings)
        residual: torch.Tensor | None,  # [T, H]: the stream before it; None in layer 0
        rope: Any,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:  # (this MLP's output, the stream before it)
        ops, norm1, norm2 = self.ops, self.input_layernorm, self.post_attention_layernorm
        if residual is None:
            residual, x = hidden, ops.rms_norm(hidden, norm1.weight, norm1.eps)
        else:
            x, residual = ops.add_rms_norm(hidden, residual, norm1.weight, norm1.eps)
        attended = self.self_attn(x, rope, kv_cache, meta)
        x, residual = ops.add_rms_norm(attended, residual, norm2.weight, norm2.eps)
        return self.mlp.down_proj(ops.silu_mul(self.mlp.gate_up_proj(x))), residual


class LlavaLanguage(nn.Module):
    """LLaMA decoder + LM head over a flat batch of tokens (prefill chunks and decodes mixed)."""

    def __init__(self, config: LlavaModelConfig, attention: AttentionBackend | None = None):
        super().__init__()
        self.config = config
        self.attention: AttentionBackend = attention or TorchPagedAttention()
        self.ops = layer_ops_for(
            self.attention, config.max_position_embeddings, config.head_dim, config.rope_theta
        )
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, self.attention, self.ops) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

    def prepare(self, batch: AttentionBatch) -> AttentionMetadata:
        """Once per step: the attention metadata every layer of ``forward`` reads."""
        return self.attention.prepare(batch, self.embed_tokens.weight.device)

    def decode_buffers(self, max_seqs: int, max_pages: int, block_size: int) -> DecodeBuffers:
        """Persistent decode inputs on this model's device (allocated once, by the runner)."""
        return DecodeBuffers(max_seqs, max_pages, block_size, self.embed_tokens.weight.device)

    def prepare_decode(self, buffers: DecodeBuffers, fill: DecodeFill) -> AttentionMetadata:
        """``prepare`` for a decode-only step filled into ``buffers``."""
        return self.attention.prepare_decode(buffers, fill)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, H]
        return self.embed_tokens(input_ids.to(self.embed_tokens.weight.device))

    def forward(
        self,
        inputs_embeds: torch.Tensor,  # [T, H]
        positions: torch.Tensor,  # [T] int64 absolute positions
        kv_caches: list[torch.Tensor],  # per layer [num_blocks, 2, block_size, Hkv, D]
        meta: AttentionMetadata,
        layer_written: LayerWritten | None = None,
    ) -> torch.Tensor:  # [T, H], final norm applied
        """``layer_written(i)`` runs once layer ``i`` has written this batch's KV, so a
        migration can move that layer while the next ones compute. (On a GPU the KV is
        written when the kernel ends, not when the call returns: a GPU caller records an
        event here and waits on it before copying.)"""
        hidden = inputs_embeds.to(self.embed_tokens.weight.dtype)
        if self.ops.in_place:
            hidden = hidden.clone()  # the residual stream is updated in place: not the caller's
        config, ops = self.config, self.ops
        rope = ops.rope_state(positions.to(hidden.device), config.head_dim, config.rope_theta,
                              hidden.dtype)  # fmt: skip
        residual: torch.Tensor | None = None
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            hidden, residual = layer(hidden, residual, rope, kv_cache, meta)
            if layer_written is not None:
                layer_written(index)
        if residual is None:  # no layers
            return ops.rms_norm(hidden, self.norm.weight, self.norm.eps)
        return ops.add_rms_norm(hidden, residual, self.norm.weight, self.norm.eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:  # [S, H] -> [S, V] float32
        return self.lm_head(hidden).float()

    def allocate_kv_cache(
        self, num_blocks: int, block_size: int, memory: CacheMemory | None = None
    ) -> list[torch.Tensor]:
        """Zeroed paged caches, one ``[num_blocks, 2, block_size, Hkv, D]`` per layer, in
        ``memory`` (shared with peers for the shm backend) or private device memory."""
        weight = self.embed_tokens.weight
        memory = memory or PrivateMemory(weight.device)
        shape = (num_blocks, 2, block_size, self.config.num_kv_heads, self.config.head_dim)
        return [memory.zeros(f"kv.{i}", shape, weight.dtype) for i in range(self.config.num_layers)]


def scatter_image_embeddings(
    inputs_embeds: torch.Tensor,  # [T, H]
    input_ids: torch.Tensor,  # [T]
    image_embeds: torch.Tensor,  # [num_image_token_rows, H], images in prompt order
    image_token_index: int,
) -> torch.Tensor:
    """Replace the ``<image>`` placeholder rows with image embeddings, in order."""
    mask = input_ids.to(inputs_embeds.device) == image_token_index  # [T]
    num_placeholders = int(mask.sum())
    if num_placeholders != image_embeds.shape[0]:
        raise ValueError(
            f"{num_placeholders} image placeholder tokens but {image_embeds.shape[0]} "
            "image embedding rows"
        )
    merged = inputs_embeds.clone()
    merged[mask] = image_embeds.to(merged.dtype)
    return merged
