"""Which attention backend an engine picks, and the flags that choose it (CPU)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from epd_engine.config import EngineConfig
from epd_engine.model.attention_select import make_attention_backend, select_attention_backend
from epd_engine.model.attention_torch import TorchPagedAttention

FP16 = torch.float16


def importable() -> str | None:
    return None


def missing() -> str:
    return "flashinfer is not importable (ModuleNotFoundError: No module named 'flashinfer')"


def test_auto_picks_flashinfer_on_cuda_when_it_can_run():
    assert select_attention_backend("cuda", "auto", FP16, 128, importable) == "flashinfer"
    assert select_attention_backend("cuda:1", "auto", torch.bfloat16, 64, importable) == (
        "flashinfer"
    )


@pytest.mark.parametrize(
    ("device", "dtype", "head_dim", "import_error", "why"),
    [
        ("cpu", FP16, 128, importable, "device cpu is not CUDA"),
        ("cuda", FP16, 128, missing, "flashinfer is not importable"),
        ("cuda", torch.float32, 128, importable, "dtype torch.float32"),
        ("cuda", FP16, 16, importable, "head_dim 16"),  # the tiny checkpoint
    ],
)
def test_auto_falls_back_to_torch_with_one_line_saying_why(
    caplog, device, dtype, head_dim, import_error, why
):
    with caplog.at_level(logging.INFO, logger="epd_engine.model.attention_select"):
        assert select_attention_backend(device, "auto", dtype, head_dim, import_error) == "torch"
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "torch SDPA" in lines[0] and why in lines[0]


@pytest.mark.parametrize(
    ("device", "dtype", "head_dim", "import_error", "why"),
    [
        ("cpu", FP16, 128, importable, "device cpu is not CUDA"),
        ("cuda", FP16, 128, missing, "not importable"),
        ("cuda", torch.float32, 64, importable, "dtype"),
    ],
)
def test_an_explicit_flashinfer_that_cannot_run_is_an_error(
    device, dtype, head_dim, import_error, why
):
    with pytest.raises(ValueError, match=why):
        select_attention_backend(device, "flashinfer", dtype, head_dim, import_error)


def test_torch_is_torch_everywhere_and_unknown_names_are_refused():
    assert select_attention_backend("cuda", "torch", FP16, 128, importable) == "torch"
    assert select_attention_backend("cpu", "torch", torch.float32, 16, missing) == "torch"
    with pytest.raises(ValueError, match="one of"):
        select_attention_backend("cpu", "sdpa", FP16, 128, importable)
    assert isinstance(make_attention_backend("torch", None, FP16, "cpu"), TorchPagedAttention)


def test_config_and_serve_flags():
    config = EngineConfig(model_dir=Path("m"))
    assert config.attention_backend == "auto" and config.cuda_graphs is True
    with pytest.raises(ValueError, match="attention_backend"):
        EngineConfig(model_dir=Path("m"), attention_backend="sdpa")
    import argparse

    from epd_engine.commands import serve

    parser = argparse.ArgumentParser()
    serve.register(parser.add_subparsers())
    args = parser.parse_args(["serve", "--model", "m"])
    assert (args.attention_backend, args.cuda_graphs) == ("auto", True)
    args = parser.parse_args(
        ["serve", "--model", "m", "--attention-backend", "flashinfer", "--no-cuda-graphs"]
    )
    config = serve.engine_config(args)
    assert (config.attention_backend, config.cuda_graphs) == ("flashinfer", False)


def no_kernels(head_dim: int, dtype: torch.dtype) -> str:
    return f"FlashInfer's kernels for head_dim {head_dim} {dtype} are not built in (x missing)"


def test_flashinfer_without_its_kernels_falls_back_or_is_refused(caplog):
    """The GPU image builds head size 128 only and has no nvcc: another head size must not
    pick FlashInfer and fail at the first step (flashinfer_kernels.py; tests/images/
    test_gpu_image.py runs the real check inside the image)."""
    with caplog.at_level(logging.INFO, logger="epd_engine.model.attention_select"):
        picked = select_attention_backend("cuda", "auto", FP16, 64, importable, no_kernels)
    assert picked == "torch"
    assert "not built in" in caplog.records[-1].getMessage()
    with pytest.raises(ValueError, match=r"head_dim 64 .* not built in"):
        select_attention_backend("cuda", "flashinfer", FP16, 64, importable, no_kernels)
    has_kernels = select_attention_backend("cuda", "auto", FP16, 128, importable, lambda h, d: None)
    assert has_kernels == "flashinfer"
