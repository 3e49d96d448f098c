"""Image decoding and the checkpoint's processor in worker processes, off the engine's GIL.

An instance runs its engine thread (the step loop) and each request's preprocessing (image
decoding and resizing, the chat template, tokenizing) in one process, under one GIL: a
request's preprocessing stalls the steps it overlaps. On 2 cores, EPD's decode gaps during
another request's preprocessing averaged 1.7-3.3 ms against 0.9-1.2 ms without
(``docs/planning.md``). With ``--preprocess-workers N`` that work runs in N spawned
processes, each with its own processor; the instance's process keeps the HTTP parsing,
the image fetch and the size checks, and unpickles the prompt (token ids, pixels).
"""

from __future__ import annotations

import asyncio
import multiprocessing
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from epd_engine.inputs.images import ImageLimits, load_image
from epd_engine.inputs.processor import InputProcessor, PreparedPrompt
from epd_engine.model.registry import ModelConfig

_processor: InputProcessor | None = None  # the worker's own (set by ``_start_worker``)


def _start_worker(model_dir: Path, model_config: ModelConfig) -> None:
    import torch

    torch.set_num_threads(1)  # one core's work per request, like the thread it replaces
    global _processor
    _processor = InputProcessor(model_dir, model_config)


def decode_and_prepare(
    processor: InputProcessor,
    messages: list[dict[str, Any]],
    blobs: list[bytes],
    limits: ImageLimits,
) -> PreparedPrompt:
    """A chat prompt's CPU work: decode its images, then run the processor (in a thread of
    the instance, or in a worker of the pool)."""
    return processor.prepare(messages, [load_image(blob, limits) for blob in blobs])


def _prepare(
    messages: list[dict[str, Any]], blobs: list[bytes], limits: ImageLimits
) -> PreparedPrompt:
    assert _processor is not None, "worker not started"
    return decode_and_prepare(_processor, messages, blobs, limits)


class PreprocessPool:
    """``workers`` spawned processes that turn chat messages and image bytes into prompts."""

    def __init__(self, model_dir: Path, model_config: ModelConfig, workers: int) -> None:
        if workers < 1:
            raise ValueError(f"preprocess workers must be at least 1, got {workers}")
        self._pool = ProcessPoolExecutor(
            max_workers=workers,
            mp_context=multiprocessing.get_context("spawn"),  # no fork of a threaded engine
            initializer=_start_worker,
            initargs=(Path(model_dir), model_config),
        )
        self.workers = workers

    async def prepare(
        self, messages: list[dict[str, Any]], blobs: list[bytes], limits: ImageLimits
    ) -> PreparedPrompt:
        """As ``InputProcessor.prepare`` on the decoded images; its ``ClientError`` comes
        back as raised (bad images, placeholders in the text)."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, _prepare, messages, blobs, limits)

    def warm_up(self) -> None:
        """Start every worker now (each loads the processor), not on the first requests."""
        for future in [self._pool.submit(_noop) for _ in range(self.workers)]:
            future.result()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _noop() -> None:
    return None
