"""FlashInferAttention's own logic on CPU, with a torch stand-in for the flashinfer module:
plan once per step, cache writes, the decode/prefill split of ``q``, the CUDA-graph
wrappers' fixed buffers. Kernel parity is ``test_flashinfer_gpu.py``."""

from __future__ import annotations

import pytest
import torch

from epd_engine.model import attention_flashinfer
from epd_engine.model.attention import AttentionBatch
from epd_engine.model.attention_flashinfer import FlashInferAttention
from epd_engine.model.attention_torch import TorchPagedAttention
from epd_engine.model.input_buffers import DecodeBuffers
from tests.engine.model.fake_flashinfer import fake_flashinfer

CPU = torch.device("cpu")
HQ, HKV, D, BS = 4, 2, 64, 4
DTYPE = torch.float16
SCALE = D**-0.5


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch) -> FlashInferAttention:
    monkeypatch.setattr(attention_flashinfer, "import_flashinfer", fake_flashinfer)
    return FlashInferAttention(HQ, HKV, D, DTYPE, CPU, workspace_bytes=16)


def qkv(num_tokens: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return (
        torch.randn(num_tokens, HQ, D, generator=gen).to(DTYPE),
        torch.randn(num_tokens, HKV, D, generator=gen).to(DTYPE),
        torch.randn(num_tokens, HKV, D, generator=gen).to(DTYPE),
    )


def random_cache(num_blocks: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, 2, BS, HKV, D, generator=gen).to(DTYPE)


def rel_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want.float()).norm() / want.float().norm())


def test_mixed_batch_matches_the_torch_backend(backend):
    batch = AttentionBatch(
        query_lens=[1, 1, 5, 3],
        context_lens=[6, 9, 5, 11],
        block_tables=[[3, 7], [1, 4, 2, 9], [5, 0], [8, 6, 10]],
        block_size=BS,
    )
    q, k, v = qkv(10, 0)
    cache = random_cache(12, 1)  # the cached tokens: whatever is in the pages
    fi_cache, torch_cache = cache.clone(), cache.clone()
    meta = backend.prepare(batch, CPU)
    assert len(backend.decode.plans) == 1 and len(backend.prefill.plans) == 1
    got = backend.forward(q, k, v, fi_cache, meta, SCALE)
    want = TorchPagedAttention().forward(
        q, k, v, torch_cache, TorchPagedAttention().prepare(batch, CPU), SCALE
    )
    assert torch.equal(fi_cache, torch_cache)  # the same slots written
    assert rel_error(got, want) < 1e-2
    # a second layer reads the same plan: no new plan per layer
    backend.forward(q, k, v, fi_cache, meta, SCALE)
    assert len(backend.decode.plans) == 1 and len(backend.prefill.plans) == 1


def test_buffered_and_graph_decodes_match_the_torch_backend(backend):
    buffers = DecodeBuffers(8, 4, BS, CPU)
    torch_backend = TorchPagedAttention()
    for step, (contexts, tables) in enumerate(
        [
            ([6, 9, 2], [[3, 7], [1, 4, 2], [5]]),
            ([7, 10, 3], [[3, 7], [1, 4, 2], [5]]),
            ([5, 13], [[8, 6], [1, 4, 2, 11]]),
        ]
    ):
        fill = buffers.fill(list(range(len(contexts))), contexts, tables)
        q, k, v = qkv(fill.rows, 10 + step)
        cache = random_cache(12, 20 + step)
        want_cache = cache.clone()
        want = torch_backend.forward(
            q, k, v, want_cache, torch_backend.prepare_decode(buffers, fill), SCALE
        )
        for prepare in (backend.prepare_decode, backend.prepare_graph_decode):
            got_cache = cache.clone()
            got = backend.forward(q, k, v, got_cache, prepare(buffers, fill), SCALE)
            n = fill.num_seqs
            assert rel_error(got[:n], want[:n]) < 1e-2
            assert torch.equal(got_cache, want_cache)


def test_graph_wrappers_are_one_per_batch_size_on_fixed_buffers(backend):
    buffers = DecodeBuffers(8, 4, BS, CPU)
    tables = [[3, 7], [1, 4, 2], [5]]
    first = backend.prepare_graph_decode(buffers, buffers.fill([1, 2, 3], [6, 9, 2], tables))
    again = backend.prepare_graph_decode(buffers, buffers.fill([4] * 4, [3] * 4, [[1]] * 4))
    assert first.decode_wrapper is again.decode_wrapper  # 3 and 4 decodes both run at 4 rows
    wrapper = first.decode_wrapper
    assert wrapper.use_cuda_graph
    indptr, indices, last = wrapper.buffers
    assert indptr.shape == (5,) and last.shape == (4,)
    assert indptr.tolist() == [0, 1, 2, 3, 4] and last.tolist() == [3, 3, 3, 3]  # re-planned
    # another size: its own wrapper, on the same storage (one size runs per step)
    other = backend.prepare_graph_decode(buffers, buffers.fill([1], [5], [[2, 3]]))
    assert other.decode_wrapper is not wrapper
    assert other.decode_wrapper.buffers[1].data_ptr() == indices.data_ptr()
    # the captured forward's other inputs are views of the persistent buffers
    storage = buffers.packed64.untyped_storage().data_ptr()
    assert again.positions.untyped_storage().data_ptr() == storage
    assert again.write_rows.untyped_storage().data_ptr() == storage


def test_a_scale_other_than_the_planned_one_is_refused(backend):
    batch = AttentionBatch([2], [2], [[0]], BS)
    q, k, v = qkv(2, 3)
    meta = backend.prepare(batch, CPU)
    with pytest.raises(ValueError, match="planned"):
        backend.forward(q, k, v, random_cache(2, 0), meta, 0.5)


@pytest.mark.parametrize(("head_dim", "dtype"), [(16, torch.float16), (64, torch.float32)])
def test_shapes_flashinfer_cannot_run_are_refused(monkeypatch, head_dim, dtype):
    monkeypatch.setattr(attention_flashinfer, "import_flashinfer", fake_flashinfer)
    with pytest.raises(ValueError, match="FlashInfer attention cannot run"):
        FlashInferAttention(HQ, HKV, head_dim, dtype, CPU)
