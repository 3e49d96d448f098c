"""Ranks 1..N-1: make each language-model call rank 0 announces, on this rank's slice."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.distributed as dist

from epd_engine.model.mrope import MRopeState
from epd_engine.parallel import call_channel
from epd_engine.parallel.kv_staging import receive_page_shards, send_page_shards
from epd_engine.parallel.layers import TensorParallel
from epd_engine.parallel.link import RanksOutOfStep
from epd_engine.parallel.messages import (
    Forward,
    GatherPages,
    Logits,
    RunnerSetup,
    ScatterPages,
    Stop,
)
from epd_engine.scheduler.output import TokenTask
from epd_engine.worker.model_runner import ModelRunner


class RankFollower:
    def __init__(self, tp: TensorParallel, calls: Any, device: torch.device) -> None:
        self.tp = tp
        self._calls = calls
        self._device = device

    def receive(self) -> object:
        """Rank 0's next call (waits as long as the instance is idle)."""
        return call_channel.receive(self._calls)

    def setup(self) -> RunnerSetup:
        message = self.receive()
        if not isinstance(message, RunnerSetup):
            raise RanksOutOfStep(f"rank 0 sent {type(message).__name__} before the setup")
        return message

    def serve(self, runner: ModelRunner) -> None:
        """Until rank 0 stops: every forward, the LM head after those that sample, and the
        page moves of migrations (``kv_staging.py``)."""
        assert runner.language is not None
        hidden: torch.Tensor | None = None
        while True:
            message = self.receive()
            if isinstance(message, Forward):
                hidden = runner.forward(message.tasks, None, message.rope_of)
                if message.then_logits:
                    with torch.inference_mode():
                        runner.language.compute_logits(hidden)
            elif isinstance(message, Logits):
                assert hidden is not None, "logits before any forward"
                with torch.inference_mode():
                    runner.language.compute_logits(hidden)
            elif isinstance(message, GatherPages):
                send_page_shards(runner.kv_caches, message.pages, self.tp.group)
            elif isinstance(message, ScatterPages):
                receive_page_shards(runner.kv_caches, message.pages, message.layer_start,
                                    message.layer_stop, self.tp.group)  # fmt: skip
            elif isinstance(message, Stop):
                return
            else:
                raise RanksOutOfStep(f"rank 0 sent an unknown call {message!r}")

    # ---- RankLink: what this rank's runner asks -------------------------------------------
    def forward_starts(
        self, tasks: list[TokenTask], rope_of: Mapping[str, MRopeState], then_logits: bool
    ) -> None:
        pass  # rank 0 announced it: that is how this rank got here

    def logits_start(self) -> None:
        pass

    def image_rows(
        self, rows: torch.Tensor | None, count: int, row_size: int, dtype: torch.dtype
    ) -> torch.Tensor:
        received = torch.empty(count, row_size, dtype=dtype, device=self._device)
        dist.broadcast(received, src=0, group=self.tp.group)
        return received

    def call_failed(self, exc: BaseException) -> RanksOutOfStep:
        return RanksOutOfStep(f"a call failed on this rank: {exc}")
