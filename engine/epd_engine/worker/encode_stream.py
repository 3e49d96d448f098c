"""Encode beside the language model: the vision tower on its own CUDA stream (HydraInfer).

On an instance that both encodes and runs the language model, a step's encodes (compute
bound) overlap its prefill/decode (decode is memory bound) instead of running before it.
Ordering is by events on the image cache: each encode records an event for the pages it
wrote, and the language model's stream waits on the events of the pages a prefill reads
(``EncodeFences``, the pure bookkeeping, is the part a CPU can test). A step ends by
waiting on its encodes, so pages are complete before the scheduler, a migration or the
next step sees them. Off CUDA, or with ``dual_stream`` off, everything runs in order on
the current stream and this class does nothing.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Generic, TypeVar

import torch

Fence = TypeVar("Fence")


class EncodeFences(Generic[Fence]):
    """Which not-yet-awaited encode wrote each image-cache page (the latest write wins)."""

    def __init__(self) -> None:
        self._by_page: dict[int, Fence] = {}

    def record(self, pages: list[int], fence: Fence) -> None:
        for page in pages:
            self._by_page[page] = fence

    def fences_for(self, pages: list[int]) -> list[Fence]:
        """What a reader of ``pages`` must wait for (each fence once, in page order)."""
        out: list[Fence] = []
        for page in pages:
            fence = self._by_page.get(page)
            if fence is not None and all(fence is not f for f in out):
                out.append(fence)
        return out

    def drain(self) -> list[Fence]:
        """Every outstanding fence, once; forgets them (the caller waits on them all)."""
        out: list[Fence] = []
        for fence in self._by_page.values():
            if all(fence is not f for f in out):
                out.append(fence)
        self._by_page.clear()
        return out


class EncodeStream:
    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.stream = torch.cuda.Stream(device) if enabled and device.type == "cuda" else None
        self.fences: EncodeFences[torch.cuda.Event] = EncodeFences()
        self._step_start: torch.cuda.Event | None = None

    @property
    def enabled(self) -> bool:
        return self.stream is not None

    def step_starts(self) -> None:
        """Mark the current stream before this step's language-model kernels: the encodes
        of the step wait for what came before, not for those kernels."""
        if self.stream is not None:
            self._step_start = torch.cuda.Event()
            self._step_start.record(torch.cuda.current_stream(self.stream.device))

    @contextlib.contextmanager
    def encoding(self) -> Iterator[None]:
        """Run the block's kernels on the side stream, after the work queued before this
        step (``step_starts``; without it, after everything queued so far)."""
        if self.stream is None:
            yield
            return
        if self._step_start is not None:
            self.stream.wait_event(self._step_start)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.stream.device))
        with torch.cuda.stream(self.stream):
            yield

    def wrote(self, pages: list[int]) -> None:
        """An encode queued on the side stream writes ``pages``."""
        if self.stream is not None:
            event = torch.cuda.Event()
            event.record(self.stream)
            self.fences.record(pages, event)

    def before_read(self, pages: list[int]) -> None:
        """The current stream reads ``pages`` next: order it after their encodes."""
        if self.stream is not None:
            current = torch.cuda.current_stream(self.stream.device)
            for event in self.fences.fences_for(pages):
                current.wait_event(event)

    def finish(self) -> None:
        """The host waits for every encode queued: their pages are complete from now on."""
        self._step_start = None
        for event in self.fences.drain():
            event.synchronize()
