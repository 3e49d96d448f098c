"""Local GPU placement: one GPU per instance when there are enough, an even split of a GPU's
memory when instances must share (pure logic; the processes themselves need GPUs)."""

from __future__ import annotations

import pytest

from epd_engine.contracts.gpu_placement import GpuSlots, visible_gpus


def test_visible_gpus_follow_the_launchers_own_list() -> None:
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": "2, 5"}, lambda: 8) == ["2", "5"]
    assert visible_gpus({}, lambda: 3) == ["0", "1", "2"]
    assert visible_gpus({"CUDA_VISIBLE_DEVICES": ""}, lambda: 3) == []


def test_enough_gpus_each_instance_its_own() -> None:
    slots = GpuSlots(["0", "1", "2"], max_instances=3)
    placed = [slots.acquire(f"i{n}") for n in range(3)]
    assert [p.gpu for p in placed] == ["0", "1", "2"]
    assert all(p.memory_fraction == pytest.approx(0.9) for p in placed)
    assert placed[0].env() == {"CUDA_VISIBLE_DEVICES": "0"}
    assert placed[0].args()[-2:] == ["--gpu-memory-fraction", "0.9"]


def test_sharing_splits_memory_and_balances() -> None:
    slots = GpuSlots(["0", "1"], max_instances=4)
    placed = [slots.acquire(f"i{n}") for n in range(4)]
    assert sorted(p.gpu for p in placed) == ["0", "0", "1", "1"]
    assert all(p.memory_fraction == pytest.approx(0.45) for p in placed)
    with pytest.raises(RuntimeError, match="no GPU slot left for i4"):
        slots.acquire("i4")
    slots.release("i1")
    assert slots.acquire("i5").gpu == placed[1].gpu  # the freed slot


def test_restart_keeps_its_gpu() -> None:
    slots = GpuSlots(["0", "1"], max_instances=2)
    first = slots.acquire("a")
    slots.acquire("b")
    assert slots.acquire("a") == first


def test_no_visible_gpu_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="no GPU is visible"):
        GpuSlots([], max_instances=1)
