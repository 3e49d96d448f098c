"""The plan search chooses a tensor-parallel size per stage (issue 34, item 3): candidates at
every allowed size within the GPU budget, each pool costed at its size
(``tensor_parallel.sized``), plans that carry the sizes, and ``epdctl plan`` refusing what
the cost model cannot project. The reference cost model (LLaVA-1.5-7B, NVLink) is the
model; its projection is the subject of ``test_tensor_parallel_costs.py``."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from pydantic import ValidationError

from epd_engine.cli import main
from epd_engine.config import SLO, Method, Role, Stage
from epd_engine.contracts.plan import Plan
from epd_engine.contracts.trace import write_trace
from epd_engine.profiler.candidates import Candidate, enumerate_candidates
from epd_engine.profiler.cost_model import FittedCostModel, load_cost_model, save_cost_model
from epd_engine.profiler.reference import reference_cost_model
from epd_engine.profiler.search import plan_from_search, search_plans
from epd_engine.profiler.tensor_parallel import sized

from .factories import make_trace

REFERENCE = reference_cost_model()
# 3,000-token prompts with an image: one rank prefills one in ~0.3 s, two in ~0.17 s
LONG_PROMPTS = make_trace(num=200, rate_rps=4, prompt_tokens=3000, image_tokens=576,
                          output_tokens=20)  # fmt: skip
# short prompts, long answers, a loose TTFT: what counts is tokens per GPU
CHATTY = make_trace(num=200, rate_rps=20, prompt_tokens=50, image_tokens=576, output_tokens=200)
METHODS = (Method.E_P_D, Method.EP_D)


def best_plan(records: list, slo: SLO, num_gpus: int = 4) -> Plan:
    evaluator, exhaustive, _ = search_plans(
        records, REFERENCE, slo, num_gpus, methods=METHODS, with_heuristic=False,
        show_progress=False, tp_sizes=(1, 2),
    )  # fmt: skip
    plan = plan_from_search(evaluator, exhaustive, None, slo)
    assert plan is not None
    return plan


def test_prefill_latency_bound_ttft_splits_the_prefill_pool_and_never_the_encoder() -> None:
    plan = best_plan(LONG_PROMPTS, SLO(ttft_s=0.3, tpot_s=0.1))
    prefill_role = plan.method.role_for(Stage.PREFILL)
    assert plan.size_of(prefill_role) == 2, plan.describe()
    assert all(plan.size_of(r) == 1 for r in plan.method.roles if not r.needs_language)
    assert plan.budgets[prefill_role] is not None
    assert "4 GPUs" in plan.reason


def test_throughput_bound_plans_keep_one_rank_per_instance() -> None:
    plan = best_plan(CHATTY, SLO(ttft_s=4.0, tpot_s=0.1))
    assert plan.tensor_parallel == {}, plan.describe()


def test_candidates_use_exactly_the_budget_and_split_only_language_pools() -> None:
    plain = enumerate_candidates(4, [Method.E_P_D])
    assert plain == enumerate_candidates(4, [Method.E_P_D], (1,))
    assert all(c.sizes == () for c in plain) and len(plain) == 3  # C(3, 2)
    sized_ones = enumerate_candidates(4, [Method.E_P_D], (1, 2))
    assert all(c.num_gpus == 4 for c in sized_ones)
    assert all(c.size_of(Role.E) == 1 for c in sized_ones)
    assert {c.describe() for c in sized_ones} - {c.describe() for c in plain} == {
        "E+P+D 1E 1Px2 1D", "E+P+D 1E 1P 1Dx2",
    }  # fmt: skip
    assert Candidate(Method.EPD, (2,), (4,)).num_gpus == 8


def test_a_pool_at_two_ranks_prefills_faster_and_holds_more_pages() -> None:
    two = sized(REFERENCE, 2)
    assert two.prefill_s(3000) < 0.6 * REFERENCE.prefill_s(3000)
    assert two.capacity.num_kv_blocks > 2 * REFERENCE.capacity.num_kv_blocks
    assert two.encode == REFERENCE.encode  # the encoder runs whole on rank 0
    assert sized(REFERENCE, 1) is REFERENCE


def test_sizes_the_cost_model_cannot_project_are_refused() -> None:
    with pytest.raises(ValueError, match="sizes: 1, 2, 4"):
        sized(reference_cost_model("gemma3-4b"), 8)  # 8 heads over 4 KV heads
    with pytest.raises(ValueError, match="records no tensor-parallel terms"):
        sized(replace(REFERENCE, ranks=None), 2)


def test_plans_carry_valid_sizes_only() -> None:
    pools = {Role.E: 1, Role.P: 1, Role.D: 1}
    plan = Plan(method=Method.E_P_D, pools=pools, tensor_parallel={Role.P: 2})
    assert plan.describe() == "E+P+D 1E 1Px2 1D"
    assert Plan.model_validate_json(plan.model_dump_json()) == plan
    for bad, message in (({Role.E: 2}, "runs no language model"), ({Role.P: 3}, "one of 1, 2"),
                         ({Role.PD: 2}, "not in the method")):  # fmt: skip
        with pytest.raises(ValidationError, match=message):
            Plan(method=Method.E_P_D, pools=pools, tensor_parallel=bad)


def test_the_cost_model_file_keeps_its_rank_terms(tmp_path: Path) -> None:
    path = save_cost_model(REFERENCE, tmp_path / "cost.json")
    assert load_cost_model(path).ranks == REFERENCE.ranks
    assert FittedCostModel.from_dict({**REFERENCE.to_dict(), "ranks": None}).ranks is None


def test_epdctl_plan_searches_sizes_and_refuses_what_it_cannot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = write_trace(LONG_PROMPTS, tmp_path / "trace.jsonl")
    out = tmp_path / "plan.json"
    argv = ["plan", "--trace", str(trace), "--gpus", "4", "--methods", "E+P+D,EP+D",
            "--slo-ttft", "0.3", "--slo-tpot", "0.1", "--no-progress",
            "--workers", "1"]  # fmt: skip
    assert main([*argv, "--tensor-parallel-sizes", "1,2", "--out", str(out)]) == 0
    plan = Plan.model_validate(json.loads(out.read_text()))
    assert plan.tensor_parallel, plan.describe()
    assert main([*argv, "--tensor-parallel-sizes", "1,3"]) == 2
    assert "each one of 1, 2, 4, 8" in capsys.readouterr().err
    no_ranks = save_cost_model(replace(REFERENCE, ranks=None), tmp_path / "cost.json")
    assert main([*argv, "--cost-model", str(no_ranks), "--tensor-parallel-sizes", "2"]) == 2
    assert "records no tensor-parallel terms" in capsys.readouterr().err
