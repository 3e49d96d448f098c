"""The once-per-step attention metadata against values worked out by hand."""

from __future__ import annotations

import pytest
import torch

from epd_engine.model.attention import AttentionBatch, build_metadata
from epd_engine.model.attention_torch import TorchPagedAttention

CPU = torch.device("cpu")


def test_mixed_decodes_and_chunked_prefills_with_partial_last_pages():
    """Two decodes (contexts 5 and 8, block size 4), a fresh 3-token prefill and a
    2-token chunk after 4 cached tokens."""
    batch = AttentionBatch(
        query_lens=[1, 1, 3, 2],
        context_lens=[5, 8, 3, 6],
        block_tables=[[7, 2], [0, 5, 9], [4], [3, 6, 1]],  # the last one has a spare page
        block_size=4,
    )
    meta = build_metadata(batch, CPU)
    assert meta.num_decodes == 2
    assert meta.qo_indptr.tolist() == [0, 1, 2, 5, 7]
    assert meta.kv_indptr.tolist() == [0, 2, 4, 5, 7]
    assert meta.kv_indices.tolist() == [7, 2, 0, 5, 4, 3, 6]
    assert meta.kv_last_page_len.tolist() == [1, 4, 3, 2]
    assert meta.context_lens.tolist() == [5, 8, 3, 6]
    assert meta.positions.tolist() == [4, 7, 0, 1, 2, 4, 5]
    # position 4 of seq 0 -> page 2 offset 0; 7 of seq 1 -> page 5 offset 3; ...
    assert meta.slot_mapping.tolist() == [8, 23, 16, 17, 18, 24, 25]
    for name in ("qo_indptr", "kv_indptr", "kv_indices", "kv_last_page_len", "context_lens"):
        assert getattr(meta, name).dtype == torch.int32, name
    assert meta.slot_mapping.dtype == torch.int64


def test_decode_group_is_the_leading_run_of_single_token_steps():
    """A one-token chunk after a prefill is not in the decode group (its rows are not
    0..num_decodes-1), and a first token (context 1) is a prefill, not a decode."""
    batch = AttentionBatch([1, 4, 1], [1, 4, 9], [[0], [1], [2, 3, 4]], 4)
    assert batch.num_decodes == 0
    assert AttentionBatch([1, 1, 4], [2, 9, 4], [[0], [1, 2, 3], [4]], 4).num_decodes == 2


def test_torch_prepare_pads_the_decode_page_table_and_masks_past_each_context():
    batch = AttentionBatch([1, 1, 2], [5, 2, 6], [[7, 2], [3], [1, 0]], 4)
    meta = TorchPagedAttention().prepare(batch, CPU)
    assert meta.decode_pages is not None and meta.decode_mask is not None
    assert meta.decode_pages.tolist() == [[7, 2], [3, 0]]
    assert meta.decode_mask[:, 0, 0].sum(dim=1).tolist() == [5, 2]
    (plan,) = meta.prefills
    assert (plan.start, plan.end, plan.context_len) == (2, 4, 6)
    assert plan.pages is not None and plan.pages.tolist() == [1, 0]
    assert plan.mask is not None
    assert plan.mask.tolist()[0] == [True] * 5 + [False]  # query at position 4 sees 0..4
    assert meta.write_blocks.tolist() == [2, 3, 0, 0]
    assert meta.write_offsets.tolist() == [0, 1, 0, 1]
    # flat rows: K of (page b, offset o) is 2 * 4 * b + o, its V 4 rows later
    assert meta.write_rows.tolist() == [[16, 25, 0, 1], [20, 29, 4, 5]]
    assert meta.decode_rows is not None
    k_rows = [56, 57, 58, 59, 16, 17, 18, 19, 24, 25, 26, 27, 0, 1, 2, 3]  # pages 7, 2 | 3, 0
    assert meta.decode_rows.tolist() == [k_rows, [r + 4 for r in k_rows]]


def test_a_block_table_too_short_for_the_context_is_refused():
    with pytest.raises(ValueError, match="block table too short"):
        AttentionBatch([1], [9], [[0, 1]], 4)
