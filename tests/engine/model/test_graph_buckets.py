"""CUDA-graph buckets and the graph-or-eager decision (pure), and a CPU runner that asks
for graphs gets none."""

from __future__ import annotations

import logging

import pytest
import torch

from epd_engine.model.graph_buckets import (
    bucket_for,
    graph_buckets,
    graph_or_eager,
    graphs_off_reason,
)
from epd_engine.model.input_buffers import pad_sizes
from epd_engine.worker.model_runner import CacheShape, ModelRunner


def test_buckets_are_the_buffers_padded_sizes_up_to_the_largest_captured():
    assert graph_buckets(pad_sizes(256)) == (1, 2, 4, 8, 16, 32, 64, 128, 256)
    assert graph_buckets(pad_sizes(5)) == (1, 2, 4, 8)
    assert graph_buckets(pad_sizes(600)) == (1, 2, 4, 8, 16, 32, 64, 128, 256)  # 512 eager
    assert graph_buckets(pad_sizes(64), max_batch=16) == (1, 2, 4, 8, 16)


@pytest.mark.parametrize(
    ("n", "bucket"), [(1, 1), (2, 2), (3, 4), (4, 4), (5, 8), (17, 32), (64, 64), (65, None)]
)
def test_smallest_bucket_that_holds_the_batch(n, bucket):
    assert bucket_for(n, (1, 2, 4, 8, 16, 32, 64)) == bucket


def test_no_bucket_for_nothing():
    assert bucket_for(0, (1, 2)) is None
    assert bucket_for(1, ()) is None


def test_graph_or_eager():
    buckets = (1, 2, 4, 8)
    assert graph_or_eager(3, buckets, decode_only=True, layer_callback=False) == 4
    assert graph_or_eager(3, buckets, decode_only=False, layer_callback=False) is None
    assert graph_or_eager(3, buckets, decode_only=True, layer_callback=True) is None
    assert graph_or_eager(9, buckets, decode_only=True, layer_callback=False) is None


@pytest.mark.parametrize(
    ("args", "why"),
    [
        ((False, "cuda", True, True), "turned off"),
        ((True, "cpu", True, True), "not CUDA"),
        ((True, "cuda", True, False), "no persistent decode buffers"),
        ((True, "cuda", False, True), "not graph-safe"),
        ((True, "cuda", True, True), None),
    ],
)
def test_graphs_off_reason(args, why):
    reason = graphs_off_reason(*args)
    assert reason is None if why is None else why in str(reason)


def test_a_cpu_runner_asked_for_graphs_runs_eagerly(language, caplog):
    shape = CacheShape(16, 4, 1, 1, language.config.hidden_size)
    with caplog.at_level(logging.DEBUG, logger="epd_engine.worker.model_runner"):
        runner = ModelRunner(
            None, language, shape, torch.float32, "cpu", False,
            max_decode_seqs=4, max_model_len=32, cuda_graphs=True,
        )  # fmt: skip
    assert runner.graphs is None and runner.decode_buffers is not None
    assert any("CUDA graphs off: device type cpu" in r.getMessage() for r in caplog.records)


def test_graphs_refuse_a_backend_that_is_not_graph_safe_and_unknown_buckets(language):
    from epd_engine.model.decode_graphs import DecodeGraphs
    from epd_engine.model.input_buffers import DecodeBuffers

    buffers = DecodeBuffers(4, 8, 4, torch.device("cpu"))
    with pytest.raises(ValueError, match="cannot run in a CUDA graph"):
        DecodeGraphs(language, buffers, [], (1, 2, 4))

    class GraphSafe:
        graph_safe = True

    class Model:
        attention = GraphSafe()

    with pytest.raises(ValueError, match=r"buckets \[3\]"):
        DecodeGraphs(Model(), buffers, [], (1, 3))
    assert DecodeGraphs(Model(), buffers, [], (1, 2, 4)).buckets == (1, 2, 4)
