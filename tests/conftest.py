"""Shared fixtures for the whole test suite."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest

# The processes a test starts share one secret, as a deployment's do (there is no default).
os.environ.setdefault("EPD_INTERNAL_TOKEN", secrets.token_urlsafe(24))


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight ``tiny-llava`` checkpoint (HF hub layout, float32), made once per session."""
    from epd_engine.model.make_model import make_model

    model_dir = tmp_path_factory.mktemp("tiny-llava")
    make_model("tiny-llava", model_dir, seed=0, dtype="float32", show_progress=False)
    return model_dir


@pytest.fixture(scope="session")
def tiny_qwen2_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight ``tiny-qwen2-vl`` checkpoint (hub layout, float32), made once."""
    from epd_engine.model.make_model import make_model

    model_dir = tmp_path_factory.mktemp("tiny-qwen2-vl")
    make_model("tiny-qwen2-vl", model_dir, seed=0, dtype="float32", show_progress=False)
    return model_dir


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight ``tiny-qwen2.5-vl`` checkpoint (hub layout, float32), made once."""
    from epd_engine.model.make_model import make_model

    model_dir = tmp_path_factory.mktemp("tiny-qwen2.5-vl")
    make_model("tiny-qwen2.5-vl", model_dir, seed=0, dtype="float32", show_progress=False)
    return model_dir


@pytest.fixture(scope="session")
def tiny_qwen3_vl_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight ``tiny-qwen3-vl`` checkpoint (hub layout, float32), made once."""
    from epd_engine.model.make_model import make_model

    model_dir = tmp_path_factory.mktemp("tiny-qwen3-vl")
    make_model("tiny-qwen3-vl", model_dir, seed=0, dtype="float32", show_progress=False)
    return model_dir


@pytest.fixture(scope="session")
def tiny_gemma3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight ``tiny-gemma3`` checkpoint (hub layout, float32), made once."""
    from epd_engine.model.make_model import make_model

    model_dir = tmp_path_factory.mktemp("tiny-gemma3")
    make_model("tiny-gemma3", model_dir, seed=0, dtype="float32", show_progress=False)
    return model_dir


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """``gpu`` tests skip with a reason where no CUDA device exists (never pass silently)."""
    if not any(item.get_closest_marker("gpu") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (torch.cuda.is_available() is False)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)
