"""The layer-ops seam: torch's ops are the old layer math bit for bit (the transformers parity
tests run through them), the FlashInfer backend brings FlashInfer's ops, and FlashInfer's
kernels compute the same functions (gpu: needs a GPU and flashinfer)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from epd_engine.model.attention_torch import TorchPagedAttention
from epd_engine.model.layer_ops import TorchLayerOps, layer_ops_for
from epd_engine.model.layers import apply_rope, rms_norm, rope_cos_sin

T, H, HEADS, KV_HEADS, D = 5, 256, 4, 2, 64


def test_torch_add_rms_norm_is_add_then_norm_exactly() -> None:
    x, residual, weight = torch.randn(T, H), torch.randn(T, H), torch.randn(H)
    normed, new_residual = TorchLayerOps().add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(new_residual, residual + x)
    assert torch.equal(normed, rms_norm(residual + x, weight, 1e-5))


def test_torch_silu_mul_and_rope_are_the_layer_math() -> None:
    ops = TorchLayerOps()
    gate_up = torch.randn(T, 2 * H)
    assert torch.equal(ops.silu_mul(gate_up), F.silu(gate_up[:, :H]) * gate_up[:, H:])
    positions = torch.tensor([0, 3, 4, 9, 100])
    state = ops.rope_state(positions, D, 10000.0, torch.float32)
    q, k = torch.randn(T, HEADS * D), torch.randn(T, KV_HEADS * D)
    q_rot, k_rot = ops.rope(q, k, state, D)
    cos, sin = rope_cos_sin(positions, D, 10000.0, torch.float32)
    assert torch.equal(q_rot, apply_rope(q.view(T, HEADS, D), cos, sin))
    assert torch.equal(k_rot, apply_rope(k.view(T, KV_HEADS, D), cos, sin))


def test_torch_attention_gets_torch_ops() -> None:
    assert isinstance(layer_ops_for(TorchPagedAttention(), 64, D, 1e4), TorchLayerOps)


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want.double()).norm() / want.double().norm()).item()


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(3))
def test_flashinfer_ops_compute_the_torch_functions(seed: int) -> None:
    pytest.importorskip("flashinfer", reason="needs flashinfer")
    from epd_engine.model.layer_ops import FlashInferLayerOps

    torch.manual_seed(seed)
    dev, dt, d = torch.device("cuda"), torch.float16, 128
    fused, plain = FlashInferLayerOps(4096, d, 10000.0, dev), TorchLayerOps()
    x, residual = torch.randn(T, H, device=dev, dtype=dt), torch.randn(T, H, device=dev, dtype=dt)
    weight = torch.randn(H, device=dev, dtype=dt)
    want_x, want_r = plain.add_rms_norm(x, residual, weight, 1e-5)
    got_x, got_r = fused.add_rms_norm(x.clone(), residual.clone(), weight, 1e-5)
    assert rel_error(got_r, want_r) < 1e-3 and rel_error(got_x, want_x) < 1e-2
    assert rel_error(fused.rms_norm(x, weight, 1e-5), plain.rms_norm(x, weight, 1e-5)) < 1e-2
    gate_up = torch.randn(T, 2 * H, device=dev, dtype=dt)
    assert rel_error(fused.silu_mul(gate_up), plain.silu_mul(gate_up)) < 1e-2
    positions = torch.tensor([0, 3, 4, 900, 4095], device=dev)
    qkv = torch.randn(T, (HEADS + 2 * KV_HEADS) * d, device=dev, dtype=dt)
    q, k, _ = qkv.split([HEADS * d, KV_HEADS * d, KV_HEADS * d], dim=-1)  # strided, as in a layer
    want_q, want_k = plain.rope(q, k, plain.rope_state(positions, d, 1e4, dt), d)
    got_q, got_k = fused.rope(q.clone(), k.clone(), fused.rope_state(positions, d, 1e4, dt), d)
    in_place_q, _ = fused.rope(q, k, positions, d)  # the layer's own strided views
    assert rel_error(got_q, want_q) < 1e-2 and rel_error(got_k, want_k) < 1e-2
    assert rel_error(in_place_q, want_q) < 1e-2
