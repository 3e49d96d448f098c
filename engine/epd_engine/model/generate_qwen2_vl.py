"""A one-sequence greedy reference loop for Qwen2-VL (and Qwen3-VL) over our paged KV cache.

As ``generate.greedy_generate`` for LLaVA, plus multimodal RoPE: the prompt's ``[3, T]``
positions come from its images' grids, and generated token at KV slot ``n`` sits at
``n + delta`` in all three streams; Qwen3-VL's DeepStack features join the prompt's forward.
Used by parity tests against transformers.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from epd_engine.model.attention import AttentionBatch
from epd_engine.model.deepstack import DeepStackRows, split_rows
from epd_engine.model.generate import DEFAULT_BLOCK_SIZE
from epd_engine.model.llava import scatter_image_embeddings
from epd_engine.model.mrope import Grid, mrope_positions
from epd_engine.model.qwen2_vl import Qwen2VLLanguage, Qwen2VLVision
from epd_engine.model.qwen3_vl import Qwen3VLLanguage, Qwen3VLVision


def prompt_rows(
    vision: Qwen2VLVision | Qwen3VLVision | None,
    language: Qwen2VLLanguage,
    input_ids: list[int],
    pixel_values: torch.Tensor | None,  # [P, C*t*p*p]: every image's patches, in order
    grids: Sequence[Grid],
) -> tuple[torch.Tensor, torch.Tensor, int, DeepStackRows | None]:
    """``(embeds [T, H], positions [3, T], delta, DeepStack features)`` of a prompt; the
    features are None unless the vision tower makes them (Qwen3-VL)."""
    config = language.config
    ids = torch.tensor(input_ids, dtype=torch.long)
    embeds = language.embed(ids)
    deepstack = None
    if pixel_values is not None:
        if vision is None:
            raise ValueError("pixel_values given but no vision model")
        image_rows = vision(pixel_values, grids).to(embeds.device)  # [sum tokens, row]
        image_embeds, levels = split_rows(image_rows, config.hidden_size)
        embeds = scatter_image_embeddings(embeds, ids, image_embeds, config.image_token_index)
        if levels.shape[1]:
            rows = (ids == config.image_token_index).nonzero().flatten().to(embeds.device)
            deepstack = DeepStackRows(rows, levels)
    positions, delta = mrope_positions(
        input_ids, grids, config.image_token_index, config.vision.spatial_merge_size
    )
    return embeds, positions, delta, deepstack


def prompt_inputs(
    vision: Qwen2VLVision | Qwen3VLVision | None,
    language: Qwen2VLLanguage,
    input_ids: list[int],
    pixel_values: torch.Tensor | None,
    grids: Sequence[Grid],
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """``(embeds [T, H], positions [3, T], delta)`` of a prompt."""
    return prompt_rows(vision, language, input_ids, pixel_values, grids)[:3]


@torch.inference_mode()
def greedy_generate(
    vision: Qwen2VLVision | Qwen3VLVision | None,
    language: Qwen2VLLanguage,
    input_ids: list[int],
    pixel_values: torch.Tensor | None,
    grids: Sequence[Grid],
    max_new_tokens: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> list[int]:
    """Argmax decoding; returns only the new tokens, stopping after an EOS (kept)."""
    config = language.config
    num_blocks = -(-(len(input_ids) + max_new_tokens) // block_size)
    block_table = list(range(num_blocks))
    kv_caches = language.allocate_kv_cache(num_blocks, block_size)
    embeds, positions, delta, deepstack = prompt_rows(
        vision, language, input_ids, pixel_values, grids
    )
    num_cached = 0
    new_tokens: list[int] = []
    while len(new_tokens) < max_new_tokens:
        num_new = embeds.shape[0]
        meta = language.prepare(
            AttentionBatch([num_new], [num_cached + num_new], [block_table], block_size)
        )
        if deepstack is None:
            hidden = language(embeds, positions, kv_caches, meta)
        else:  # the prompt's image tokens: only in the first forward
            assert isinstance(language, Qwen3VLLanguage)
            hidden = language(embeds, positions, kv_caches, meta, None, deepstack)
            deepstack = None
        token = int(language.compute_logits(hidden[-1:]).argmax(dim=-1))
        new_tokens.append(token)
        if token in config.eos_token_ids:
            break
        num_cached += num_new
        embeds = language.embed(torch.tensor([token]))
        positions = torch.tensor([num_cached + delta])  # [1]: the same in all three streams
    return new_tokens
