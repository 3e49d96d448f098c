"""``bench.step_share``: a whole decode step of the engine's own pieces, the model's part
clocked apart (on CUDA by events around the decoder's graph replay and the LM head)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from epd_engine.bench.step_share import Setup, measure


def check(result: dict) -> None:
    for step in result["steps"]:
        assert 0 < step["model_ms"] < step["total_ms"]
        assert 0 < step["overhead_share"] < 1
        assert step["schedule_ms"] > 0 and step["sample_ms"] > 0 and step["detokenize_ms"] > 0
    shares = result["overhead_share"]
    assert shares["min"] <= shares["median"] <= shares["max"]


def test_a_cpu_step_is_split_into_the_model_and_the_rest(tiny_model_dir: Path) -> None:
    result = measure(tiny_model_dir, Setup(layers=1, batch=4, context=32, steps=2))
    check(result)
    assert (result["device"], result["dtype"], result["cuda_graphs"]) == ("cpu", "float32", False)
    for step in result["steps"]:  # on a CPU the runner's own part is what is left of it
        assert 0 < step["runner_outside_model_ms"] < step["runner_ms"]


@pytest.mark.gpu
def test_a_cuda_step_clocks_the_graph_replay_and_the_lm_head(tiny_model_dir: Path) -> None:
    """Not run here (no GPU): the decoder replays a captured graph, which no forward hook
    sees; the replay is clocked by events, so the model's time is not zero."""
    result = measure(tiny_model_dir, Setup(2, 32, 256, 3, "cuda", torch.float16))
    check(result)
    assert result["cuda_graphs"] and result["dtype"] == "float16"
