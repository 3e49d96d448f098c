"""A device-to-device page copy: slice copies for few runs, an index gather/scatter for
scattered pages; both give exactly a page-by-page copy (checked here on CPU tensors)."""

from __future__ import annotations

import pytest
import torch

from epd_engine.transfer.copy_plan import CopyPlan, apply_plan, plan_copy


def test_consecutive_pages_are_a_few_slice_copies() -> None:
    plan = plan_copy([4, 5, 6, 9], [0, 1, 2, 3])
    assert plan == CopyPlan(((4, 0, 3), (9, 3, 1)))
    assert not plan.indexed and plan.num_pages == 4
    assert (plan.max_src, plan.max_dst) == (9, 3)


def test_scattered_pages_are_one_gather_and_scatter() -> None:
    src, dst = [0, 2, 4, 6, 8, 10], [11, 9, 7, 5, 3, 1]
    plan = plan_copy(src, dst, max_runs=4)
    assert plan.indexed and plan.src_index == tuple(src) and plan.dst_index == tuple(dst)
    assert (plan.max_src, plan.max_dst, plan.num_pages) == (10, 11, 6)


def test_bad_page_lists_are_refused() -> None:
    with pytest.raises(ValueError, match="named twice"):
        plan_copy([0, 1], [3, 3])
    with pytest.raises(ValueError, match="non-negative"):
        plan_copy([-1], [0])
    with pytest.raises(ValueError):
        plan_copy([0, 1], [0])


@pytest.mark.parametrize("max_runs", [0, 100])  # always indexed, never indexed
def test_both_ways_copy_exactly_the_named_pages(max_runs: int) -> None:
    generator = torch.Generator().manual_seed(0)
    src = [torch.randn(12, 2, 4, 2, 3, generator=generator) for _ in range(3)]
    dst = [torch.zeros(10, 2, 4, 2, 3) for _ in range(3)]
    src_pages, dst_pages = [3, 4, 5, 11, 0], [9, 0, 1, 2, 6]
    apply_plan(plan_copy(src_pages, dst_pages, max_runs), src, dst)
    untouched = [p for p in range(10) if p not in dst_pages]
    for s, d in zip(src, dst, strict=True):
        assert torch.equal(d[dst_pages], s[src_pages])
        assert not d[untouched].any()


def test_pages_outside_the_layers_are_refused_before_any_copy() -> None:
    src, dst = [torch.ones(4, 2)], [torch.zeros(4, 2)]
    for plan in (plan_copy([3], [4]), plan_copy([4, 0], [0, 1], max_runs=0)):
        with pytest.raises(IndexError, match="outside"):
            apply_plan(plan, src, dst)
    assert not dst[0].any()
    with pytest.raises(ValueError, match="source layers"):
        apply_plan(plan_copy([0], [0]), src, [])
