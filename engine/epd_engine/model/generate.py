"""A small greedy reference loop over our model: one sequence, trivially paged cache.

Used by parity tests against transformers and by benchmarks as the single-request
baseline; the engine's runner does the real batching and paging.
"""

from __future__ import annotations

import torch

from epd_engine.model.attention import AttentionBatch, AttentionMetadata
from epd_engine.model.attention_torch import TorchPagedAttention
from epd_engine.model.llava import LlavaLanguage, LlavaVision, scatter_image_embeddings

DEFAULT_BLOCK_SIZE = 16


def single_sequence_metadata(
    block_table: list[int],
    num_cached_tokens: int,
    num_new_tokens: int,
    block_size: int,
) -> AttentionMetadata:
    """Torch-backend metadata for one sequence appending ``num_new_tokens`` after
    ``num_cached_tokens`` (CPU tensors)."""
    batch = AttentionBatch(
        [num_new_tokens], [num_cached_tokens + num_new_tokens], [block_table], block_size
    )
    return TorchPagedAttention().prepare(batch, torch.device("cpu"))


def prompt_embeddings(
    vision: LlavaVision | None,
    language: LlavaLanguage,
    input_ids: list[int],
    pixel_values: torch.Tensor | None,  # [N, 3, S, S]
) -> torch.Tensor:  # [T, H]
    """Token embeddings with every ``<image>`` placeholder replaced by image embeddings."""
    ids = torch.tensor(input_ids, dtype=torch.long, device=language.embed_tokens.weight.device)
    embeds = language.embed(ids)  # [T, H]
    if pixel_values is None:
        return embeds
    if vision is None:
        raise ValueError("pixel_values given but no vision model")
    image_embeds = vision(pixel_values.to(embeds.device, embeds.dtype)).flatten(0, 1)  # [N * I, H]
    return scatter_image_embeddings(
        embeds, ids, image_embeds.to(embeds.device), language.config.image_token_index
    )


@torch.inference_mode()
def greedy_generate(
    vision: LlavaVision | None,
    language: LlavaLanguage,
    input_ids: list[int],
    pixel_values: torch.Tensor | None,
    max_new_tokens: int,
    block_size: int = DEFAULT_BLOCK_SIZE,
) -> list[int]:
    """Argmax decoding; returns only the new tokens, stopping after an EOS (kept, as HF does)."""
    config = language.config
    num_blocks = -(-(len(input_ids) + max_new_tokens) // block_size)
    block_table = list(range(num_blocks))
    kv_caches = language.allocate_kv_cache(num_blocks, block_size)
    device = language.embed_tokens.weight.device

    embeds = prompt_embeddings(vision, language, input_ids, pixel_values)  # [T, H]
    num_cached = 0
    new_tokens: list[int] = []
    while len(new_tokens) < max_new_tokens:
        num_new = embeds.shape[0]
        meta = language.prepare(
            AttentionBatch([num_new], [num_cached + num_new], [block_table], block_size)
        )
        positions = torch.arange(num_cached, num_cached + num_new, device=device)
        hidden = language(embeds, positions, kv_caches, meta)  # [num_new, H]
        logits = language.compute_logits(hidden[-1:])  # [1, V]
        token = int(logits.argmax(dim=-1))
        new_tokens.append(token)
        if token in config.eos_token_ids:
            break
        num_cached += num_new
        embeds = language.embed(torch.tensor([token], device=device))  # [1, H]
    return new_tokens
