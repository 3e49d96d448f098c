"""The planner's synthetic references: Qwen3-VL-8B charges what its caches really hold (an
image token's row is the embedding and three DeepStack levels), as the transfer benchmark's
shapes and the engine's image cache do."""

from __future__ import annotations

import pytest

from epd_engine.bench.transfer_shapes import shape_of
from epd_engine.model.qwen3_vl_config import Qwen3VLModelConfig
from epd_engine.model.qwen3_vl_preset import QWEN3_VL_8B
from epd_engine.profiler.cost_model import MigrationCoeffs
from epd_engine.profiler.reference import REFERENCE_MODELS, reference_cost_model


def test_qwen3_vl_reference_moves_the_deepstack_levels():
    config = Qwen3VLModelConfig.from_dict(QWEN3_VL_8B.hf_config("bfloat16"))
    migration = reference_cost_model("qwen3-vl-8b").migration
    assert migration.image_bytes_per_token == config.image_row_size * 2 == 4 * 4096 * 2
    kv_per_token = 2 * config.num_layers * config.num_kv_heads * config.head_dim * 2
    assert migration.kv_bytes_per_token == kv_per_token
    llava = reference_cost_model().migration
    # four times the bytes of a hidden-size-only row of the same width
    image_s = migration.at("image", 1000) - migration.latency_s
    assert image_s == pytest.approx(4 * 1000 * 4096 * 2 / migration.bytes_per_s)
    assert llava.image_bytes_per_token == 4096 * 2


def test_transfer_shapes_carry_the_whole_row():
    config = Qwen3VLModelConfig.from_dict(QWEN3_VL_8B.hf_config("bfloat16"))
    shape = shape_of("qwen3-vl-8b", config, "bfloat16")
    (image,) = shape.image_transfers()
    assert shape.nbytes(image) == 64 * 4 * 4096 * 2  # one 64-token page of 32 KiB rows


def test_unknown_reference_is_a_clear_error():
    assert REFERENCE_MODELS == ("llava-1.5-7b", "qwen3-vl-8b", "gemma3-4b")
    with pytest.raises(ValueError, match="no reference cost model for 'gemma'"):
        reference_cost_model("gemma")


def test_gemma3_reference_moves_only_the_window_of_its_sliding_layers():
    """A KV migration leaves the pages behind the window out for Gemma 3's sliding layers
    (``transfer/plan.py``): the reference charges 5 global layers for every token and the
    29 sliding ones for the last 1,024 tokens, from the preset's shapes."""
    from epd_engine.model.gemma3_config import Gemma3ModelConfig
    from epd_engine.model.gemma3_preset import GEMMA3_4B

    config = Gemma3ModelConfig.from_dict(GEMMA3_4B.hf_config("bfloat16"))
    model = reference_cost_model("gemma3-4b")
    migration = model.migration
    layer = 2 * config.num_kv_heads * config.head_dim * 2
    sliding = sum(w is not None for w in config.layer_windows)
    assert (sliding, config.sliding_window) == (29, 1024)
    assert migration.kv_bytes(512) == 512 * config.num_layers * layer
    assert migration.kv_bytes(8192) == 8192 * 5 * layer + 1024 * 29 * layer
    assert migration.image_bytes_per_token == config.image_row_size * 2
    assert model.capacity.tokens_per_image == config.num_image_tokens
    llava_like = MigrationCoeffs(kv_bytes_per_token=7)
    assert llava_like.kv_bytes(100) == 700  # no window: every token, every layer
