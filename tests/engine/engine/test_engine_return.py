"""ED+P on one ED instance: the request is encoded here, parked for P, and its KV comes back
here for decode before P's release of the parked copy arrives (a real race seen under load)."""

from __future__ import annotations

from pathlib import Path

import torch

from epd_engine.config import EngineConfig, Role
from epd_engine.engine.llm_engine import LLMEngine
from epd_engine.inputs.processor import PreparedPrompt
from epd_engine.request import CacheKind, ImageRef, PullSpec, Request
from epd_engine.sampling import SamplingParams


def test_late_release_of_parked_copy_leaves_the_returned_request_running(
    tiny_model_dir: Path,
) -> None:
    engine = LLMEngine(
        EngineConfig(model_dir=tiny_model_dir, role=Role.ED, token_budget=64, image_budget=2)
    )
    mc = engine.model_config
    prompt_ids = [1] + [mc.image_token_index] * mc.num_image_tokens + [5, 6, 7]
    image = ImageRef("hash-a", offset=1, num_tokens=mc.num_image_tokens)
    pixels = [torch.zeros(3, mc.image_size, mc.image_size)]
    params = SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)
    engine.add_request("r", PreparedPrompt(prompt_ids, [image], pixels), params, frozenset())
    engine.step()  # encode; the request now waits for P
    assert [r.request_id for r in engine.take_handoffs()] == ["r"]
    image_pages, _ = engine.exposed_pages("r")
    assert len(image_pages) == 1 and image_pages[0]

    back = Request(
        request_id="r",
        prompt_token_ids=prompt_ids,
        sampling=params,
        images=[image],
        num_encoded_images=1,
        num_computed_tokens=len(prompt_ids),
        output_token_ids=[9],
        pull=PullSpec(CacheKind.KV, "http://p", "p-0"),
    )
    engine.add(back)
    _, stats = engine.step()
    (pull,) = stats.pulls
    assert pull.kv_blocks and pull.num_kv_tokens == len(prompt_ids)
    engine.scheduler.pull_done("r")  # the pages stay as they are: only the lifecycle matters
    engine.release_migrated("r")  # P's late release of the parked image copy
    finished = []
    while engine.has_work():
        events, _ = engine.step()
        finished += [e for e in events if e.finish_reason]
    assert [e.finish_reason for e in finished] == ["length"]
    assert len(back.output_token_ids) == 3
