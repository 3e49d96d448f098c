"""A one-sequence greedy reference loop for Gemma 3 over our paged KV cache.

As ``generate.greedy_generate`` for LLaVA, plus the prompt's image spans: its image tokens
attend to each other both ways in the prefill (transformers' ``token_type_ids`` mask).
Used by parity tests against transformers.
"""

from __future__ import annotations

import torch

from epd_engine.model.attention import AttentionBatch
from epd_engine.model.gemma3 import Gemma3Language, Gemma3Vision
from epd_engine.model.generate import DEFAULT_BLOCK_SIZE
from epd_engine.model.image_spans import image_spans
from epd_engine.model.llava import scatter_image_embeddings


def prompt_embeds(
    vision: Gemma3Vision | None,
    language: Gemma3Language,
    input_ids: list[int],
    pixel_values: torch.Tensor | None,  # [N, C, S, S]
) -> torch.Tensor:
    """``[T, H]``: scaled token embeddings, image placeholders replaced by image rows."""
    ids = torch.tensor(input_ids, dtype=torch.long)
    embeds = language.embed(ids)
    if pixel_values is None:
        return embeds
    if vision is None:
        raise ValueError("pixel_values given but no vision model")
    image_rows = vision(pixel_values).flatten(0, 1).to(embeds.device)  # [N * tokens, H]
    return scatter_image_embeddings(embeds, ids, image_rows, language.config.image_token_index)


@torch.inference_mode()
def greedy_generate(
    vision: Gemma3Vision | None,
    language: Gemma3Language,
    input_ids: list[int],
    pixel_values: torch.Tensor | None,
    max_new_tokens: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> list[int]:
    """Argmax decoding; returns only the new tokens, stopping after an EOS (kept)."""
    config = language.config
    num_blocks = -(-(len(input_ids) + max_new_tokens) // block_size)
    block_table = list(range(num_blocks))
    kv_caches = language.allocate_kv_cache(num_blocks, block_size)
    embeds = prompt_embeds(vision, language, input_ids, pixel_values)
    spans: list[list[tuple[int, int]]] | None = [image_spans(input_ids, config.image_token_index)]
    num_cached = 0
    new_tokens: list[int] = []
    while len(new_tokens) < max_new_tokens:
        num_new = embeds.shape[0]
        batch = AttentionBatch([num_new], [num_cached + num_new], [block_table], block_size, spans)
        meta = language.prepare(batch)
        positions = torch.arange(num_cached, num_cached + num_new)
        hidden = language(embeds, positions, kv_caches, meta)
        token = int(language.compute_logits(hidden[-1:]).argmax(dim=-1))
        new_tokens.append(token)
        if token in config.eos_token_ids:
            break
        num_cached += num_new
        embeds = language.embed(torch.tensor([token]))
        spans = None  # only the prompt has images
    return new_tokens
