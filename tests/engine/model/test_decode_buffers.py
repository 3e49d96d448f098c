"""Persistent decode buffers: padded decode steps give the unpadded results, and every
step's inputs and metadata are views of buffers allocated once.

"The same" is the same tokens and values equal to float32 rounding, not bit for bit: a
matrix product's row can depend on how many rows the batch has (the BLAS picks its blocking
by shape). On an AMD EPYC with MKL, 4 padded rows against 3 gave logits 6e-6 apart (of 17)
and caches 1e-6 apart; a padded row leaking into a real one moves them by whole units.
"""

from __future__ import annotations

import pytest
import torch

from epd_engine.model.attention import AttentionBatch
from epd_engine.model.attention_torch import TorchAttentionMetadata, TorchPagedAttention
from epd_engine.model.generate import greedy_generate
from epd_engine.model.input_buffers import DecodeBuffers, pad_sizes
from epd_engine.model.llava import LlavaLanguage
from epd_engine.request import Stage
from epd_engine.scheduler.output import TokenTask
from epd_engine.worker.model_runner import CacheShape, ModelRunner

BLOCK_SIZE = 4  # small pages: contexts cross page boundaries, last pages partly used
PROMPTS = [[1, 30, 46, 26, 2], [1, 45, 47, 28, 17, 33, 7], [1, 35]]


def test_pad_sizes():
    assert pad_sizes(1) == (1,)
    assert pad_sizes(3) == (1, 2, 4)
    assert pad_sizes(256) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert pad_sizes(300)[-2:] == (256, 512)
    with pytest.raises(ValueError):
        pad_sizes(0)


def runner(language: LlavaLanguage, buffered: bool) -> ModelRunner:
    shape = CacheShape(
        num_kv_blocks=64,
        kv_block_size=BLOCK_SIZE,
        num_image_blocks=1,
        image_block_tokens=1,
        image_row_size=language.config.hidden_size,
    )
    return ModelRunner(
        None,
        language,
        shape,
        torch.float32,
        "cpu",
        with_image_cache=False,
        max_decode_seqs=8 if buffered else None,
        max_model_len=64 if buffered else None,
    )


def generate(run: ModelRunner, steps: int) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Prefill every prompt, then greedy decode; the third request stops after two steps
    and a new batch size follows (3 -> 2 rows: padded to 4, then unpadded 2)."""
    tables = [list(range(i * 16, (i + 1) * 16)) for i in range(len(PROMPTS))]
    tasks = [
        TokenTask(f"r{i}", Stage.PREFILL, ids, 0, table, True)
        for i, (ids, table) in enumerate(zip(PROMPTS, tables, strict=True))
    ]
    outputs: list[list[int]] = [[] for _ in PROMPTS]
    lengths = [len(p) for p in PROMPTS]
    all_logits = []
    live = list(range(len(PROMPTS)))
    for step in range(steps):
        hidden = run.forward(tasks)
        with torch.inference_mode():
            logits = run.language.compute_logits(hidden)  # type: ignore[union-attr]
        all_logits.append(logits)
        for i, token in zip(live, logits.argmax(-1).tolist(), strict=True):
            outputs[i].append(token)
        if step == 2:
            live = live[:2]
        tasks = [
            TokenTask(f"r{i}", Stage.DECODE, [outputs[i][-1]], lengths[i] + step, tables[i], True)
            for i in live
        ]
    return outputs, all_logits


def test_padded_decodes_match_unpadded_exactly(language):
    assert runner(language, buffered=False).decode_buffers is None
    padded = runner(language, buffered=True)
    assert padded.decode_buffers is not None
    tokens, logits = generate(padded, 8)
    ref_tokens, ref_logits = generate(runner(language, buffered=False), 8)
    assert tokens == ref_tokens
    for got, want in zip(logits, ref_logits, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_padded_decodes_match_the_reference_loop(language):
    """The reference loop is the one the transformers parity tests check."""
    tokens, _ = generate(runner(language, buffered=True), 8)
    for prompt, got in zip(PROMPTS[:2], tokens[:2], strict=True):
        want = greedy_generate(None, language, prompt, None, 8, block_size=BLOCK_SIZE)
        assert got[: len(want)] == want


def test_padded_rows_leave_the_cache_as_unpadded(language):
    padded, plain = runner(language, buffered=True), runner(language, buffered=False)
    generate(padded, 5)
    generate(plain, 5)
    for got, want in zip(padded.kv_caches, plain.kv_caches, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def storages(meta: TorchAttentionMetadata) -> set[int]:
    tensors = [
        meta.qo_indptr,
        meta.kv_indptr,
        meta.kv_indices,
        meta.kv_last_page_len,
        meta.context_lens,
        meta.slot_mapping,
        meta.positions,
        meta.write_rows,
        meta.decode_pages,
        meta.decode_rows,
        meta.decode_mask,
    ]
    assert all(t is not None for t in tensors) and meta.write_src is not None
    return {t.untyped_storage().data_ptr() for t in [*tensors, meta.write_src] if t is not None}


def test_decode_steps_of_any_size_reuse_the_buffers():
    buffers = DecodeBuffers(16, 8, BLOCK_SIZE, torch.device("cpu"))
    allowed = {
        t.untyped_storage().data_ptr()
        for t in (buffers.packed32, buffers.packed64, buffers.decode_rows, buffers.decode_mask)
    }
    ids_ptr = buffers.input_ids.data_ptr()
    backend = TorchPagedAttention()
    for n in (1, 3, 16, 5, 2):
        tables = [list(range(i * 8, (i + 1) * 8)) for i in range(n)]
        contexts = [2 + 5 * i % 30 for i in range(n)]
        fill = buffers.fill(list(range(n)), contexts, tables)
        assert fill.rows == buffers.padded(n) >= n
        meta = backend.prepare_decode(buffers, fill)
        assert storages(meta) <= allowed
        assert buffers.input_ids.data_ptr() == ids_ptr
        # the real rows' metadata is what a fresh prepare builds
        batch = AttentionBatch([1] * n, contexts, tables, BLOCK_SIZE)
        fresh = backend.prepare(batch, buffers.device)
        assert meta.slot_mapping[:n].tolist() == fresh.slot_mapping.tolist()
        assert meta.positions[:n].tolist() == fresh.positions.tolist()
        assert meta.kv_indptr[: n + 1].tolist() == fresh.kv_indptr.tolist()
        assert meta.kv_last_page_len[:n].tolist() == fresh.kv_last_page_len.tolist()
        assert meta.write_rows[:, :n].tolist() == fresh.write_rows.tolist()
        assert meta.decode_mask is not None and fresh.decode_mask is not None
        width = fresh.decode_mask.shape[-1]
        assert torch.equal(meta.decode_mask[:n, ..., :width], fresh.decode_mask)
        assert not meta.decode_mask[:n, ..., width:].any()


def test_rotary_positions_can_differ_from_the_slots_they_write():
    """M-RoPE: a text token after an image sits past its KV slot. The buffers' positions are
    then the given rotary ones, and the writes still go to the slots of the context."""
    buffers = DecodeBuffers(4, 8, BLOCK_SIZE, torch.device("cpu"))
    tables, contexts = [[3, 4], [7]], [BLOCK_SIZE + 2, 3]
    plain = buffers.fill([5, 6], contexts, tables)
    slots = buffers.slot_mapping[: plain.rows].tolist()
    assert buffers.positions[:2].tolist() == [BLOCK_SIZE + 1, 2]
    rotary = buffers.fill([5, 6], contexts, tables, rope_positions=[40, 9])
    assert buffers.positions[:2].tolist() == [40, 9]
    assert buffers.slot_mapping[: rotary.rows].tolist() == slots


def test_a_decode_longer_than_the_buffers_is_refused():
    buffers = DecodeBuffers(4, 2, BLOCK_SIZE, torch.device("cpu"))
    with pytest.raises(ValueError, match="pages"):
        buffers.fill([1], [3 * BLOCK_SIZE], [[0, 1, 2]])
    with pytest.raises(ValueError, match="do not fit"):
        buffers.fill([1] * 5, [2] * 5, [[0]] * 5)


def test_a_block_table_shorter_than_its_context_is_refused():
    """A clear error (the old fill raised an IndexError from inside its slot arithmetic)."""
    buffers = DecodeBuffers(4, 4, BLOCK_SIZE, torch.device("cpu"))
    with pytest.raises(ValueError, match="fewer pages"):
        buffers.fill([1, 2], [2 * BLOCK_SIZE + 1, 2], [[0, 1], [5]])
