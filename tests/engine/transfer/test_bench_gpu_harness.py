"""``bench-transfer --gpu``'s harness, dry-run on CPU with the shm backend (the GPU run
differs only in the device and the backends): JSON shape, verification, the table."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from epd_engine.bench.transfer_gpu import format_table, main, scattered
from epd_engine.bench.transfer_shapes import llava_7b_shape


def test_scattered_keeps_the_pages_and_shuffles_the_destination() -> None:
    kv = llava_7b_shape().kv_transfers()
    shuffled = scattered(kv)
    assert [t.src_pages for t in shuffled] == [t.src_pages for t in kv]
    assert sorted(shuffled[0].dst_pages) == sorted(kv[0].dst_pages)
    assert shuffled[0].dst_pages != kv[0].dst_pages
    assert len({t.dst_pages for t in shuffled}) == 1  # every layer group alike


@pytest.mark.slow
def test_the_harness_runs_end_to_end_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu.json"
    args = ["--device", "cpu", "--backends", "shm", "--num-tokens", "48", "--repeats", "2",
            "--warmup", "1", "--out", str(out), "--run-dir", str(tmp_path / "run")]  # fmt: skip
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["kind"] == "epd-bench-transfer-gpu" and report["gpu"] == "cpu"
    assert report["shape"]["kv_bytes"] == 48 * 32 * 2 * 32 * 128 * 2
    shm = report["backends"]["shm"]
    assert shm["verified"] is True
    for case in ("kv", "kv_scattered", "image"):
        assert shm[case]["count"] == 2 and shm[case]["p50_ms"] > 0
    assert set(report["floor"]) == {"kv", "image"}
    report["backends"]["nccl"] = {"refused": "one GPU: NCCL will not put two ranks on it"}
    assert "nccl       one GPU" in format_table(report)
