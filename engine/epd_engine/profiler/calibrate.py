"""Calibrate a cost model's overheads from one measured run of the live system.

``profile-costs`` times the runner alone; a live instance also runs its engine loop, the
router, HTTP, image decoding and token streaming, and on a shared host waits for the CPU.
From a ``epdctl bench`` report whose requests carry per-stage seconds (``stage_s``, reported
by our servers) this estimates, by medians over requests:

- ``step_s``: measured decode seconds per generated token minus the model's decode step
  for that request (the per-iteration cost the runner does not see);
- ``request_s``: TTFT minus the time the request spent in its stages and stage queues
  before the first token (router + HTTP + preprocessing);
- their empirical quantiles (each inter-token gap minus the model's decode step, each
  request's TTFT excess), which the simulator samples: on a shared host p90 TPOT is made of
  the jitter, which a median cannot reproduce.

Calibrate on one run (e.g. one method at a low rate) and predict the others: the fidelity
benchmark reports errors on runs the calibration never saw.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from statistics import median

from epd_engine.bench.metrics import RequestResult
from epd_engine.profiler.cost_model import FittedCostModel, Overheads

_BEFORE_FIRST_TOKEN = ("encode_queue", "encode", "migration_image", "prefill_queue", "prefill")


def quantiles(values: Sequence[float], num: int = 32) -> tuple[float, ...]:
    """``num`` evenly spaced empirical quantiles (midpoints), or () without data."""
    if not values:
        return ()
    ordered = sorted(values)
    picks = [
        ordered[min(len(ordered) - 1, int((i + 0.5) * len(ordered) / num))] for i in range(num)
    ]
    return tuple(round(x, 6) for x in picks)


def calibrate(
    cost: FittedCostModel, results: Sequence[RequestResult], source: str = ""
) -> FittedCostModel:
    """``cost`` with ``overheads`` fitted to ``results``; ValueError if they carry no stages."""
    measured = [r for r in results if r.ok and r.stage_s]
    if not measured:
        raise ValueError(
            "the run has no per-stage timings (stage_s); calibrate from our own router's bench"
        )
    step_extra = []
    gap_extra = []
    request_extra = []
    for r in measured:
        stages = r.stage_s or {}
        tokens = max(r.num_output_tokens - 1, 0)
        if tokens > 0 and stages.get("decode"):
            context = r.prompt_tokens + r.num_output_tokens // 2
            per_token = stages["decode"] / tokens
            step_extra.append(per_token - cost.decode_s(1, context))
            model_gap = cost.decode_s(1, context)
            gap_extra += [max(0.0, gap - model_gap) for gap in r.itl_s]
        if r.ttft_s is not None:
            staged = sum(stages.get(key, 0.0) for key in _BEFORE_FIRST_TOKEN)
            request_extra.append(r.ttft_s - staged)
    overheads = Overheads(
        request_s=max(0.0, median(request_extra)) if request_extra else 0.0,
        step_s=max(0.0, median(step_extra)) if step_extra else 0.0,
        request_s_quantiles=quantiles([max(0.0, x) for x in request_extra]),
        step_s_quantiles=quantiles(gap_extra),
    )
    meta = dict(cost.meta)
    meta["calibration"] = {
        "source": source,
        "num_requests": len(measured),
        "request_s": overheads.request_s,
        "step_s": overheads.step_s,
    }
    return dataclasses.replace(cost, overheads=overheads, meta=meta)
