"""An instance's ranks: rank 0 is the engine's own process (scheduler, HTTP server, vision
tower, image cache, sampler); it starts ranks 1..N-1 as child processes
(``rank_main.py``) on the same host and tells them every language-model call it makes.

Two process groups join them. The collective one (NCCL on GPUs, gloo on a CPU) carries the
model's all-reduces, its logits gather and the step's image rows; its timeout
(``rank_timeout_s``) bounds how long a live rank waits for a hung one. The call group (always
gloo) carries the pickled calls (``messages.py``, ``call_channel.py``); the other ranks wait
on it between steps, so its timeout is long (an idle instance), while rank 0 waits
``rank_timeout_s`` for each call to be taken. A rank that dies closes its sockets, so the
others' next collective fails at once rather than at the timeout.

The vision tower and the image cache stay on rank 0: an encoder gains little from tensor
parallelism (a peer measured Qwen2.5-VL-72B's at 492/466/524 ms with TP 2/4/8), and a single
image cache keeps image transfers as they are. Rank 0 sends the image rows a step reads
with the step: at most a prompt's image tokens x the hidden width, once per prefill.
"""

from __future__ import annotations

import logging
import os
import pickle
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from epd_engine.config import EngineConfig
from epd_engine.model.mrope import MRopeState
from epd_engine.parallel import call_channel
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
from epd_engine.parallel.sharding import Shard
from epd_engine.scheduler.output import TokenTask

log = logging.getLogger(__name__)

CALLS_TIMEOUT = timedelta(days=20)  # the other ranks wait this long for rank 0's next call
START_TIMEOUT_S = 300  # for the other ranks' processes to start (import torch)
LOAD_TIMEOUT_S = 1800  # and then to load their slices (a 72B model's from a network volume)
CONFIG_KEY = "engine-config"
_ARRIVED = "arrived/"


SHARE_DEVICE_ENV = "EPD_TP_SHARE_DEVICE"


def sharing_device() -> bool:
    """``EPD_TP_SHARE_DEVICE=1``: every rank on the instance's one GPU, joined by gloo (NCCL
    refuses two ranks on a device). A check of the CUDA path on a one-GPU machine -- gloo
    copies every collective through the host -- never a way to serve."""
    return os.environ.get(SHARE_DEVICE_ENV) == "1"


def rank_device(device: str, rank: int) -> str:
    """Rank ``rank``'s device: the next GPU after the instance's first (``cuda:1`` for rank 1
    of an instance on ``cuda``); every rank of a CPU instance on the CPU."""
    if not device.startswith("cuda") or sharing_device():
        return device
    _, _, index = device.partition(":")
    return f"cuda:{int(index or 0) + rank}"


def arrived(store: Any, rank: int) -> None:
    """Rank ``rank`` has started (imports done) and joins next."""
    store.set(f"{_ARRIVED}{rank}", "1")


def _await_ranks(store: Any, workers: list[subprocess.Popen[bytes]]) -> None:
    """Until every other rank has started (importing torch takes seconds: longer than a
    collective may hang), failing at once when one exits first."""
    keys = [f"{_ARRIVED}{rank}" for rank in range(1, len(workers) + 1)]
    deadline = time.monotonic() + START_TIMEOUT_S
    while not store.check(keys):
        for rank, worker in enumerate(workers, start=1):
            if worker.poll() is not None:
                raise RuntimeError(f"rank {rank} exited with {worker.returncode} as it started")
        if time.monotonic() > deadline:
            raise TimeoutError(f"not every rank started within {START_TIMEOUT_S} s")
        time.sleep(0.1)


def join(
    store: Any, rank: int, config: EngineConfig, vocab_size: int
) -> tuple[TensorParallel, Any]:
    """Join the instance's two groups as ``rank``: (the collective group, the call group)."""
    size = config.tensor_parallel_size
    device = rank_device(config.device, rank)
    backend = "gloo"
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
        backend = "gloo" if sharing_device() else "nccl"
    timeout = timedelta(seconds=config.rank_timeout_s)
    # every rank is on this host: loopback, whatever the host name resolves to in a pod
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    os.environ.setdefault("NCCL_SOCKET_IFNAME", "lo")
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
    calls = dist.new_group(backend="gloo", timeout=CALLS_TIMEOUT)
    return TensorParallel(Shard(rank, size, vocab_size), dist.group.WORLD), calls


class RankLeader:
    """Rank 0's side: starts the others, announces each call, watches them."""

    def __init__(
        self,
        tp: TensorParallel,
        calls: Any,
        workers: list[subprocess.Popen[bytes]],
        store: Any,
        on_lost: Callable[[str], None],
        timeout: timedelta,
    ) -> None:
        self.tp = tp
        self._calls = calls
        self._workers = workers
        self._store = store  # the other ranks' rendezvous: kept open while they run
        self._on_lost = on_lost
        self._timeout = timeout
        self.lost: str | None = None  # why the ranks can no longer run together
        self._closing = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name="epd-ranks", daemon=True)
        self._watcher.start()

    @classmethod
    def start(
        cls, config: EngineConfig, vocab_size: int, on_lost: Callable[[str], None]
    ) -> RankLeader:
        """Start ranks 1..N-1 and join them (they load their slices while rank 0 loads its
        own). ``on_lost(reason)`` is called once, from any thread, when they fall apart."""
        size = config.tensor_parallel_size
        timeout = timedelta(seconds=config.rank_timeout_s)
        store = dist.TCPStore(
            "127.0.0.1", 0, world_size=size, is_master=True, wait_for_workers=False,
            timeout=timeout,
        )  # fmt: skip
        store.set(CONFIG_KEY, pickle.dumps(config))  # type: ignore[arg-type]  # bytes work
        command = [sys.executable, "-m", "epd_engine.parallel.rank_main"]
        workers = [
            subprocess.Popen([*command, str(rank), str(size), str(store.port), str(os.getpid())])
            for rank in range(1, size)
        ]
        try:
            _await_ranks(store, workers)
            tp, calls = join(store, 0, config, vocab_size)
        except Exception as exc:
            _stop(workers, grace_s=0)
            exited = [f"rank {r} exited with {w.poll()}" for r, w in enumerate(workers, 1)
                      if w.poll() is not None]  # fmt: skip
            raise RuntimeError(
                f"the {size} tensor-parallel ranks did not join "
                f"({'; '.join(exited) or 'none exited'}): {exc}"
            ) from exc
        log.info("tensor parallel: %d ranks joined (%s)", size, dist.get_backend())
        return cls(tp, calls, workers, store, on_lost, timeout)

    # ---- calls (engine thread) ----------------------------------------------------------
    def setup(self, setup: RunnerSetup) -> None:
        """Once rank 0 sized its caches; the others take it once they have loaded."""
        self._send(setup, timedelta(seconds=LOAD_TIMEOUT_S))

    def forward_starts(
        self, tasks: list[TokenTask], rope_of: Mapping[str, MRopeState], then_logits: bool
    ) -> None:
        ropes = {t.request_id: rope_of[t.request_id] for t in tasks if t.request_id in rope_of}
        self._send(Forward(tasks, ropes, then_logits))

    def logits_start(self) -> None:
        self._send(Logits())

    def gather_starts(self, pages: Sequence[int]) -> None:
        self._send(GatherPages(tuple(pages)))

    def scatter_starts(self, pages: Sequence[int], layer_start: int, layer_stop: int) -> None:
        self._send(ScatterPages(tuple(pages), layer_start, layer_stop))

    def image_rows(
        self, rows: torch.Tensor | None, count: int, row_size: int, dtype: torch.dtype
    ) -> torch.Tensor:
        assert rows is not None and rows.shape == (count, row_size), "rank 0 reads the rows"
        rows = rows.contiguous()
        dist.broadcast(rows, src=0, group=self.tp.group)
        return rows

    def call_failed(self, exc: BaseException) -> RanksOutOfStep:
        reason = self.lost or f"a call failed on rank 0 after the other ranks began it: {exc}"
        self._lose(reason)
        return RanksOutOfStep(reason)

    def _send(self, message: object, timeout: timedelta | None = None) -> None:
        if self.lost is not None:
            raise RanksOutOfStep(self.lost)
        try:
            call_channel.send(message, self._calls, timeout or self._timeout)
        except Exception as exc:
            raise self.call_failed(exc) from exc

    # ---- lifetime -----------------------------------------------------------------------
    def _watch(self) -> None:
        while not self._closing.wait(0.2):
            for rank, worker in enumerate(self._workers, start=1):
                if (code := worker.poll()) is not None:
                    self._lose(f"tensor-parallel rank {rank} exited with code {code}")
                    return

    def _lose(self, reason: str) -> None:
        if self.lost is not None or self._closing.is_set():
            return
        self.lost = reason
        self._on_lost(reason)

    def close(self) -> None:
        """Tell the other ranks to exit (kill those that do not), leave the groups."""
        if self._closing.is_set():
            return
        lost = self.lost
        self._closing.set()
        if lost is None:
            try:
                call_channel.send(Stop(), self._calls, self._timeout)
            except Exception:
                log.debug("telling the ranks to stop failed", exc_info=True)
        _stop(self._workers)
        dist.destroy_process_group()

    def kill(self) -> None:
        """Kill the other ranks now (before this process exits without cleaning up: a hung
        rank would not follow it otherwise)."""
        self._closing.set()
        for worker in self._workers:
            worker.kill()


def _stop(workers: list[subprocess.Popen[bytes]], grace_s: float = 5.0) -> None:
    for worker in workers:
        try:
            worker.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            worker.kill()
            worker.wait()
