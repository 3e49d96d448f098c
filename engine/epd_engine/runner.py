"""Executes a SchedulerOutput on a device: encode images, run the LM over a ragged batch, sample.

Owns the tensors behind the page tables: the per-layer KV cache and the image-embedding
cache ``[num_image_blocks, image_block_tokens, hidden]``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from epd_engine.model.attention import AttentionMetadata
from epd_engine.model.llava import LayerWritten, LlavaLanguage, LlavaVision
from epd_engine.sampling import SamplingParams
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
        self._generators: dict[str, torch.Generator] = {}

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
        """Hidden states of the last token of every task that samples: ``[S_sample, H]``."""
        assert self.language is not None
        block_size = self.shape.kv_block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        for task in tasks:
            for offset, token in enumerate(task.token_ids):
                pos = task.start_position + offset  # absolute position in the sequence
                token_ids.append(token)
                positions.append(pos)
                slots.append(task.block_table[pos // block_size] * block_size + pos % block_size)
            query_start_loc.append(len(token_ids))
        ids = torch.tensor(token_ids, dtype=torch.long, device=self.device)  # [T]
        embeds = self.language.embed(ids)  # [T, H]
        for task, start in zip(tasks, query_start_loc, strict=False):
            for piece in task.image_slices:
                image = self.read_image(piece.blocks)
                rows = image[piece.src_start : piece.src_start + piece.num_tokens]
                dst = start + piece.dst_start
                embeds[dst : dst + piece.num_tokens] = rows
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
            query_start_loc=query_start_loc,
            context_lens=[t.start_position + t.num_tokens for t in tasks],
            block_tables=[t.block_table for t in tasks],
            block_size=block_size,
        )
        position_ids = torch.tensor(positions, dtype=torch.long, device=self.device)  # [T]
        hidden = self.language(embeds, position_ids, self.kv_caches, meta, layer_written)
        last_rows = [query_start_loc[i + 1] - 1 for i, t in enumerate(tasks) if t.sample]
        return hidden[last_rows]

    @torch.inference_mode()
    def sample(
        self, hidden: torch.Tensor, request_ids: list[str], params: list[SamplingParams]
    ) -> list[int]:
        if not request_ids:
            return []
        assert self.language is not None
        logits = self.language.compute_logits(hidden)  # [S, V] float32
        tokens: list[int] = []
        for row, request_id, p in zip(logits, request_ids, params, strict=True):
            if p.greedy:
                tokens.append(int(torch.argmax(row)))
            else:
                tokens.append(self._sample_one(row, request_id, p))
        return tokens

    def _sample_one(self, logits: torch.Tensor, request_id: str, p: SamplingParams) -> int:
        probs = torch.softmax(logits / p.temperature, dim=-1)  # [V]
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_probs, dim=-1) - sorted_probs < p.top_p
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_probs[keep])
        generator = self._generators.get(request_id)
        if generator is None:
            generator = torch.Generator(device=logits.device)
            generator.manual_seed(p.seed if p.seed is not None else torch.seed())
            self._generators[request_id] = generator
        return int(torch.multinomial(probs, 1, generator=generator))

    @property
    def regions(self) -> CacheRegions:
        """The cache tensors as transfer backends see them."""
        return CacheRegions(kv=self.kv_caches, image=self.image_cache)

    def forget(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def execute(
        self,
        out: SchedulerOutput,
        pixels: list[torch.Tensor],
        params_of: dict[str, SamplingParams],
        layer_written: LayerWritten | None = None,
    ) -> dict[str, int]:
        """Run one iteration: encodes first (their pages are read next iteration), then tokens."""
        self.encode(out.encodes, pixels)
        tasks = out.token_tasks
        if not tasks:
            return {}
        hidden = self.forward(tasks, layer_written)
        sampling_ids = [t.request_id for t in tasks if t.sample]
        tokens = self.sample(hidden, sampling_ids, [params_of[r] for r in sampling_ids])
        return dict(zip(sampling_ids, tokens, strict=True))
