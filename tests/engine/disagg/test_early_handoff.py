"""KV that moves while prefill runs: a decode instance pulls the layer groups a prefill
instance has already written while that prefill still computes the next layers.

Fault injection: ``EPD_FAULT_LAYER_DELAY_S`` makes every layer of a prefill whose KV
migrates that much slower on its source, so "while prefill runs" lasts long enough to be
seen (a tiny-model layer takes microseconds). Everything else is real: router, instances,
shared-memory transfers, the progress long-poll.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from epd_engine.config import Method, internal_token
from epd_engine.contracts.trace import parse_trace
from tests.engine.disagg.systems import local_system, plan_for
from tests.engine.disagg.workload import CASES, run_all

pytestmark = pytest.mark.slow

LAYER_DELAY_S = 0.2
INTERNAL = {"X-EPD-Token": internal_token()}


def groups_pulled(router_url: str, role: str) -> dict[str, float]:
    """``epd_kv_groups_pulled_total`` summed over the instances of ``role``, by overlap."""
    pools = httpx.get(f"{router_url}/internal/pools", headers=INTERNAL).json()["pools"]
    counts = {"true": 0.0, "false": 0.0}
    for pool in pools.values():
        for instance in pool["instances"]:
            if instance["role"] != role:
                continue
            text = httpx.get(f"{instance['url']}/metrics").text
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name == "epd_kv_groups_pulled_total":
                        counts[sample.labels["overlapped"]] += sample.value
    return counts


@pytest.mark.parametrize("handoff", ["early", "after-prefill"])
def test_kv_layer_groups_move_while_prefill_runs(
    handoff: str, tiny_model_dir: Path, tmp_path: Path, reference: dict[str, str]
) -> None:
    """Defect prevented: KV waited for the whole prefill before the first byte moved (and
    the offer round trip ran after it too), so every migration sat on the request's path.
    With the early hand-off the first layer group lands while the second layer computes;
    ``after-prefill`` (the old behaviour, still selectable) overlaps nothing."""
    plan = plan_for(Method.E_P_D, {})
    env = {"EPD_FAULT_LAYER_DELAY_S": str(LAYER_DELAY_S)}
    args = ("--kv-handoff", handoff)
    with local_system(tiny_model_dir, tmp_path, plan, env, engine_args=args) as system:
        outputs = asyncio.run(run_all(f"{system.spec.router_url}/v1"))
        counts = groups_pulled(system.spec.router_url, "D")
        answer = httpx.get(f"{system.spec.router_url}/v1/trace", headers=INTERNAL)
        trace = parse_trace(answer.text.splitlines())

    assert outputs == reference
    assert len(trace) == len(CASES)
    # the tiny model has two layers and the tests move one per group: two groups a request
    assert counts["true"] + counts["false"] == 2 * len(CASES)
    if handoff == "early":  # the first group of every request moved while layer 2 computed
        assert counts["true"] >= len(CASES), counts
    else:
        assert counts["true"] == 0, counts
