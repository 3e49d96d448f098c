"""Qwen2-VL split into the two parts that run on different instances.

``Qwen2VLVision`` (the E stage) turns an image's flattened patches into one embedding per
merged 2x2 patch group; ``Qwen2VLLanguage`` (P and D) is a Qwen2 decoder (qkv bias,
multimodal RoPE) over a flat ragged batch with the paged KV cache of ``LlavaLanguage``.
Parameter names mirror the hub checkpoint (``visual.*``, ``model.*``) minus prefixes, with
our fused ``qkv_proj`` / ``gate_up_proj`` in the decoder.

Qwen2.5-VL (``vision.windowed``) shares it all but the ViT's details: RMSNorm and SwiGLU
blocks, an RMSNorm merger, and window attention (``window_order``) in all blocks but a few.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from epd_engine.model.attention import AttentionBackend, AttentionBatch, AttentionMetadata
from epd_engine.model.attention_torch import TorchPagedAttention
from epd_engine.model.input_buffers import DecodeBuffers, DecodeFill
from epd_engine.model.layers import RMSNorm, SwiGLUMLP, activation, apply_rope
from epd_engine.model.llava import LayerWritten
from epd_engine.model.mrope import Grid, MRopeTables, mrope_cos_sin
from epd_engine.model.qwen2_vl_config import Qwen2VLModelConfig
from epd_engine.model.qwen3_vl_config import Qwen3VLModelConfig
from epd_engine.transfer.memory import CacheMemory, PrivateMemory


class PatchEmbed(nn.Module):
    """A stride-equal-kernel Conv3d over ``(t, p, p)`` patches: one matmul on flat patches."""

    def __init__(self, config: Qwen2VLModelConfig) -> None:
        super().__init__()
        vc = config.vision
        kernel = (vc.temporal_patch_size, vc.patch_size, vc.patch_size)
        self.embed_dim = vc.embed_dim
        self.proj = nn.Conv3d(vc.in_channels, vc.embed_dim, kernel, stride=kernel, bias=False)

    def forward(self, patches: torch.Tensor) -> torch.Tensor:  # [P, C*t*p*p] -> [P, E]
        weight = self.proj.weight.view(self.embed_dim, -1)
        return F.linear(patches.to(weight.dtype), weight)


class VisionAttention(nn.Module):
    """Bidirectional attention within each image, 2-D rotary on q and k (in float32)."""

    def __init__(self, dim: int, num_heads: int) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.head_dim = dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)

    def forward(
        self,
        x: torch.Tensor,  # [P, E]
        cos: torch.Tensor,  # [P, Dv] float32
        sin: torch.Tensor,
        spans: Sequence[int],  # patches of each image, in order (attention stays inside one)
    ) -> torch.Tensor:  # [P, E]
        num_patches = x.shape[0]
        q, k, v = self.qkv(x).view(num_patches, 3, self.num_heads, self.head_dim).unbind(1)
        q = apply_rope(q.float(), cos, sin).to(x.dtype)  # [P, heads, Dv]
        k = apply_rope(k.float(), cos, sin).to(x.dtype)
        outs = []
        for q_i, k_i, v_i in zip(q.split(spans), k.split(spans), v.split(spans), strict=True):
            out = F.scaled_dot_product_attention(
                q_i.transpose(0, 1)[None],  # [1, heads, L, Dv]
                k_i.transpose(0, 1)[None],
                v_i.transpose(0, 1)[None],
                scale=self.head_dim**-0.5,
            )
            outs.append(out[0].transpose(0, 1))  # [L, heads, Dv]
        return self.proj(torch.cat(outs).reshape(num_patches, -1))


class VisionMlp(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, hidden_act: str) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden_dim)
        self.act = activation(hidden_act)
        self.fc2 = nn.Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


class VisionSwiGLU(nn.Module):
    """Qwen2.5-VL's vision MLP: ``down(silu(gate(x)) * up(x))``, all with biases."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden_dim)
        self.up_proj = nn.Linear(dim, hidden_dim)
        self.down_proj = nn.Linear(hidden_dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


def _vision_norm(config: Qwen2VLModelConfig) -> nn.Module:
    """LayerNorm (Qwen2-VL) or RMSNorm (Qwen2.5-VL), eps 1e-6 as transformers hard-codes."""
    dim = config.vision.embed_dim
    return RMSNorm(dim, 1e-6) if config.vision.windowed else nn.LayerNorm(dim, eps=1e-6)


class VisionBlock(nn.Module):
    """Pre-norm block: Qwen2-VL LayerNorm + GELU MLP; Qwen2.5-VL RMSNorm + SwiGLU."""

    def __init__(self, config: Qwen2VLModelConfig) -> None:
        super().__init__()
        vc = config.vision
        self.norm1 = _vision_norm(config)
        self.norm2 = _vision_norm(config)
        self.attn = VisionAttention(vc.embed_dim, vc.num_heads)
        self.mlp: nn.Module = (
            VisionSwiGLU(vc.embed_dim, vc.mlp_hidden_dim)
            if vc.windowed
            else VisionMlp(vc.embed_dim, vc.mlp_hidden_dim, vc.hidden_act)
        )

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, spans: Sequence[int]
    ) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cos, sin, spans)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """LayerNorm, then each group of ``merge ** 2`` neighbouring patches -> one text token."""

    def __init__(self, config: Qwen2VLModelConfig) -> None:
        super().__init__()
        vc = config.vision
        self.hidden = vc.embed_dim * vc.spatial_merge_size**2
        self.ln_q = _vision_norm(config)
        # nn.Sequential with indices 0 and 2, as the hub names them (mlp.0, mlp.2).
        out = vc.out_hidden_size
        self.mlp = nn.Sequential(
            nn.Linear(self.hidden, self.hidden), nn.GELU(), nn.Linear(self.hidden, out)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [P, E] -> [P / merge^2, H]
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


def vision_rotary_positions(grids: Sequence[Grid], merge: int) -> torch.Tensor:
    """``[P, 2]`` (row, column) of every patch, in the processor's merge-group order."""
    rows = []
    for t, h, w in grids:
        hpos = torch.arange(h).unsqueeze(1).expand(-1, w)
        wpos = torch.arange(w).unsqueeze(0).expand(h, -1)
        pair = torch.stack([hpos, wpos], dim=-1)  # [h, w, 2]
        grouped = pair.reshape(h // merge, merge, w // merge, merge, 2).permute(0, 2, 1, 3, 4)
        rows.append(grouped.reshape(-1, 2).repeat(t, 1))
    return torch.cat(rows)


def vision_rotary(
    head_dim: int, merge: int, grids: Sequence[Grid], device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D rotary tables ``[P, Dv]`` (float32): half the pairs rotate by row, half by column
    (Qwen2-VL, Qwen2.5-VL and Qwen3-VL alike)."""
    dim = head_dim // 2
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    pos = vision_rotary_positions(grids, merge)  # [P, 2]
    freqs = (pos.float()[:, :, None] * inv_freq).flatten(1)  # [P, Dv/2]
    angles = torch.cat((freqs, freqs), dim=-1).to(device)  # [P, Dv]
    return angles.cos(), angles.sin()


def _regroup(x: torch.Tensor, order: torch.Tensor, unit: int) -> torch.Tensor:
    """Rows of ``x`` ``[P, ...]`` in merge groups of ``unit``, groups taken in ``order``."""
    return x.view(x.shape[0] // unit, unit, -1)[order].flatten(0, 1)


def window_order(grids: Sequence[Grid], window: int, merge: int) -> tuple[torch.Tensor, list[int]]:
    """Qwen2.5-VL's windows (transformers' ``get_window_index``): the merge groups of every
    frame, window after window (``window`` x ``window`` groups, the last ones cut at the
    edge), and each window's length in patches. Returns ``(group order, window spans)``."""
    order, spans = [], []
    first = 0
    for t, h, w in grids:
        gh, gw = h // merge, w // merge
        for frame in range(t):
            base = first + frame * gh * gw
            for top in range(0, gh, window):
                for left in range(0, gw, window):
                    rows = torch.arange(top, min(top + window, gh))
                    cols = torch.arange(left, min(left + window, gw))
                    groups = (rows[:, None] * gw + cols[None, :]).flatten() + base
                    order.append(groups)
                    spans.append(groups.numel() * merge * merge)
        first += t * gh * gw
    return torch.cat(order), spans


class Qwen2VLVision(nn.Module):
    """Flattened patches of N images -> ``sum(t*h*w) / merge^2`` embeddings, images in order."""

    def __init__(self, config: Qwen2VLModelConfig) -> None:
        super().__init__()
        self.config = config
        vc = config.vision
        self.patch_embed = PatchEmbed(config)
        self.blocks = nn.ModuleList(VisionBlock(config) for _ in range(vc.depth))
        self.merger = PatchMerger(config)

    def num_tokens(self, grid: Grid) -> int:
        t, h, w = grid
        return t * h * w // self.config.merge_unit

    def rotary(self, grids: Sequence[Grid], device: torch.device) -> tuple[torch.Tensor, ...]:
        vc = self.config.vision
        return vision_rotary(vc.head_dim, vc.spatial_merge_size, grids, device)

    def encode_images(self, pixels: list[torch.Tensor]) -> list[torch.Tensor]:
        """One ``[h, w, C*t*p*p]`` patch grid per image (``processor.py``'s form) -> one
        ``[h * w / merge^2, H]`` each; the images run as one batch."""
        grids = [(1, int(p.shape[0]), int(p.shape[1])) for p in pixels]
        embeds = self(torch.cat([p.flatten(0, 1) for p in pixels]), grids)
        return list(embeds.split([self.num_tokens(grid) for grid in grids]))

    def tokens_of(self, pixels: torch.Tensor) -> int:
        """Embeddings ``encode_images`` makes of this image's ``[h, w, patch]`` grid."""
        return self.num_tokens((1, int(pixels.shape[0]), int(pixels.shape[1])))

    def probe_pixels(self, height: int = 448, width: int = 448) -> torch.Tensor:
        """An image's patch grid as ``encode_images`` takes it, for timing."""
        vc = self.config.vision
        return torch.zeros(height // vc.patch_size, width // vc.patch_size, vc.patch_dim)

    def forward(
        self, patches: torch.Tensor, grids: Sequence[Grid]
    ) -> torch.Tensor:  # [P, C*t*p*p] -> [P / merge^2, H]
        weight = self.patch_embed.proj.weight
        expected = sum(t * h * w for t, h, w in grids)
        if patches.shape[0] != expected:
            raise ValueError(f"{patches.shape[0]} patches for grids totalling {expected}")
        hidden = self.patch_embed(patches.to(weight.device))
        cos, sin = self.rotary(grids, weight.device)
        spans = [h * w for t, h, w in grids for _ in range(t)]  # one span per frame
        vc = self.config.vision
        if not vc.windowed:
            for block in self.blocks:
                hidden = block(hidden, cos, sin, spans)
            return self.merger(hidden)
        # Qwen2.5-VL: reorder merge groups window by window; full-attention blocks still
        # see whole frames (the order within a frame does not matter to them).
        merge = vc.spatial_merge_size
        window = vc.window_size // merge // vc.patch_size  # in merge groups
        order, window_spans = window_order(grids, window, merge)
        order = order.to(hidden.device)
        unit = self.config.merge_unit
        hidden, cos, sin = (_regroup(x, order, unit) for x in (hidden, cos, sin))
        for index, block in enumerate(self.blocks):
            hidden = block(hidden, cos, sin, spans if index in vc.fullatt_blocks else window_spans)
        return self.merger(hidden)[torch.argsort(order)]


class Qwen2Attention(nn.Module):
    def __init__(self, config: Qwen2VLModelConfig, attention: AttentionBackend) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=True)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=False)
        self.attention = attention

    def forward(
        self,
        x: torch.Tensor,  # [T, H]
        cos: torch.Tensor,  # [T, D]
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = apply_rope(q.view(num_tokens, self.num_heads, self.head_dim), cos, sin)
        k = apply_rope(k.view(num_tokens, self.num_kv_heads, self.head_dim), cos, sin)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = self.attention.forward(q, k, v, kv_cache, meta, self.head_dim**-0.5)
        return self.o_proj(out.reshape(num_tokens, self.q_size))


class Qwen2DecoderLayer(nn.Module):
    def __init__(self, config: Qwen2VLModelConfig, attention: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Qwen2Attention(config, attention)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLUMLP(config.hidden_size, config.intermediate_size)

    def forward(
        self,
        hidden: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Qwen2VLLanguage(nn.Module):
    """Qwen2 decoder + LM head; ``forward`` takes M-RoPE positions ``[3, T]`` (or ``[T]``)."""

    def __init__(
        self,
        config: Qwen2VLModelConfig | Qwen3VLModelConfig,
        attention: AttentionBackend | None = None,
    ):
        super().__init__()
        self.config = config
        self.attention: AttentionBackend = attention or TorchPagedAttention()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(
            self._make_layer(config, self.attention) for _ in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        self._rope_tables: MRopeTables | None = None

    def _make_layer(self, config: Any, attention: AttentionBackend) -> nn.Module:
        """One decoder layer (Qwen3-VL's adds q/k norms)."""
        return Qwen2DecoderLayer(config, attention)

    def prepare(self, batch: AttentionBatch) -> AttentionMetadata:
        return self.attention.prepare(batch, self.embed_tokens.weight.device)

    def _tables(self, device: torch.device) -> MRopeTables:
        """Made at the first forward (the module is built on the meta device, where a
        buffer would have no values), then reused."""
        if self._rope_tables is None or self._rope_tables.inv_freq.device != device:
            config = self.config
            self._rope_tables = MRopeTables.build(
                config.head_dim,
                config.rope_theta,
                config.mrope_section,
                device,
                interleaved=getattr(config, "mrope_interleaved", False),
            )
        return self._rope_tables

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
        positions: torch.Tensor,  # [3, T] (t, h, w) or [T] int64: rotary positions, not slots
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        layer_written: LayerWritten | None = None,
    ) -> torch.Tensor:  # [T, H], final norm applied
        hidden = inputs_embeds.to(self.embed_tokens.weight.dtype)
        cos, sin = mrope_cos_sin(positions.to(hidden.device), self._tables(hidden.device),
                                 hidden.dtype)  # fmt: skip
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            hidden = layer(hidden, cos, sin, kv_cache, meta)
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
