"""A second live copy of one request id is refused at admission (issue 12): two copies of
one router attempt reached a decode instance in the fault suite; the first to finish took
the shared sampling parameters with it, and every later step raised ``KeyError`` -- every
request there failed, the ones arriving afterwards too."""

from __future__ import annotations

from pathlib import Path

import pytest

from epd_engine.config import EngineConfig, Role
from epd_engine.engine.llm_engine import LLMEngine
from epd_engine.inputs.processor import PreparedPrompt
from epd_engine.sampling import SamplingParams


def test_a_duplicate_live_request_is_refused_and_the_first_runs_on(tiny_model_dir: Path) -> None:
    engine = LLMEngine(
        EngineConfig(model_dir=tiny_model_dir, role=Role.EPD, token_budget=64, image_budget=2)
    )
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    prompt = PreparedPrompt([1, 5, 6, 7], [], [])
    engine.add_request("r-1", prompt, params, frozenset())
    with pytest.raises(ValueError, match="already running here"):
        engine.add_request("r-1", prompt, params, frozenset())
    finished = []
    while engine.has_work():
        events, _ = engine.step()
        finished += [e.finish_reason for e in events if e.finish_reason]
    assert finished == ["length"]
