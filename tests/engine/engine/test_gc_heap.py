"""The serving processes' garbage collector: start-up's objects frozen, every pause measured.

The defect: a full collection walked the instance's ~400,000 start-up objects (torch,
transformers, the model) and stopped every thread for 160-210 ms in the middle of a decode
step, one every other batch of 128 requests (``bench_served``, 2-core host).
"""

from __future__ import annotations

import gc
import re
import weakref
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from prometheus_client import CollectorRegistry, generate_latest

from epd_engine.engine.gc_heap import GcPauses, freeze_startup_heap
from tests.processes import free_port, running


class Cycle:
    def __init__(self) -> None:
        self.me = self  # only a collection frees it, never its reference count


@pytest.fixture
def unfreeze() -> Iterator[None]:
    yield
    gc.unfreeze()  # this test process's heap is its own again


def test_freeze_frees_startup_garbage_first_then_keeps_live_objects_out_of_passes(
    unfreeze: None,
) -> None:
    garbage = Cycle()
    dead = weakref.ref(garbage)
    del garbage
    live = [Cycle() for _ in range(1000)]
    frozen = freeze_startup_heap()
    assert dead() is None  # collected, not frozen for good
    assert frozen >= len(live)
    tracked = gc.get_objects()  # every object a full pass would walk
    assert not any(obj is live[0] for obj in tracked)
    assert len(tracked) < frozen


def pause_counts(text: str) -> dict[str, float]:
    """``generation -> passes`` from a ``/metrics`` text."""
    pattern = r'epd_gc_pause_seconds_count\{.*generation="(\d)".*\} (\S+)'
    return {g: float(count) for g, count in re.findall(pattern, text)}


def test_pauses_are_counted_by_generation_with_their_seconds() -> None:
    registry = CollectorRegistry()
    registry.register(GcPauses({"model": "m", "role": "EPD", "pool": "p"}))
    before = pause_counts(generate_latest(registry).decode())
    gc.collect(2)
    gc.collect(1)
    text = generate_latest(registry).decode()
    after = pause_counts(text)
    assert after["2"] >= before["2"] + 1
    assert after["1"] >= before["1"] + 1
    total = float(re.search(r'epd_gc_pause_seconds_sum\{.*generation="2".*\} (\S+)', text)[1])
    assert total > 0
    inf = re.search(r'epd_gc_pause_seconds_bucket\{.*generation="2",le="\+Inf".*\} (\S+)', text)
    assert float(inf[1]) == after["2"]  # every pass lands in a bucket


@pytest.mark.slow
def test_the_router_process_freezes_its_startup_heap(tmp_path: Path) -> None:
    """``epdctl router``: its start-up ends with the freeze's full collection, counted."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = ["router", "--model", "m", "--port", str(port), "--log-level", "warning"]
    with running(args, f"{url}/health/live", tmp_path / "router.log"):
        counts = pause_counts(httpx.get(f"{url}/metrics").text)
    assert counts["2"] >= 1
