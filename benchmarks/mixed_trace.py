"""Issue 19's independent mixed trace, shared by ``bench_plan.py`` and ``bench_plan_ab.py``
(imports only what every version of the planner has, so an older tree can run it)."""

from __future__ import annotations

from epd_engine.config import SLO
from epd_engine.contracts.trace import TraceRecord
from epd_engine.workload.arrivals import ArrivalSpec
from epd_engine.workload.distributions import SizeChoice, Uniform
from epd_engine.workload.generators import WorkloadShape, synthesize

MIXED = WorkloadShape(
    "mixed",
    "issue 19: 0-3 images, prompts 20-600, outputs 10-300",
    "issue 19 (independent mixed trace)",
    prompt_tokens=Uniform(20, 600),
    output_tokens=Uniform(10, 300),
    image_sizes=SizeChoice([(640, 480), (1024, 768), (336, 336)]),
    images_per_request=Uniform(0, 3),
)
MIXED_SLO = SLO(ttft_s=0.5, tpot_s=0.04)
MIXED_RATE_RPS = 40.0


def mixed_trace(num: int, seed: int) -> list[TraceRecord]:
    return synthesize(MIXED, num, ArrivalSpec("poisson", MIXED_RATE_RPS), seed=seed)
