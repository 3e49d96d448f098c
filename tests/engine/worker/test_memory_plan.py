"""Memory from the model (issue 31): a GPU instance's KV pages, image cache, activation reserve
and the budget search's largest probe all come from the model's shapes and the card.

Defect: the reserve was a constant 2 GiB (sized for LLaVA-7B) and the search probed
prefills up to the whole context, so a Qwen2.5-VL-7B instance on an 80 GB card planned KV
pages into memory its own 32k-token probe (and a 12.8 MP image's encode) then needed.
The card is simulated (no GPU here): its figures are what ``torch.cuda.mem_get_info``
reports once the weights are loaded. The per-token activation count is an estimate
(activation_reserve.py) to be checked against a GPU run's peak.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from epd_engine.cache.kv_cache import blocks_needed
from epd_engine.model.image_bounds import largest_image_tokens
from epd_engine.model.qwen2_vl_config import Qwen2VLModelConfig
from epd_engine.model.qwen2_vl_preset import QWEN2_5_VL_7B, tensor_specs
from epd_engine.scheduler.budget_search import max_prefill_tokens
from epd_engine.worker.activation_reserve import WORKSPACE_BYTES, StepShapes
from epd_engine.worker.kv_sizing import GpuMemory, kv_blocks_for_memory
from epd_engine.worker.memory_plan import plan_gpu_memory

GB = 10**9
BF16 = 2
FRACTION = 0.9
RELEASED_MAX_PIXELS = 12845056  # Qwen/Qwen2.5-VL-7B-Instruct's preprocessor_config.json


@pytest.fixture(scope="module")
def qwen25_7b(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Qwen2VLModelConfig, int]:
    """The 7B config with the released processor bounds, and its weights' bytes in bf16."""
    model_dir = tmp_path_factory.mktemp("qwen2.5-vl-7b")
    (model_dir / "config.json").write_text(json.dumps(QWEN2_5_VL_7B.hf_config("bfloat16")))
    processor = {"min_pixels": 3136, "max_pixels": RELEASED_MAX_PIXELS, "patch_size": 14}
    (model_dir / "preprocessor_config.json").write_text(json.dumps({**processor, "merge_size": 2}))
    weights = sum(spec.numel for spec in tensor_specs(QWEN2_5_VL_7B)) * BF16
    return model_dir, Qwen2VLModelConfig.from_dir(model_dir), weights


def card(total_bytes: int, weights: int) -> GpuMemory:
    return GpuMemory(total_bytes=total_bytes, free_bytes=total_bytes - weights, held_bytes=weights)


def test_a_7b_qwen25_vl_plans_within_an_80gb_card(
    qwen25_7b: tuple[Path, Qwen2VLModelConfig, int],
) -> None:
    model_dir, config, weights = qwen25_7b
    assert 15 * GB < weights < 17 * GB  # 8.3B parameters
    largest = largest_image_tokens(model_dir, config)
    assert largest == 16384
    image_cache_tokens = blocks_needed(largest, 64) * 64  # the engine's rule: one such image
    memory = card(80 * GB, weights)
    context = config.max_position_embeddings  # 32768
    plan = plan_gpu_memory(
        config, BF16, memory, FRACTION, 16, image_cache_tokens, context, largest,
        prefills=True, encodes=True,
    )  # fmt: skip
    shapes = StepShapes.of(config)
    largest_step = (
        WORKSPACE_BYTES
        + plan.max_prefill_tokens * shapes.prefill_bytes_per_token(BF16)
        + largest * config.merge_unit * shapes.encode_bytes_per_patch(BF16)
    )
    assert largest_step <= plan.reserve_bytes  # the largest probe and image are covered
    assert plan.planned_bytes(memory) <= FRACTION * memory.total_bytes
    # and the plan is still useful: a whole context in KV pages many times over, and
    # probes long enough for any TTFT a 7B prefill can meet
    assert plan.kv_blocks * 16 >= 10 * context
    assert plan.max_prefill_tokens >= 8192

    # the defect: 2 GiB kept, the search probing up to the context window
    old_blocks = kv_blocks_for_memory(memory, plan.kv_block_bytes, FRACTION)
    old_probe = max_prefill_tokens(context, old_blocks, 16)
    old_step = old_probe * shapes.prefill_bytes_per_token(BF16)
    old_total = memory.held_bytes + old_blocks * plan.kv_block_bytes + old_step
    assert old_total > FRACTION * memory.total_bytes


def test_a_smaller_card_probes_shorter_prefills_and_an_encode_only_role_none(
    qwen25_7b: tuple[Path, Qwen2VLModelConfig, int],
) -> None:
    model_dir, config, weights = qwen25_7b
    largest = largest_image_tokens(model_dir, config)
    on_80 = plan_gpu_memory(
        config, BF16, card(80 * GB, weights), FRACTION, 16, 16384, 32768, largest,
        prefills=True, encodes=False,
    )  # fmt: skip
    on_24 = plan_gpu_memory(
        config, BF16, card(24 * GB, weights), FRACTION, 16, 16384, 32768, largest,
        prefills=True, encodes=False,
    )  # fmt: skip
    assert on_24.max_prefill_tokens < on_80.max_prefill_tokens
    assert on_24.planned_bytes(card(24 * GB, weights)) <= FRACTION * 24 * GB
    decode_only = plan_gpu_memory(
        config, BF16, card(80 * GB, weights), FRACTION, 16, 0, 32768, largest,
        prefills=False, encodes=False,
    )  # fmt: skip
    assert decode_only.max_prefill_tokens == 0
    assert decode_only.kv_blocks > on_80.kv_blocks  # nothing kept for steps it never runs
