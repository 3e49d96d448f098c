"""Fixtures for model tests: the tiny checkpoint loaded by us and by transformers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from epd_engine.model.llava import LlavaLanguage, LlavaVision
from epd_engine.model.loader import load_language, load_vision


@pytest.fixture(scope="session")
def processor(tiny_model_dir: Path) -> Any:
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_model_dir, use_fast=False)


@pytest.fixture(scope="session")
def hf_model(tiny_model_dir: Path) -> Any:
    from transformers import LlavaForConditionalGeneration

    return LlavaForConditionalGeneration.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="session")
def vision(tiny_model_dir: Path) -> LlavaVision:
    return load_vision(tiny_model_dir, torch.float32, "cpu")


@pytest.fixture(scope="session")
def language(tiny_model_dir: Path) -> LlavaLanguage:
    return load_language(tiny_model_dir, torch.float32, "cpu")
