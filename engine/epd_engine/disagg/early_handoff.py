"""KV that moves while prefill runs (DESIGN.md §4, "early hand-off").

An instance that prefills but does not decode offers each request to a decode instance when
its prefill *starts*. The target pre-admits it (its pages are allocated as for any pull: it
admits only what its pages hold) and long-polls the source for progress; each layer group
is pulled as soon as every layer in it holds the whole prefill, while later layers still
compute. When prefill ends the answer carries ``PrefillDone`` (the sampled token, the text
sent so far), so the last group is all that is left to move. The source frees its pages only
when the target releases them, as in the plain pull.

Source side: ``PrefillWatch`` (one per request offered early). The engine thread writes it
after every layer; the event loop answers polls from it. Target side: ``pull_groups``.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Protocol

import torch

from epd_engine.cache.kv_cache import blocks_needed
from epd_engine.contracts.routing_policy import InstanceLoad
from epd_engine.scheduler.output import PullTask
from epd_engine.transfer.backend import PageTransfer, TransferError
from epd_engine.transfer.messages import PrefillDone, PrefillProgress
from epd_engine.transfer.plan import kv_transfers

# A target gives up on a source whose prefill shows no progress for this long.
STALL_TIMEOUT_S = 60.0
POLL_WAIT_S = 10.0  # one long-poll's wait at the source
ENDED_KEPT_S = 30.0  # an ended watch answers polls this long, then is forgotten


class PrefillWatch:
    """A request offered early, as its source sees it.

    ``written`` and ``pages`` are written by the engine thread (plain list/tuple stores,
    atomic in CPython); ``changed`` is then called on the event loop, which wakes pollers.
    """

    def __init__(self, request_id: str, num_layers: int, loop: asyncio.AbstractEventLoop):
        self.request_id = request_id
        self.written = [0] * num_layers
        self.pages: tuple[int, ...] = ()
        self.chunk_end = 0  # tokens written once the running chunk passes a layer
        self.done: PrefillDone | None = None
        self.ended = False
        self.target: asyncio.Future[InstanceLoad | None] = loop.create_future()  # who took it
        self._version = 0
        self._event = asyncio.Event()

    def changed(self) -> None:
        """Event loop only."""
        self._version += 1
        self._event.set()
        self._event = asyncio.Event()

    def answer(self) -> PrefillProgress:
        return PrefillProgress(
            version=self._version,
            written=list(self.written),
            pages=list(self.pages),
            done=self.done,
            ended=self.ended,
        )

    async def newer_than(self, version: int, wait_s: float = POLL_WAIT_S) -> PrefillProgress:
        """The state once it is newer than ``version`` (or after ``wait_s``, unchanged)."""
        if self._version <= version:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._event.wait(), wait_s)
        return self.answer()


class DeviceEvent(Protocol):
    def synchronize(self) -> None: ...


def record_layer_event(device: torch.device) -> DeviceEvent | None:
    """On a GPU, an event after the kernels queued so far (a layer's K/V writes): the layer
    is written when it completes, not when ``layer_written`` is called. None on a CPU."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def publish_layer(layer: int, ends: list[tuple[PrefillWatch, int]]) -> None:
    for watch, chunk_end in ends:
        watch.written[layer] = chunk_end


async def publish_layer_when_done(
    event: DeviceEvent, layer: int, ends: list[tuple[PrefillWatch, int]]
) -> None:
    """Event loop: publish a layer once its GPU work is done (waited for off the loop), so
    a target never pulls pages the source's kernels are still writing."""
    await asyncio.to_thread(event.synchronize)
    publish_layer(layer, ends)
    for watch, _ in ends:
        watch.changed()


class SourceEnded(Exception):
    """The source finished or aborted the request before handing it on: drop our copy."""


Poll = Callable[[int], Awaitable[PrefillProgress]]
Pull = Callable[[PageTransfer], Awaitable[None]]


def layer_groups(num_layers: int, layers_per_group: int) -> list[tuple[int, int]]:
    step = max(1, layers_per_group)
    return [(lo, min(lo + step, num_layers)) for lo in range(0, num_layers, step)]


async def pull_groups(
    task: PullTask,
    groups: list[tuple[int, int]],
    block_size: int,
    poll: Poll,
    pull: Pull,
    layer_windows: Sequence[int | None] = (),
) -> tuple[PrefillDone, float, int]:
    """Target side: pull every layer group of ``task`` as soon as the source has written it
    (a sliding-window layer's pages from its window's first page: ``plan.kv_transfers``).

    Returns the source's ``PrefillDone``, when it was seen (monotonic) and how many groups
    were pulled before it (moved while prefill ran). Raises ``SourceEnded`` when the source
    ended the request, ``TransferError`` when the source stalls or answers nonsense.
    """
    pending = list(groups)
    needed = blocks_needed(task.num_kv_tokens, block_size)
    num_layers = groups[-1][1] if groups else 0
    version, overlapped = -1, 0
    last_change = time.monotonic()
    done_seen_s: float | None = None
    while True:
        progress = await poll(version)
        if progress.ended:
            raise SourceEnded(task.request_id)
        if len(progress.written) != num_layers:
            raise TransferError(
                f"the source has {len(progress.written)} layers; this instance {num_layers}"
            )
        if progress.done is not None and done_seen_s is None:
            done_seen_s = time.monotonic()
        if progress.version != version:
            version, last_change = progress.version, time.monotonic()
        elif time.monotonic() - last_change > STALL_TIMEOUT_S:
            raise TransferError(f"no prefill progress on {task.request_id} for {STALL_TIMEOUT_S} s")
        for lo, hi in list(pending):
            if min(progress.written[lo:hi]) < task.num_kv_tokens:
                continue
            if len(progress.pages) < needed or len(task.kv_blocks) < needed:
                raise TransferError(
                    f"{task.num_kv_tokens} tokens need {needed} KV pages; the source has "
                    f"{len(progress.pages)}, {len(task.kv_blocks)} were allocated here"
                )
            # pages in this instance's prefix cache, or behind a sliding window: not pulled
            for transfer in kv_transfers(task, progress.pages, lo, hi, block_size, layer_windows):
                await pull(transfer)
            pending.remove((lo, hi))
            overlapped += progress.done is None
        if progress.done is not None and not pending:
            assert done_seen_s is not None
            if progress.done.num_computed_tokens != task.num_kv_tokens:
                raise TransferError(
                    f"prefill of {task.request_id} computed {progress.done.num_computed_tokens} "
                    f"tokens; {task.num_kv_tokens} were offered"
                )
            return progress.done, done_seen_s, overlapped
