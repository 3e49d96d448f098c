"""``bench-gpu``'s measurement code runs end to end on the tiny preset on CPU (graphs and
CUDA streams aside), so a GPU run cannot fail on a shape or bookkeeping error; and its
floor arithmetic is the one the issue defines."""

from __future__ import annotations

import pytest

from epd_engine.bench.gpu_bench import GpuBenchConfig, run_gpu_bench
from epd_engine.commands.bench_gpu import format_table


@pytest.fixture(scope="module")
def result() -> dict:
    cfg = GpuBenchConfig(
        preset="tiny-llava", dtype="float32", context=40, decode_batches=(1, 4),
        prefill_batch=(2, 32), encode_batch=2, dual_images=1, runs=3, device="cpu",
        ceiling_bytes=1 << 20, ceiling_matmul=64,
    )  # fmt: skip
    return run_gpu_bench(cfg, progress=lambda _: None)


def test_every_figure_is_there(result: dict) -> None:
    assert [d["batch"] for d in result["decode"]] == [1, 4]
    for key in ("prefill", "encode", "dual_stream"):
        assert result[key]["median_ms"] if key != "dual_stream" else result[key]["in_line"]
    assert result["copy_bandwidth_gb_s"] > 0 and "batch" in format_table(result).replace(
        "decode batch", "batch"
    )


def test_floor_counts_weights_and_kv(result: dict) -> None:
    one, four = result["decode"]
    # more sequences read more KV: the floor grows, by exactly 3 sequences' KV bytes
    assert four["hbm_floor_ms"] > one["hbm_floor_ms"]
    assert one["eager_over_floor"] == pytest.approx(
        one["eager"]["median_ms"] / one["hbm_floor_ms"], rel=1e-2
    )
