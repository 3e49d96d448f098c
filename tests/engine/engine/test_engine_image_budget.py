"""How the engine turns its image-budget settings into the scheduler's per-iteration image
*token* budget: images of one cache page each (LLaVA-1.5: one 576-token image), tokens as
given, or searched against the SLO in whole probe images."""

from __future__ import annotations

from pathlib import Path

import pytest

from epd_engine.cli import UserError, build_parser
from epd_engine.commands.serve import engine_config
from epd_engine.config import EngineConfig, Role
from epd_engine.engine.llm_engine import LLMEngine


def _budget(
    model_dir: Path, image_budget: int | None = None, image_token_budget: int | None = None
) -> tuple[int, LLMEngine]:
    config = EngineConfig(
        model_dir=model_dir,
        role=Role.E,
        num_image_blocks=16,
        image_budget=image_budget,
        image_token_budget=image_token_budget,
    )
    engine = LLMEngine(config)
    return engine.scheduler.limits.image_token_budget, engine


def test_image_budget_counts_one_cache_page_per_image(tiny_model_dir: Path) -> None:
    tokens, engine = _budget(tiny_model_dir, image_budget=2)
    per_image = engine.model_config.image_page_tokens
    assert per_image == engine.model_config.fixed_image_tokens  # LLaVA: one image a page
    assert tokens == 2 * per_image  # unchanged for LLaVA: two images an iteration


def test_image_token_budget_is_taken_as_given(tiny_qwen2_vl_dir: Path) -> None:
    tokens, _ = _budget(tiny_qwen2_vl_dir, image_token_budget=100)
    assert tokens == 100


def test_searched_budget_is_whole_probe_images(tiny_qwen2_vl_dir: Path) -> None:
    tokens, engine = _budget(tiny_qwen2_vl_dir)
    vision = engine.runner.vision
    assert vision is not None
    probe = vision.tokens_of(vision.probe_pixels())
    assert tokens >= probe and tokens % probe == 0


@pytest.mark.parametrize(
    ("images", "tokens", "message"),
    [
        (2, 100, "not both"),
        (None, 0, "image_token_budget must be >= 1, got 0"),
        (-1, None, "image_budget must be >= 1, got -1"),
    ],
)
def test_bad_image_budgets_are_refused(
    images: int | None, tokens: int | None, message: str
) -> None:
    with pytest.raises(ValueError, match=message):
        EngineConfig(model_dir=Path("unused"), image_budget=images, image_token_budget=tokens)


def test_serve_flags_reach_the_config_and_both_are_a_user_error() -> None:
    parser = build_parser()
    args = parser.parse_args(["serve", "--model", "m", "--image-token-budget", "300"])
    assert engine_config(args).image_token_budget == 300
    flags = ["--image-budget", "2", "--image-token-budget", "300"]
    both = parser.parse_args(["serve", "--model", "m", *flags])
    with pytest.raises(UserError, match="not both"):
        engine_config(both)
