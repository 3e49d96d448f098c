"""M-RoPE cos/sin from tables made once (``MRopeTables``): the same angles as the rule
written out pair by pair, and one set of tables per model and device, not one per forward
(built per forward, the stream index was a host-to-device copy in every step, which on a
GPU blocks until the device is idle: ``test_engine_cuda.py`` checks that on a GPU)."""

from __future__ import annotations

import math
from pathlib import Path

import torch

from epd_engine.model.attention import AttentionBatch
from epd_engine.model.loader import load_language
from epd_engine.model.mrope import MRopeTables, interleaved_streams, mrope_cos_sin


def test_each_rotary_pair_reads_its_sections_stream() -> None:
    head_dim, theta, section = 16, 10_000.0, (2, 3, 3)  # 8 pairs: t t h h h w w w
    positions = torch.tensor([[0, 5, 9], [1, 7, 2], [4, 3, 8]])  # [3, T]: t, h, w
    tables = MRopeTables.build(head_dim, theta, section, torch.device("cpu"))
    cos, sin = mrope_cos_sin(positions, tables, torch.float64)
    streams = [0] * section[0] + [1] * section[1] + [2] * section[2]
    for token in range(positions.shape[1]):
        for pair, stream in enumerate(streams):
            angle = int(positions[stream, token]) / theta ** (2 * pair / head_dim)
            for column in (pair, pair + head_dim // 2):  # both halves alike
                assert math.isclose(cos[token, column], math.cos(angle), rel_tol=1e-5)
                assert math.isclose(sin[token, column], math.sin(angle), abs_tol=1e-5)


def test_a_model_builds_its_tables_once(tiny_qwen2_vl_dir: Path) -> None:
    language = load_language(tiny_qwen2_vl_dir, torch.float32, "cpu")
    kv = language.allocate_kv_cache(4, 16)
    for step in range(2):
        batch = AttentionBatch([1], [step + 1], [[0]], 16)
        meta = language.prepare(batch)
        embeds = language.embed(torch.tensor([5]))
        language(embeds, torch.tensor([step]), kv, meta)
        if step == 0:
            first = language._rope_tables
    assert first is not None and language._rope_tables is first


def test_interleaved_sections_follow_transformers_qwen3_vl() -> None:
    """Qwen3-VL: the pairs' streams are transformers' ``apply_interleaved_mrope`` layout."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    for section in ((24, 20, 20), (4, 2, 2)):
        freqs = torch.stack([torch.full((1, 1, sum(section)), float(s)) for s in range(3)])
        theirs = Qwen3VLTextRotaryEmbedding.apply_interleaved_mrope(None, freqs, section)  # type: ignore[arg-type]
        assert interleaved_streams(section).tolist() == theirs.flatten().long().tolist()
    assert interleaved_streams((4, 2, 2)).tolist() == [0, 1, 2, 0, 1, 2, 0, 0]
