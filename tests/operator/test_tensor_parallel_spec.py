"""Tensor-parallel instances in the resource (issue 34). The plan carries each pool's size:
in mode Fixed from ``engine.roles.<role>.tensorParallelSize``, in mode Auto as the profiler
chose it among ``disaggregation.tensorParallelSizes``. A pool's instances then get that many
ranks, its pods that many GPUs per rank and its engine the flag; sizes the engine cannot run
are refused with the field named (the API server's CEL twins of these rules:
tests/k8s/test_crd_bounds.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from epd_engine.config import Method, Role, Stage
from epd_engine.contracts.plan import Plan
from epd_engine.profiler.reference import reference_cost_model
from epd_operator.api.spec import EPDDeploymentSpec, PlanStatus, fixed_plan
from epd_operator.kube import manifests as r
from epd_operator.local.pools import LocalEngines, LocalPools, budget_key
from epd_operator.planning.fast_path import fast_step
from epd_operator.planning.planner import PlanningError, profiler_plan
from epd_operator.rollout.pool_identity import Owner, PoolSpec
from tests.engine.profiler.factories import make_trace
from tests.operator.conftest import make_owner, make_spec_dict

EPD_TWO = {"mode": "Fixed", "method": "EPD", "pools": {"EPD": 2}}
PLAN = Plan(method=Method.EPD, pools={Role.EPD: 2})


def _spec(engine: dict[str, Any], disaggregation: dict[str, Any] | None = None, **kw: Any):
    return EPDDeploymentSpec.model_validate(
        make_spec_dict(engine=engine, disaggregation=disaggregation or EPD_TWO, **kw)
    )


def test_pods_request_a_gpu_per_rank_and_the_engine_gets_the_size() -> None:
    owner = make_owner(engine={"roles": {"EPD": {"tensorParallelSize": 2}}},
                       disaggregation=EPD_TWO)  # fmt: skip
    plan = fixed_plan(owner.spec)
    assert plan.tensor_parallel == {Role.EPD: 2} and plan.num_ranks == 4
    (pool,) = r.pool_specs(owner, plan)
    assert pool.gpus_per_instance == 2 and pool.ranks == (2,)
    container = r.render_pool_deployment(owner, pool, plan)["spec"]["template"]["spec"][
        "containers"
    ][0]
    assert container["resources"]["limits"]["nvidia.com/gpu"] == "2"
    args = container["args"]
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert args[args.index("--device") + 1] == "cuda"  # ranks take cuda:0 and cuda:1


def test_one_rank_by_default_and_no_flag() -> None:
    owner = make_owner(disaggregation=EPD_TWO)
    (pool,) = r.pool_specs(owner, PLAN)
    assert pool.gpus_per_instance == 1
    container = r.render_pool_deployment(owner, pool, PLAN)["spec"]["template"]["spec"][
        "containers"
    ][0]
    assert "--tensor-parallel-size" not in container["args"]
    assert fixed_plan(owner.spec).tensor_parallel == {}


def test_the_fixed_pools_count_every_rank_against_the_budget() -> None:
    with pytest.raises(ValidationError, match="the fixed pools need 8 GPUs"):
        _spec({"roles": {"EPD": {"tensorParallelSize": 4}}}, gpuBudget=6,
              model={"name": "m", "source": {"preset": "tiny-qwen3-vl"}})  # fmt: skip


def test_an_encoder_is_refused_by_field_and_roles_whose_cache_migrates_are_taken() -> None:
    with pytest.raises(ValidationError, match=r"E\.tensorParallelSize: .*does not run"):
        _spec({"roles": {"E": {"tensorParallelSize": 2}}})
    for role in ("P", "D", "EP", "ED"):  # caches move between sizes (kv_staging.py)
        assert _spec({"roles": {role: {"tensorParallelSize": 2}}})


def test_auto_mode_takes_its_sizes_from_the_profiler_not_from_engine_roles() -> None:
    with pytest.raises(ValidationError, match="chooses each pool's size from disaggregation"):
        _spec({"roles": {"PD": {"tensorParallelSize": 2}}}, {"mode": "Auto"})
    assert _spec({}, {"mode": "Auto", "tensorParallelSizes": [1, 2]})
    with pytest.raises(ValidationError, match="sizes above 1 are for mode Auto"):
        _spec({}, {**EPD_TWO, "tensorParallelSizes": [2]})
    with pytest.raises(ValidationError, match=r"tensorParallelSizes: 4 does not divide preset"):
        _spec({}, {"mode": "Auto", "tensorParallelSizes": [1, 4]})  # tiny-llava: 2 KV heads


def test_a_preset_whose_heads_do_not_divide_is_refused_with_the_sizes_that_do() -> None:
    """tiny-llava has 2 KV heads: 4 ranks would get half a head each."""
    words = r"EPD.tensorParallelSize: 4 does not divide preset tiny-llava's num_kv_heads \(2\)"
    with pytest.raises(ValidationError, match=words + "; sizes that do: 1, 2"):
        _spec({"roles": {"EPD": {"tensorParallelSize": 4}}})


def test_sizes_outside_one_node_are_refused() -> None:
    with pytest.raises(ValidationError, match="tensorParallelSize"):
        _spec({"roles": {"EPD": {"tensorParallelSize": 3}}})


def test_local_runs_pass_each_pool_its_size_and_share_budgets_only_at_one_size(
    tmp_path: Path,
) -> None:
    engines = LocalEngines(tmp_path, "m", "http://127.0.0.1:9", tmp_path, "token")
    pools = LocalPools(engines)
    two, one = PoolSpec("demo-p2", Role.P, 1, 0, ranks=(2,)), PoolSpec("demo-p", Role.P, 1, 0)
    args = pools.engine_args(two, "demo-p2-0", 9001)
    assert args[args.index("--tensor-parallel-size") + 1] == "2"
    assert "--tensor-parallel-size" not in pools.engine_args(one, "demo-p-0", 9002)
    assert budget_key(two, engines) != budget_key(one, engines)  # a search at 2 is not 1's


# ---- mode Auto: the profiler chooses ------------------------------------------------------

# 3,000-token prompts with an image under a 0.3 s TTFT: one rank per P is too slow
LONG_PROMPTS = make_trace(num=200, rate_rps=4, prompt_tokens=3000, image_tokens=576,
                          output_tokens=20)  # fmt: skip


def _auto_owner(sizes: list[int]) -> Owner:
    return make_owner(
        gpuBudget=4,
        model={"name": "llava", "source": {"preset": "tiny-llava"}},
        slo={"ttftMilliseconds": 300, "tpotMilliseconds": 100},
        disaggregation={"mode": "Auto", "tensorParallelSizes": sizes},
    )


def test_the_profiler_splits_a_pool_and_its_pods_follow_the_plan() -> None:
    owner = _auto_owner([1, 2])
    plan = profiler_plan(owner.spec, LONG_PROMPTS, reference_cost_model(), "reference")
    assert plan.tensor_parallel, plan.describe()
    assert plan.num_ranks == 4  # the budget counts every rank's GPU
    assert all(role.needs_language for role in plan.tensor_parallel)
    for pool in r.pool_specs(owner, plan):
        size = plan.size_of(pool.role)
        assert pool.gpus_per_instance == size
        args = r.render_pool_deployment(owner, pool, plan)["spec"]["template"]["spec"][
            "containers"
        ][0]["args"]
        assert ("--tensor-parallel-size" in args) == (size > 1)
    # the status keeps the sizes: the next pass finds the same pools
    back = PlanStatus.from_plan(plan, 1).to_plan()
    assert back.tensor_parallel == plan.tensor_parallel
    assert [p.name for p in r.pool_specs(owner, back)] == [
        p.name for p in r.pool_specs(owner, plan)
    ]


def test_a_cost_model_without_rank_terms_fails_the_plan_naming_the_field() -> None:
    from dataclasses import replace

    owner = _auto_owner([1, 2])
    no_ranks = replace(reference_cost_model(), ranks=None)
    with pytest.raises(PlanningError, match=r"tensorParallelSizes: .*no tensor-parallel terms"):
        profiler_plan(owner.spec, LONG_PROMPTS, no_ranks, "file")


def test_the_fast_path_counts_a_split_instance_as_all_its_ranks() -> None:
    from epd_operator.planning.alarm import SloAlarm

    owner = _auto_owner([1, 2])
    pools = {Role.E: 1, Role.P: 1, Role.D: 1}
    plan = Plan(method=Method.E_P_D, pools=pools, tensor_parallel={Role.P: 2})
    alarm = SloAlarm(kind="TTFT", stage=Stage.PREFILL, reason="TTFT p90 over the SLO")
    assert fast_step(owner.spec, plan, [alarm]) is None  # 4 of 4 GPUs: P + 2 would be 6
    roomy = EPDDeploymentSpec.model_validate(
        {**owner.spec.model_dump(by_alias=True, exclude_none=True), "gpuBudget": 6}
    )
    step = fast_step(roomy, plan, [alarm])
    assert step is not None and step.after.tensor_parallel == {Role.P: 2}
