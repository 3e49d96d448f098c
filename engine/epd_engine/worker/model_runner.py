"""Executes a SchedulerOutput on a device: encode images, run the LM over a ragged batch, sample.

Owns the tensors behind the page tables: the per-layer KV cache and the image-embedding
cache ``[num_image_blocks, image_block_tokens, image_row_size]`` (a row: the token's
embedding, then Qwen3-VL's DeepStack features, ``model/deepstack.py``).
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Mapping
from dataclasses import dataclass

import torch

from epd_engine.model.attention import AttentionBatch
from epd_engine.model.decode_graphs import DecodeGraphs
from epd_engine.model.deepstack import DeepStackRows, split_rows
from epd_engine.model.graph_buckets import graph_buckets, graph_or_eager, graphs_off_reason
from epd_engine.model.input_buffers import DecodeBuffers
from epd_engine.model.llava import LayerWritten, LlavaLanguage, LlavaVision
from epd_engine.model.mrope import MRopeState
from epd_engine.model.qwen2_vl import Qwen2VLLanguage, Qwen2VLVision
from epd_engine.model.qwen3_vl import Qwen3VLLanguage, Qwen3VLVision
from epd_engine.parallel.kv_staging import KvStaging
from epd_engine.parallel.link import RankLink
from epd_engine.request import PENDING_TOKEN
from epd_engine.sampling import SampledToken, SamplingRow, SamplingSpec
from epd_engine.scheduler.output import EncodeTask, SchedulerOutput, TokenTask
from epd_engine.transfer.backend import CacheRegions
from epd_engine.transfer.memory import CacheMemory, PrivateMemory
from epd_engine.worker.device_copy import to_device
from epd_engine.worker.encode_stream import EncodeStream
from epd_engine.worker.fault_injection import FaultInjector
from epd_engine.worker.sampled_batch import SampledBatch
from epd_engine.worker.sampler import Sampler

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CacheShape:
    num_kv_blocks: int
    kv_block_size: int
    num_image_blocks: int
    image_block_tokens: int
    image_row_size: int  # values per image token: hidden size x (1 + DeepStack levels)


class ModelRunner:
    def __init__(
        self,
        vision: LlavaVision | Qwen2VLVision | Qwen3VLVision | None,
        language: LlavaLanguage | Qwen2VLLanguage | Qwen3VLLanguage | None,
        shape: CacheShape,
        dtype: torch.dtype,
        device: str,
        with_image_cache: bool,
        memory: CacheMemory | None = None,
        max_decode_seqs: int | None = None,
        max_model_len: int | None = None,
        dual_stream: bool = True,
        cuda_graphs: bool = False,
        faults: FaultInjector | None = None,
        ranks: RankLink | None = None,
    ) -> None:
        """``max_decode_seqs`` and ``max_model_len`` (both or neither): size the persistent
        decode buffers for that many decodes of that many tokens; without them every step
        builds its inputs afresh. ``dual_stream``: on CUDA, an instance with both a vision
        tower and a language model encodes on a stream of its own (encode_stream.py).
        ``cuda_graphs``: capture the decode forward per padded batch size
        (``model/decode_graphs.py``) where the device is CUDA and the attention backend is
        graph-safe (FlashInfer); elsewhere it is ignored, with a log line. ``faults``: a
        device fault to inject into serving steps (tests, ``fault_injection.py``). ``ranks``:
        the other ranks of a tensor-parallel instance (``parallel/``), told of every
        language-model call; their collectives cannot be captured, so no CUDA graphs."""
        self.faults = faults or FaultInjector(None)
        self.ranks = ranks
        if ranks is not None and cuda_graphs:
            if torch.device(device).type == "cuda":
                log.info("decode CUDA graphs off: tensor parallel")
            cuda_graphs = False
        self.vision = vision
        self.language = language
        self.shape = shape
        self.dtype = dtype
        self.device = torch.device(device)
        memory = memory or PrivateMemory(self.device)
        # a tensor-parallel rank's KV heads are its own: peers read whole heads from rank 0's
        # staging pages (parallel/kv_staging.py), which take the shared region names
        kv_memory = PrivateMemory(self.device) if ranks is not None else memory
        self.kv_caches: list[torch.Tensor] = (
            language.allocate_kv_cache(shape.num_kv_blocks, shape.kv_block_size, kv_memory)
            if language
            else []
        )
        self.staging: KvStaging | None = None  # set by the engine on rank 0 of several
        self.image_cache: torch.Tensor | None = None
        if with_image_cache:
            self.image_cache = memory.zeros(  # [num_image_blocks, image_block_tokens, row]
                "image",
                (shape.num_image_blocks, shape.image_block_tokens, shape.image_row_size),
                dtype,
            )
        self.sampler = Sampler(self.device)
        # the last launched step's draws by request: where a pending token is read from
        self._drawn: tuple[torch.Tensor, dict[str, int]] | None = None
        # CUDA: the last step's inputs have left the host's staging memory (reused next step)
        self._inputs_sent: torch.cuda.Event | None = None
        self.encode_stream = EncodeStream(
            self.device, dual_stream and vision is not None and language is not None
        )
        self.decode_buffers: DecodeBuffers | None = None
        if language is not None and max_decode_seqs:
            if not max_model_len:
                raise ValueError("max_decode_seqs needs max_model_len")
            max_pages = min(-(-max_model_len // shape.kv_block_size), shape.num_kv_blocks)
            self.decode_buffers = language.decode_buffers(
                max_decode_seqs, max_pages, shape.kv_block_size
            )
        self.graphs: DecodeGraphs | None = None
        if language is not None and cuda_graphs:
            reason = graphs_off_reason(
                cuda_graphs,
                self.device.type,
                getattr(language.attention, "graph_safe", False),
                self.decode_buffers is not None,
            )
            if reason is not None:  # news on a GPU; the normal case on a CPU
                level = logging.INFO if self.device.type == "cuda" else logging.DEBUG
                log.log(level, "decode CUDA graphs off: %s", reason)
            else:
                assert self.decode_buffers is not None
                buckets = graph_buckets(self.decode_buffers.sizes)
                self.graphs = DecodeGraphs(language, self.decode_buffers, self.kv_caches, buckets)
                self.graphs.capture()

    # ---- encode -----------------------------------------------------------------------
    @torch.inference_mode()
    def encode(self, tasks: list[EncodeTask], pixels: list[torch.Tensor]) -> None:
        """Run the vision tower on ``pixels`` (one image each, in the family's form, see
        ``PreparedPrompt``) into the image cache, as one batch."""
        if not tasks:
            return
        assert self.vision is not None and self.image_cache is not None
        with self.encode_stream.encoding():
            batch = [p.to(self.device, self.dtype, non_blocking=True) for p in pixels]
            embeds = self.vision.encode_images(batch)
            for task, embed in zip(tasks, embeds, strict=True):
                self.write_image(task.blocks, embed[: task.num_tokens])
            self.encode_stream.wrote([b for task in tasks for b in task.blocks])

    def write_image(self, blocks: list[int], embed: torch.Tensor) -> None:
        """Scatter one image's rows ``[num_tokens, image_row_size]`` over its pages."""
        assert self.image_cache is not None
        block_tokens = self.shape.image_block_tokens
        for i, block in enumerate(blocks):
            rows = embed[i * block_tokens : (i + 1) * block_tokens]
            self.image_cache[block, : rows.shape[0]] = rows

    def read_image(self, blocks: list[int]) -> torch.Tensor:
        """One image's pages as flat rows ``[len(blocks) * block_tokens, image_row_size]``."""
        assert self.image_cache is not None
        pages = self.image_cache[to_device(blocks, torch.long, self.device)]
        return pages.reshape(-1, self.shape.image_row_size)

    # ---- prefill + decode -------------------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        tasks: list[TokenTask],
        layer_written: LayerWritten | None = None,
        rope_of: Mapping[str, MRopeState] | None = None,
        then_logits: bool = False,
    ) -> torch.Tensor:
        """Hidden states of the last token of every task that samples: ``[S_sample, H]``.

        ``tasks``: decodes first (the attention backends' decode group), then prefills.
        ``rope_of``: M-RoPE state per request (a model with M-RoPE; a request without
        one, such as a timing probe, is positioned as text). ``then_logits``: ``logits``
        follows with ``announced=True`` (a tensor-parallel instance's ranks are told both at
        once).
        """
        if self.ranks is None:
            return self._forward(tasks, layer_written, rope_of)
        self.ranks.forward_starts(tasks, rope_of or {}, then_logits)
        try:
            return self._forward(tasks, layer_written, rope_of)
        except Exception as exc:  # the other ranks may wait in a collective of this call
            raise self.ranks.call_failed(exc) from exc

    def _forward(
        self,
        tasks: list[TokenTask],
        layer_written: LayerWritten | None,
        rope_of: Mapping[str, MRopeState] | None,
    ) -> torch.Tensor:
        assert self.language is not None
        self._await_inputs_sent()
        if self._buffered(tasks):
            return self._forward_decodes(tasks, layer_written, rope_of)
        batch = AttentionBatch(
            query_lens=[t.num_tokens for t in tasks],
            context_lens=[t.start_position + t.num_tokens for t in tasks],
            block_tables=[t.block_table for t in tasks],
            block_size=self.shape.kv_block_size,
            bidirectional=self._image_spans(tasks),
        )
        meta = self.language.prepare(batch)  # once per step; every layer only reads it
        token_ids = [token for task in tasks for token in task.token_ids]
        ids = torch.tensor(token_ids, dtype=torch.long).to(self.device, non_blocking=True)
        self._take_pending(ids, tasks)
        embeds = self.language.embed(ids)  # [T, H]
        hidden_size = embeds.shape[1]
        level_rows: list[int] = []  # DeepStack: the image tokens' rows and their features
        levels: list[torch.Tensor] = []
        for dst, rows in self._image_rows(tasks):
            image_embeds, features = split_rows(rows, hidden_size)
            embeds[dst : dst + rows.shape[0]] = image_embeds
            if features.shape[1]:
                level_rows.extend(range(dst, dst + rows.shape[0]))
                levels.append(features)
        positions = meta.positions
        if self.language.config.uses_mrope:
            positions = _mrope_positions(tasks, rope_of or {}).to(self.device, non_blocking=True)
        self._mark_inputs_sent()
        if levels:
            assert isinstance(self.language, Qwen3VLLanguage)
            deepstack = DeepStackRows(to_device(level_rows, torch.long, self.device),
                                      torch.cat(levels))  # fmt: skip
            hidden = self.language(embeds, positions, self.kv_caches, meta, layer_written,
                                   deepstack)  # fmt: skip
        else:
            hidden = self.language(embeds, positions, self.kv_caches, meta, layer_written)
        ends = itertools.accumulate(batch.query_lens)
        last_rows = [end - 1 for end, t in zip(ends, tasks, strict=True) if t.sample]
        return hidden[to_device(last_rows, torch.long, self.device)]

    def _image_rows(self, tasks: list[TokenTask]) -> list[tuple[int, torch.Tensor]]:
        """The step's image rows ``(first row in the step, rows [n, image_row_size])``, piece
        by piece: read from the image cache, or (a tensor-parallel rank other than 0, which
        has none) received from rank 0 with the step."""
        starts: list[int] = []
        counts: list[int] = []
        read: list[torch.Tensor] = []
        start = 0
        for task in tasks:
            for piece in task.image_slices:
                starts.append(start + piece.dst_start)
                counts.append(piece.num_tokens)
                if self.image_cache is not None:
                    self.encode_stream.before_read(piece.blocks)
                    image = self.read_image(piece.blocks)
                    read.append(image[piece.src_start : piece.src_start + piece.num_tokens])
            start += task.num_tokens
        if not counts:
            return []
        if self.ranks is not None:
            rows = self.ranks.image_rows(
                torch.cat(read) if read else None,
                sum(counts),
                self.shape.image_row_size,
                self.dtype,
            )
            read = list(rows.split(counts))
        return list(zip(starts, read, strict=True))

    def _image_spans(self, tasks: list[TokenTask]) -> list[list[tuple[int, int]]] | None:
        """Each task's image rows as bidirectional spans (absolute positions), for a model
        whose image tokens see each other (Gemma 3; the scheduler keeps images whole)."""
        assert self.language is not None
        if not getattr(self.language.config, "image_attention_bidirectional", False):
            return None
        return [
            [
                (t.start_position + p.dst_start, t.start_position + p.dst_start + p.num_tokens)
                for p in t.image_slices
            ]
            for t in tasks
        ]

    def _buffered(self, tasks: list[TokenTask]) -> bool:
        """A decode-only step that fits the persistent buffers."""
        buffers = self.decode_buffers
        if buffers is None or not 1 <= len(tasks) <= buffers.capacity:
            return False
        block_size = buffers.block_size
        for t in tasks:
            if t.num_tokens != 1 or t.start_position < 1 or t.image_slices:
                return False
            if t.start_position >= buffers.max_pages * block_size:  # needs one page more
                return False
        return True

    def _forward_decodes(
        self,
        tasks: list[TokenTask],
        layer_written: LayerWritten | None,
        rope_of: Mapping[str, MRopeState] | None = None,
    ) -> torch.Tensor:
        """A decode-only step on the persistent buffers, padded to one of their sizes;
        returns the real rows' hidden states (padded rows' are dropped)."""
        assert self.language is not None and self.decode_buffers is not None
        buffers = self.decode_buffers
        rope_positions = None
        if self.language.config.uses_mrope:  # single text tokens: one position each
            rope_positions = _text_positions(tasks, rope_of or {})
        fill = buffers.fill(
            [t.token_ids[0] for t in tasks],
            [t.start_position + 1 for t in tasks],
            [t.block_table for t in tasks],
            rope_positions,
        )
        self._take_pending(buffers.input_ids[: fill.num_seqs], tasks)
        graphs = self.graphs
        bucket = None
        if graphs is not None:
            bucket = graph_or_eager(len(tasks), graphs.buckets, True, layer_written is not None)
        if graphs is not None and bucket is not None:
            assert bucket == fill.rows, (bucket, fill.rows)  # buckets are the buffers' sizes
            graphs.plan(fill)
            self._mark_inputs_sent()
            hidden = graphs.replay(fill)  # [rows, H], overwritten by the next replay
        else:
            meta = self.language.prepare_decode(buffers, fill)  # once per step, buffer views
            self._mark_inputs_sent()
            embeds = self.language.embed(buffers.input_ids[: fill.rows])  # [rows, H]
            hidden = self.language(embeds, meta.positions, self.kv_caches, meta, layer_written)
        if all(t.sample for t in tasks):
            return hidden[: fill.num_seqs]
        sampling = [i for i, t in enumerate(tasks) if t.sample]
        return hidden[to_device(sampling, torch.long, self.device)]

    @property
    def regions(self) -> CacheRegions:
        """The cache tensors as transfer backends see them."""
        kv = self.staging.layers if self.staging is not None else self.kv_caches
        return CacheRegions(kv=kv, image=self.image_cache)

    def execute(
        self,
        out: SchedulerOutput,
        pixels: list[torch.Tensor],
        spec_of: Mapping[str, SamplingSpec],
        layer_written: LayerWritten | None = None,
        rope_of: Mapping[str, MRopeState] | None = None,
    ) -> dict[str, SampledToken]:
        """Run one iteration and wait for its tokens (``launch(...).result()``)."""
        return self.launch(out, pixels, spec_of, layer_written, rope_of).result()

    def launch(
        self,
        out: SchedulerOutput,
        pixels: list[torch.Tensor],
        spec_of: Mapping[str, SamplingSpec],
        layer_written: LayerWritten | None = None,
        rope_of: Mapping[str, MRopeState] | None = None,
    ) -> LaunchedStep:
        """Queue one iteration: the token tasks, then the encodes (whose pages are read from
        the next iteration on). On CUDA the language model's kernels are queued first, so the
        encodes queued next on their own stream run beside them rather than before them
        (a decode step's GPU time hides the host's encode launches). Returns once the encodes
        are done; the tokens may still be on their way (``LaunchedStep.result``). A task whose
        last token is ``PENDING_TOKEN`` reads it from the previous launch's draws."""
        self.faults.before_step()
        try:
            self.encode_stream.step_starts()
            tasks = out.token_tasks
            samples = any(t.sample for t in tasks)
            hidden = self.forward(tasks, layer_written, rope_of, samples) if tasks else None
            self.encode(out.encodes, pixels)
            sampling = [t for t in tasks if t.sample] if hidden is not None else []
            if hidden is None or not sampling:
                return LaunchedStep([], SampledBatch.ready([]))
            assert self.language is not None
            rows = [
                SamplingRow(spec_of[t.request_id], t.start_position + t.num_tokens)
                for t in sampling
            ]
            with torch.inference_mode():
                logits = self.logits(hidden, announced=True)  # [S, V] float32
                drawn = self.sampler.launch(logits, rows)
            ids = [t.request_id for t in sampling]
            if drawn.tokens is not None:
                self._drawn = (drawn.tokens, {rid: i for i, rid in enumerate(ids)})
            return LaunchedStep(ids, drawn)
        finally:
            self.encode_stream.finish()

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor, announced: bool = False) -> torch.Tensor:
        """The LM head over ``forward``'s rows: ``[S, V]`` float32 (every rank's vocabulary
        gathered on a tensor-parallel instance; ``announced``: the forward told the ranks)."""
        assert self.language is not None
        if self.ranks is None:
            return self.language.compute_logits(hidden)
        if not announced:
            self.ranks.logits_start()
        try:
            return self.language.compute_logits(hidden)
        except Exception as exc:
            raise self.ranks.call_failed(exc) from exc

    # ---- async scheduling: a step's inputs while the previous one runs ------------------
    def _take_pending(self, ids: torch.Tensor, tasks: list[TokenTask]) -> None:
        """Write the previous launch's draws over the ``PENDING_TOKEN`` ids of ``tasks``
        (``ids``: the step's token ids on the device, task after task), on the device."""
        rows: list[int] = []
        sources: list[int] = []
        drawn, row_of = self._drawn or (None, {})
        end = 0
        for task in tasks:
            end += task.num_tokens
            if task.token_ids[-1] == PENDING_TOKEN:  # only a sequence's last token can be
                if task.request_id not in row_of:
                    raise RuntimeError(f"no draw in flight for {task.request_id}")
                rows.append(end - 1)
                sources.append(row_of[task.request_id])
        if not rows:
            return
        assert drawn is not None
        index = to_device([rows, sources], torch.long, self.device)
        ids[index[0]] = drawn[index[1]]

    def _mark_inputs_sent(self) -> None:
        """The step's host-to-device copies (buffers, FlashInfer's plan) are queued."""
        if self.device.type == "cuda":
            self._inputs_sent = torch.cuda.Event()
            self._inputs_sent.record()

    def _await_inputs_sent(self) -> None:
        """Before the host writes its staging memory again: the last step's copies out of it
        are done. A synchronous engine has waited for more already; with a step in flight
        this returns as soon as that step's kernels have started."""
        if self._inputs_sent is not None:
            self._inputs_sent.synchronize()
            self._inputs_sent = None


@dataclass
class LaunchedStep:
    """One iteration's draws, by request, possibly still on their way to the host."""

    request_ids: list[str]
    drawn: SampledBatch

    def result(self) -> dict[str, SampledToken]:
        tokens = self.drawn.result()
        return dict(zip(self.request_ids, tokens, strict=True))


def _text_positions(tasks: list[TokenTask], rope_of: Mapping[str, MRopeState]) -> list[int]:
    """The M-RoPE position of each task's one text token (a request without a state, such
    as a timing probe, is positioned as text: at its slot)."""
    positions = []
    for task in tasks:
        state = rope_of.get(task.request_id)
        slot = task.start_position
        positions.append(slot if state is None else state.text_position(slot))
    return positions


def _mrope_positions(tasks: list[TokenTask], rope_of: Mapping[str, MRopeState]) -> torch.Tensor:
    """``[3, T]`` positions of a step's tokens (host tensor), task by task."""
    parts = []
    for task in tasks:
        state = rope_of.get(task.request_id)
        if state is None:
            slots = torch.arange(task.start_position, task.start_position + task.num_tokens)
            parts.append(slots.expand(3, -1))
        else:
            parts.append(state.positions(task.start_position, task.num_tokens))
    return torch.cat(parts, dim=1)
