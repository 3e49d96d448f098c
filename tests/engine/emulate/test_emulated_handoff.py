"""The emulated loop hands a request on as the engine does: once its local stages are done,
including when they need no work at all (its image was in the encoder cache), and its
events end here without aborting it (it goes on at the target)."""

from __future__ import annotations

import asyncio
from pathlib import Path

from epd_engine.config import SLO, Role
from epd_engine.emulate.costs import EmulatedCosts
from epd_engine.emulate.engine import EmulatedEngine
from epd_engine.emulate.instance_metrics import InstanceMetrics
from epd_engine.emulate.loop import EmulatedLoop
from epd_engine.metrics import Metrics
from epd_engine.request import ImageRef, Request
from epd_engine.sampling import SamplingParams
from epd_engine.scheduler import RequestEvent
from epd_engine.scheduler.output import PullTask

REPO = Path(__file__).resolve().parents[3]
COST_MODEL = REPO / "benchmarks" / "results" / "cost-model-h200.json"


class Recorder:
    def __init__(self) -> None:
        self.handed: list[str] = []
        self.arrived = asyncio.Event()

    def on_pull(self, task: PullTask) -> None:
        raise AssertionError("an encode instance pulls nothing here")

    def on_handoff(self, request: Request) -> None:
        self.handed.append(request.request_id)
        self.arrived.set()

    def on_evicted(self, request_id: str) -> None:
        raise AssertionError("nothing is evicted here")


def image_request(request_id: str) -> Request:
    tokens = 576
    return Request(
        request_id=request_id,
        prompt_token_ids=[0] * tokens + [7, 8],
        sampling=SamplingParams(max_tokens=4, ignore_eos=True),
        images=[ImageRef("same-picture", 0, tokens)],
    )


async def _encode_twice() -> tuple[list[str], list[list[RequestEvent]]]:
    costs = EmulatedCosts.load(COST_MODEL)
    engine = EmulatedEngine(Role.E, costs, SLO())
    loop = EmulatedLoop(engine, InstanceMetrics(Metrics("m-emulated", "E", "p"), engine))
    handoffs = Recorder()
    loop.handoffs = handoffs
    loop.start()
    seen: list[list[RequestEvent]] = []
    try:
        for request_id in ("first", "second"):  # the second finds its image encoded
            handoffs.arrived.clear()
            events = [e async for e in loop.generate(image_request(request_id))]
            await asyncio.wait_for(handoffs.arrived.wait(), timeout=2)
            assert request_id in engine.scheduler.migrating  # parked, not aborted
            loop.release(request_id)  # the target pulled it
            seen.append(events)
    finally:
        await loop.stop()
    return handoffs.handed, seen


def test_a_request_whose_image_is_cached_is_handed_on_without_a_step() -> None:
    handed, events = asyncio.run(asyncio.wait_for(_encode_twice(), timeout=10))
    assert handed == ["first", "second"]
    assert events == [[], []]  # an encode instance samples no token
