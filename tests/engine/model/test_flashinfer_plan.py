"""FlashInfer plan arguments from step metadata, against values worked out by hand (CPU)."""

from __future__ import annotations

import pytest
import torch

from epd_engine.model.attention import AttentionBatch, buffer_metadata, build_metadata
from epd_engine.model.flashinfer_plan import flashinfer_plan_args, unsupported_reason
from epd_engine.model.input_buffers import DecodeBuffers
from tests.engine.model.fake_flashinfer import DECODE_PLAN_PARAMS, PREFILL_PLAN_PARAMS

CPU = torch.device("cpu")
BS = 4  # tokens per page


def mixed_batch() -> AttentionBatch:
    """Two decodes, a fresh prefill, and a chunk after 8 cached tokens."""
    return AttentionBatch(
        query_lens=[1, 1, 5, 3],
        context_lens=[6, 9, 5, 11],
        # decode 6 tokens: 2 pages, 2 in the last; decode 9: 3 pages, 1 in the last (the 4th
        # page is allocated, not used); prefill 5: 2 pages, 1; chunk to 11: 3 pages, 3
        block_tables=[[3, 7], [1, 4, 2, 9], [5, 0], [8, 6, 10]],
        block_size=BS,
    )


def ints(t: torch.Tensor) -> list[int]:
    assert t.dtype == torch.int32
    return t.tolist()


def test_mixed_batch_splits_into_decode_and_prefill_groups():
    meta = build_metadata(mixed_batch(), CPU)
    plan = flashinfer_plan_args(meta, 8, 2, 64, torch.float16)
    assert plan.decode_rows == 2 and plan.sm_scale == 0.125
    d = plan.decode
    assert d is not None
    assert ints(d["indptr"]) == [0, 2, 5]
    assert ints(d["indices"]) == [3, 7, 1, 4, 2]
    assert ints(d["last_page_len"]) == [2, 1]
    assert (d["num_qo_heads"], d["num_kv_heads"], d["head_dim"], d["page_size"]) == (8, 2, 64, 4)
    assert d["q_data_type"] == d["kv_data_type"] == torch.float16
    assert d["pos_encoding_mode"] == "NONE" and d["sm_scale"] == 0.125
    p = plan.prefill
    assert p is not None
    assert ints(p["qo_indptr"]) == [0, 5, 8]  # re-based: the prefill rows start after decodes
    assert ints(p["paged_kv_indptr"]) == [0, 2, 5]
    assert ints(p["paged_kv_indices"]) == [5, 0, 8, 6, 10]
    assert ints(p["paged_kv_last_page_len"]) == [1, 3]
    assert p["causal"] is True
    assert (p["num_qo_heads"], p["num_kv_heads"], p["head_dim_qk"], p["page_size"]) == (8, 2, 64, 4)
    # names are those of flashinfer-python 0.5.3's plan()
    assert set(d) <= set(DECODE_PLAN_PARAMS) and set(p) <= set(PREFILL_PLAN_PARAMS)


def test_index_slices_are_views_of_the_step_indices():
    meta = build_metadata(mixed_batch(), CPU)
    plan = flashinfer_plan_args(meta, 8, 2, 64, torch.float16)
    assert plan.decode is not None and plan.prefill is not None
    base = meta.kv_indices.untyped_storage().data_ptr()
    assert plan.decode["indices"].untyped_storage().data_ptr() == base
    assert plan.prefill["paged_kv_indices"].untyped_storage().data_ptr() == base
    # the host-side arguments are host tensors (plan reads them without a device sync)
    assert plan.decode["indptr"].device.type == "cpu"


def test_decode_only_and_prefill_only_steps_plan_one_wrapper():
    decodes = AttentionBatch([1, 1], [6, 9], [[3, 7], [1, 4, 2]], BS)
    plan = flashinfer_plan_args(build_metadata(decodes, CPU), 4, 4, 128, torch.bfloat16)
    assert plan.prefill is None and plan.decode is not None and plan.decode_rows == 2
    prefills = AttentionBatch([5, 3], [5, 11], [[5, 0], [8, 6, 10]], BS)
    plan = flashinfer_plan_args(build_metadata(prefills, CPU), 4, 4, 128, torch.bfloat16)
    assert plan.decode is None and plan.decode_rows == 0
    assert plan.prefill is not None
    assert ints(plan.prefill["qo_indptr"]) == [0, 5, 8]
    assert ints(plan.prefill["paged_kv_indices"]) == [5, 0, 8, 6, 10]


def test_a_one_token_first_prefill_is_not_a_decode():
    batch = AttentionBatch([1, 1], [1, 7], [[2], [3, 4]], BS)  # a 1-token prompt leads
    plan = flashinfer_plan_args(build_metadata(batch, CPU), 4, 4, 64, torch.float16)
    assert plan.decode is None
    assert plan.prefill is not None and ints(plan.prefill["qo_indptr"]) == [0, 1, 2]


def test_a_sequence_without_new_tokens_is_left_out_of_the_prefill_group():
    batch = AttentionBatch([1, 4, 0, 2], [6, 4, 3, 6], [[3, 7], [5], [9], [8, 6]], BS)
    plan = flashinfer_plan_args(build_metadata(batch, CPU), 4, 4, 64, torch.float16)
    p = plan.prefill
    assert p is not None
    assert ints(p["qo_indptr"]) == [0, 4, 6]
    assert ints(p["paged_kv_indptr"]) == [0, 1, 3]
    assert ints(p["paged_kv_indices"]) == [5, 8, 6]
    assert ints(p["paged_kv_last_page_len"]) == [4, 2]


def test_padded_buffered_decode_plans_every_row():
    buffers = DecodeBuffers(8, 4, BS, CPU)
    fill = buffers.fill([11, 12, 13], [6, 9, 2], [[3, 7], [1, 4, 2], [5]])
    assert fill.rows == 4
    plan = flashinfer_plan_args(buffer_metadata(buffers, fill), 4, 2, 64, torch.float16)
    d = plan.decode
    assert d is not None and plan.prefill is None and plan.decode_rows == 4
    assert ints(d["indptr"]) == [0, 2, 5, 6, 7]  # the padded row: one page
    assert ints(d["indices"]) == [3, 7, 1, 4, 2, 5, 0]  # ... page 0
    assert ints(d["last_page_len"]) == [2, 1, 2, 1]


@pytest.mark.parametrize(
    ("head_dim", "dtype", "reason"),
    [
        (128, torch.float16, None),
        (64, torch.bfloat16, None),
        (16, torch.float16, "head_dim 16"),
        (128, torch.float32, "dtype torch.float32"),
    ],
)
def test_unsupported_reason(head_dim, dtype, reason):
    got = unsupported_reason(head_dim, dtype)
    assert got == reason if reason is None else reason in str(got)
