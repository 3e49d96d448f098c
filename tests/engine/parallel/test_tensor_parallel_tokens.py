"""Tensor parallelism changes where the model runs, not what it says (issue 34): an EPD
instance split over two ranks (two processes joined by gloo on this CPU) gives the greedy
tokens of the same instance on one rank, for text and images, and logits within float32
rounding (the all-reduce sums the rank's partial products in another order)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from epd_engine.config import EngineConfig, Role, Stage
from epd_engine.engine.llm_engine import LLMEngine
from epd_engine.scheduler.output import TokenTask
from tests.engine.model.engine_parity import engine_greedy

MAX_TOKENS = 10
CASES: dict[str, tuple[str, list[tuple[int, int]]]] = {
    "text": ("Write a short story about a fisherman.", []),
    "one": ("What is shown in this image?", [(90, 60)]),
    "two": ("Compare the two images.", [(64, 64), (300, 200)]),
}
FAMILIES = ["tiny_model_dir", "tiny_qwen2_vl_dir", "tiny_qwen3_vl_dir", "tiny_gemma3_dir"]


@pytest.fixture(params=FAMILIES)
def model_dir(request: pytest.FixtureRequest) -> Path:
    return Path(request.getfixturevalue(request.param))


@pytest.mark.parametrize("token_budget", [512, 24])  # one prefill each; chunks cut images
def test_two_ranks_give_one_ranks_tokens(model_dir, token_budget):
    one, _ = engine_greedy(model_dir, CASES, MAX_TOKENS, token_budget)
    two, _ = engine_greedy(model_dir, CASES, MAX_TOKENS, token_budget, tensor_parallel_size=2)
    assert two == one
    assert all(len(tokens) > 1 for tokens in one.values())


def _prompt_logits(model_dir: Path, tensor_parallel_size: int) -> torch.Tensor:
    engine = LLMEngine(
        EngineConfig(
            model_dir=model_dir, role=Role.EPD, token_budget=64, image_budget=1,
            num_kv_blocks=16, num_image_blocks=4, tensor_parallel_size=tensor_parallel_size,
        )
    )  # fmt: skip
    try:
        task = TokenTask("probe", Stage.PREFILL, list(range(3, 40)), 0, [0, 1, 2], sample=True)
        return engine.runner.logits(engine.runner.forward([task]))
    finally:
        engine.close()


def test_logits_agree_within_float32_rounding(tiny_model_dir):
    one = _prompt_logits(tiny_model_dir, 1)
    two = _prompt_logits(tiny_model_dir, 2)
    assert two.shape == one.shape  # the vocabulary's padding is cut off again
    torch.testing.assert_close(two, one, rtol=1e-5, atol=1e-5)
    assert not torch.equal(two, torch.zeros_like(two))


@pytest.mark.gpu
@pytest.mark.parametrize("fixture", ["tiny_model_dir", "tiny_qwen2_vl_dir"])
def test_two_ranks_on_one_gpu_give_one_ranks_tokens(request, monkeypatch, fixture):
    """The CUDA path of tensor parallelism (sliced loading onto the GPU, each rank's heads in
    the attention backend, the decode buffers, image rows broadcast from CUDA memory) on a
    one-GPU machine: both ranks on it, joined by gloo (``EPD_TP_SHARE_DEVICE``; NCCL needs a
    GPU per rank, which no machine we have offers)."""
    model_dir = Path(request.getfixturevalue(fixture))
    monkeypatch.setenv("EPD_TP_SHARE_DEVICE", "1")  # the rank processes inherit it
    one, _ = engine_greedy(model_dir, CASES, MAX_TOKENS, 24, device="cuda")
    two, _ = engine_greedy(model_dir, CASES, MAX_TOKENS, 24, device="cuda",
                           tensor_parallel_size=2)  # fmt: skip
    assert two == one
    assert all(len(tokens) > 1 for tokens in one.values())
