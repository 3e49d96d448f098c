"""The paged cache path: chunked prefill and ragged batches give one-shot prefill's logits."""

from __future__ import annotations

import pytest
import torch

from epd_engine.model.attention import AttentionBatch
from epd_engine.model.generate import prompt_embeddings, single_sequence_metadata
from epd_engine.model.llava import LlavaLanguage
from tests.engine.model.prompts import build_prompt, make_images

BLOCK_SIZE = 4  # small pages: chunks straddle page boundaries


@pytest.fixture(scope="module")
def image_prompt(processor, vision, language) -> torch.Tensor:  # [T, H]
    inputs = build_prompt(processor, "What is shown in this image?", make_images()[:1])
    ids = inputs["input_ids"][0].tolist()
    with torch.inference_mode():
        return prompt_embeddings(vision, language, ids, inputs["pixel_values"])


def run_chunks(
    language: LlavaLanguage, embeds: torch.Tensor, chunk_sizes: list[int], block_table: list[int]
) -> torch.Tensor:  # [T, V]
    kv_caches = language.allocate_kv_cache(max(block_table) + 1, BLOCK_SIZE)
    logits, start = [], 0
    with torch.inference_mode():
        for size in chunk_sizes:
            meta = single_sequence_metadata(block_table, start, size, BLOCK_SIZE)
            positions = torch.arange(start, start + size)
            hidden = language(embeds[start : start + size], positions, kv_caches, meta)
            logits.append(language.compute_logits(hidden))
            start += size
    return torch.cat(logits)


def test_chunked_prefill_matches_one_shot(language, image_prompt):
    num_tokens = image_prompt.shape[0]
    num_blocks = -(-num_tokens // BLOCK_SIZE)
    one_shot = run_chunks(language, image_prompt, [num_tokens], list(range(num_blocks)))
    # Scattered, out-of-order pages and uneven chunks (the middle one holds image tokens).
    scattered = [3 * i + 2 for i in reversed(range(num_blocks))]
    chunks = [7, 22, num_tokens - 29]
    chunked = run_chunks(language, image_prompt, chunks, scattered)
    torch.testing.assert_close(chunked, one_shot, atol=1e-4, rtol=1e-4)
    # The cache matters: the last chunk alone, without its prefix, gives other logits.
    alone = run_chunks(language, image_prompt[29:], [num_tokens - 29], list(range(num_blocks)))
    assert not torch.allclose(alone[-1], one_shot[-1], atol=1e-2)


def test_ragged_batch_of_prefill_and_decode_matches_separate_runs(language, image_prompt):
    """One flat batch: sequence A's second chunk + sequence B's one-token decode step."""
    num_tokens = image_prompt.shape[0]
    text = language.embed(torch.tensor([1, 55, 81, 300, 412, 9]))  # [6, H]
    a_blocks = list(range(0, 16))
    b_blocks = list(range(16, 20))
    alone_a = run_chunks(language, image_prompt, [num_tokens], a_blocks)
    alone_b = run_chunks(language, text, [6], b_blocks)

    kv_caches = language.allocate_kv_cache(20, BLOCK_SIZE)
    split = 10
    with torch.inference_mode():
        # Step 1: A's first chunk and B's first 5 tokens.
        step1 = language.prepare(
            AttentionBatch([split, 5], [split, 5], [a_blocks, b_blocks], BLOCK_SIZE)
        )
        embeds = torch.cat([image_prompt[:split], text[:5]])
        positions = torch.cat([torch.arange(split), torch.arange(5)])
        language(embeds, positions, kv_caches, step1)
        # Step 2: the rest of A's prompt and B's 6th token (a decode-sized step).
        rest = num_tokens - split
        step2 = language.prepare(
            AttentionBatch([rest, 1], [num_tokens, 6], [a_blocks, b_blocks], BLOCK_SIZE)
        )
        embeds = torch.cat([image_prompt[split:], text[5:]])
        positions = torch.cat([torch.arange(split, num_tokens), torch.tensor([5])])
        hidden = language(embeds, positions, kv_caches, step2)
        logits = language.compute_logits(hidden[[rest - 1, rest]])  # last row of each sequence
    torch.testing.assert_close(logits[0], alone_a[-1], atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(logits[1], alone_b[-1], atol=1e-4, rtol=1e-4)
