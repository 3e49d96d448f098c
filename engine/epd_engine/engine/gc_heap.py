"""Python's garbage collector in a serving process: the start-up heap frozen, pauses measured.

A full (generation-2) collection walks every tracked object. After start-up an instance
holds about 400,000 of them (torch, transformers, the model's modules), so one pass stops
every thread for 160-210 ms on the 2-core development host, in the middle of a decode step
(one every other batch of 128 requests in ``bench_served``). None of those objects is ever
garbage, so ``freeze_startup_heap`` moves them to the permanent generation, which
collections skip: later passes see only what serving created (vLLM's ``freeze_gc_heap``
does the same after its start-up). ``GcPauses`` times every pass, by generation, for
``/metrics`` (``epd_gc_pause_seconds``), so a TPOT spike can be told apart from the model.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator

from prometheus_client.core import HistogramMetricFamily
from prometheus_client.registry import Collector

PAUSE_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0)
GENERATIONS = (0, 1, 2)


def freeze_startup_heap() -> int:
    """Collect what start-up left behind, then freeze every object alive: returns how many
    are frozen. Call once, when the process is about to serve (a reference cycle still
    uncollected at the freeze would never be freed, hence the collection first)."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class _PauseRecorder:
    """Per generation: how many passes, their total seconds, and a count per bucket.

    Fed from ``gc.callbacks``, which run inside the collection on whatever thread
    triggered it; so no lock here (a prometheus metric's lock, taken by a thread that
    already held it when its allocation set off the pass, would deadlock)."""

    def __init__(self) -> None:
        self.count = dict.fromkeys(GENERATIONS, 0)
        self.sum_s = dict.fromkeys(GENERATIONS, 0.0)
        self.buckets = {g: [0] * len(PAUSE_BUCKETS_S) for g in GENERATIONS}
        self._started = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        pause = time.perf_counter() - self._started
        generation = info["generation"]
        self.count[generation] += 1
        self.sum_s[generation] += pause
        for index, bound in enumerate(PAUSE_BUCKETS_S):
            if pause <= bound:
                self.buckets[generation][index] += 1
                break


_RECORDER: _PauseRecorder | None = None


def pause_recorder() -> _PauseRecorder:
    """The process's one recorder, hooked into the collector on first use."""
    global _RECORDER
    if _RECORDER is None:
        _RECORDER = _PauseRecorder()
        gc.callbacks.append(_RECORDER)
    return _RECORDER


class GcPauses(Collector):
    """``epd_gc_pause_seconds{generation}``: a histogram of the collector's passes, read
    from the process's recorder at each scrape."""

    def __init__(self, labels: dict[str, str]) -> None:
        self._labels = labels
        self._recorder = pause_recorder()

    def collect(self) -> Iterator[HistogramMetricFamily]:
        family = HistogramMetricFamily(
            "epd_gc_pause_seconds",
            "Pauses of Python's garbage collector (every thread stops), by generation.",
            labels=[*self._labels, "generation"],
        )
        recorder = self._recorder
        for generation in GENERATIONS:
            cumulative, buckets = 0, []
            for bound, hits in zip(PAUSE_BUCKETS_S, recorder.buckets[generation], strict=True):
                cumulative += hits
                buckets.append((str(bound), cumulative))
            buckets.append(("+Inf", recorder.count[generation]))
            family.add_metric(
                [*self._labels.values(), str(generation)], buckets, recorder.sum_s[generation]
            )
        yield family
