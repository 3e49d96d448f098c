"""A decoder layer's element-wise ops behind one seam: RMSNorm, residual add + RMSNorm,
SwiGLU's ``silu(gate) * up`` and the rotary embedding.

``TorchLayerOps`` is plain torch, the CPU path and the numerics the ``transformers`` parity
tests check. ``FlashInferLayerOps`` runs each op as one FlashInfer kernel (in place where
FlashInfer works in place): written as torch ops, a LLaMA layer launches about 36 kernels,
most of them tiny, and at batch 1 a 7B decode step spends as long launching them as reading
its weights (bench-gpu on an H200: 6.7 ms per step with CUDA graphs against a 3.2 ms HBM
floor). It is picked with the FlashInfer attention backend.

The layer keeps its residual stream apart from the normalised activations (vLLM's shape),
so that "add the sublayer's output to the residual, then normalise" is one op; in torch it
is the same two steps as before, bit for bit.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
import torch.nn.functional as F

from epd_engine.model.layers import apply_rope, rms_norm, rope_cos_sin


class LayerOps(Protocol):
    in_place: bool  # the ops write into their inputs (the model then copies its input first)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor: ...

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``residual + x`` and its RMSNorm: ``(normalised, new residual)``."""
        ...

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """``[T, 2I]`` (gate then up) -> ``[T, I]``."""
        ...

    def rope_state(self, positions: torch.Tensor, head_dim: int, theta: float,
                   dtype: torch.dtype) -> Any:  # fmt: skip
        """Once per forward: what ``rope`` needs for these positions."""
        ...

    def rope(
        self, q: torch.Tensor, k: torch.Tensor, state: Any, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``q`` ``[T, Hq*D]`` and ``k`` ``[T, Hkv*D]`` (views of the fused projection) ->
        rotated ``[T, Hq, D]`` and ``[T, Hkv, D]``."""
        ...


class TorchLayerOps:
    in_place = False

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return rms_norm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        residual = residual + x
        return rms_norm(residual, weight, eps), residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rope_state(self, positions: torch.Tensor, head_dim: int, theta: float,
                   dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
        return rope_cos_sin(positions, head_dim, theta, dtype)

    def rope(
        self, q: torch.Tensor, k: torch.Tensor, state: Any, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = state
        tokens = q.shape[0]
        return (
            apply_rope(q.view(tokens, -1, head_dim), cos, sin),
            apply_rope(k.view(tokens, -1, head_dim), cos, sin),
        )


class FlashInferLayerOps:
    """One FlashInfer kernel per op (needs CUDA, float16/bfloat16; FlashInfer compiles each
    on first use). The rotary table covers ``max_positions`` and is built once."""

    in_place = True

    def __init__(
        self, max_positions: int, head_dim: int, theta: float, device: torch.device
    ) -> None:
        import flashinfer

        self._fi = flashinfer
        # [max_positions, D] float32, cos then sin of the D/2 angles (FlashInfer's layout;
        # rotate-half repeats each angle in both halves, so one half of each table is all)
        table = torch.arange(max_positions, device=device)
        cos, sin = rope_cos_sin(table, head_dim, theta, torch.float32)
        half = head_dim // 2
        self._cos_sin = torch.cat((cos[:, :half], sin[:, :half]), dim=-1).contiguous()

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        return self._fi.norm.rmsnorm(x, weight, eps)

    def add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._fi.norm.fused_add_rmsnorm(x, residual, weight, eps)  # residual += x; x = norm
        return x, residual

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        return self._fi.activation.silu_and_mul(gate_up)

    def rope_state(self, positions: torch.Tensor, head_dim: int, theta: float,
                   dtype: torch.dtype) -> torch.Tensor:  # fmt: skip
        return positions

    def rope(
        self, q: torch.Tensor, k: torch.Tensor, state: Any, head_dim: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._fi.rope.apply_rope_with_cos_sin_cache_inplace(
            state, q, k, head_dim, self._cos_sin, is_neox=True
        )
        tokens = q.shape[0]
        return q.view(tokens, -1, head_dim), k.view(tokens, -1, head_dim)


def layer_ops_for(attention: object, max_positions: int, head_dim: int, theta: float) -> LayerOps:
    """FlashInfer's kernels beside an attention backend that asks for them
    (``fused_layer_ops``: FlashInfer's, same package, same GPU), else torch."""
    if not getattr(attention, "fused_layer_ops", False):
        return TorchLayerOps()
    device: torch.device = attention.device  # type: ignore[attr-defined]
    return FlashInferLayerOps(max_positions, head_dim, theta, device)
