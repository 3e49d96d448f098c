"""Executes a SchedulerOutput on a device: encode images, run the LM over a ragged batch, sample.

Owns the tensors behind the page tables: the per-layer KV cache and the image-embedding
cache ``[num_image_blocks, image_block_tokens, hidden]``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from epd_engine.model.attention import AttentionBatch
from epd_engine.model.llava import LayerWritten, LlavaLanguage, LlavaVision
from epd_engine.sampler import Sampler
from epd_engine.sampling import SampledToken, SamplingRow, SamplingSpec
from epd_engine.scheduler.output import EncodeTask, SchedulerOutput, TokenTask
from epd_engine.transfer.backend import CacheRegions
from epd_engine.transfer.memory import CacheMemory, PrivateMemory


@dataclass(frozen=True)
class CacheShape:
    num_kv_blocks: int
    kv_block_size: int
    num_image_blocks: int
    image_block_tokens: int
    hidden_size: int


class ModelRunner:
    def __init__(
        self,
        vision: LlavaVision | None,
        language: LlavaLanguage | None,
        shape: CacheShape,
        dtype: torch.dtype,
        device: str,
        with_image_cache: bool,
        memory: CacheMemory | None = None,
    ) -> None:
        self.vision = vision
        self.language = language
        self.shape = shape
        self.dtype = dtype
        self.device = torch.device(device)
        memory = memory or PrivateMemory(self.device)
        self.kv_caches: list[torch.Tensor] = (
            language.allocate_kv_cache(shape.num_kv_blocks, shape.kv_block_size, memory)
            if language
            else []
        )
        self.image_cache: torch.Tensor | None = None
        if with_image_cache:
            self.image_cache = memory.zeros(  # [num_image_blocks, image_block_tokens, H]
                "image",
                (shape.num_image_blocks, shape.image_block_tokens, shape.hidden_size),
                dtype,
            )
        self.sampler = Sampler(self.device)

    # ---- encode -----------------------------------------------------------------------
    @torch.inference_mode()
    def encode(self, tasks: list[EncodeTask], pixels: list[torch.Tensor]) -> None:
        """Run the vision tower on ``pixels`` (one [3, H, W] per task) into the image cache."""
        if not tasks:
            return
        assert self.vision is not None and self.image_cache is not None
        batch = torch.stack(pixels).to(self.device, self.dtype)  # [N, 3, H, W]
        embeds = self.vision(batch)  # [N, num_image_tokens, H]
        for task, embed in zip(tasks, embeds, strict=True):
            self.write_image(task.blocks, embed[: task.num_tokens])

    def write_image(self, blocks: list[int], embed: torch.Tensor) -> None:
        """Scatter one image's rows ``[num_tokens, H]`` over its pages."""
        assert self.image_cache is not None
        block_tokens = self.shape.image_block_tokens
        for i, block in enumerate(blocks):
            rows = embed[i * block_tokens : (i + 1) * block_tokens]
            self.image_cache[block, : rows.shape[0]] = rows

    def read_image(self, blocks: list[int]) -> torch.Tensor:
        """One image's pages as a flat ``[len(blocks) * block_tokens, H]`` view."""
        assert self.image_cache is not None
        return self.image_cache[blocks].reshape(-1, self.shape.hidden_size)

    # ---- prefill + decode -------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self, tasks: list[TokenTask], layer_written: LayerWritten | None = None
    ) -> torch.Tensor:
        """Hidden states of the last token of every task that samples: ``[S_sample, H]``.

        ``tasks``: decodes first (the attention backends' decode group), then prefills.
        """
        assert self.language is not None
        batch = AttentionBatch(
            query_lens=[t.num_tokens for t in tasks],
            context_lens=[t.start_position + t.num_tokens for t in tasks],
            block_tables=[t.block_table for t in tasks],
            block_size=self.shape.kv_block_size,
        )
        meta = self.language.prepare(batch)  # once per step; every layer only reads it
        token_ids = [token for task in tasks for token in task.token_ids]
        ids = torch.tensor(token_ids, dtype=torch.long).to(self.device, non_blocking=True)
        embeds = self.language.embed(ids)  # [T, H]
        start = 0
        for task in tasks:
            for piece in task.image_slices:
                image = self.read_image(piece.blocks)
                rows = image[piece.src_start : piece.src_start + piece.num_tokens]
                dst = start + piece.dst_start
                embeds[dst : dst + piece.num_tokens] = rows
            start += task.num_tokens
        hidden = self.language(embeds, meta.positions, self.kv_caches, meta, layer_written)
        ends = itertools.accumulate(batch.query_lens)
        last_rows = [end - 1 for end, t in zip(ends, tasks, strict=True) if t.sample]
        return hidden[last_rows]

    @torch.inference_mode()
    def sample(self, hidden: torch.Tensor, rows: list[SamplingRow]) -> list[SampledToken]:
        """One batched pass over the logits of ``hidden`` ``[S, H]``, one row each."""
        if not rows:
            return []
        assert self.language is not None
        return self.sampler(self.language.compute_logits(hidden), rows)  # [S, V] float32

    @property
    def regions(self) -> CacheRegions:
        """The cache tensors as transfer backends see them."""
        return CacheRegions(kv=self.kv_caches, image=self.image_cache)

    def execute(
        self,
        out: SchedulerOutput,
        pixels: list[torch.Tensor],
        spec_of: Mapping[str, SamplingSpec],
        layer_written: LayerWritten | None = None,
    ) -> dict[str, SampledToken]:
        """Run one iteration: encodes first (their pages are read next iteration), then tokens."""
        self.encode(out.encodes, pixels)
        tasks = out.token_tasks
        if not tasks:
            return {}
        hidden = self.forward(tasks, layer_written)
        sampling = [t for t in tasks if t.sample]
        rows = [
            SamplingRow(spec_of[t.request_id], t.start_position + t.num_tokens) for t in sampling
        ]
        tokens = self.sample(hidden, rows)
        return {t.request_id: token for t, token in zip(sampling, tokens, strict=True)}
