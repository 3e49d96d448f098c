"""Tensor-parallel instances in the resource (issue 34): ``engine.roles.<role>.
tensorParallelSize`` gives each instance of a pool that runs the language model that many
ranks, its pods that many GPUs and its engine the flag; sizes the engine cannot run are
refused with the field named (the API server's CEL twins of these rules:
tests/k8s/test_crd_bounds.py)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from epd_engine.config import Method, Role
from epd_engine.contracts.plan import Plan
from epd_operator.api.spec import EPDDeploymentSpec
from epd_operator.kube import manifests as r
from epd_operator.local.reconciler import role_args
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
    (pool,) = r.pool_specs(owner, PLAN)
    assert pool.gpus_per_instance == 2
    container = r.render_pool_deployment(owner, pool, PLAN)["spec"]["template"]["spec"][
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
    assert role_args(owner.spec) == {}


def test_the_fixed_pools_count_every_rank_against_the_budget() -> None:
    with pytest.raises(ValidationError, match="the fixed pools need 8 GPUs"):
        _spec({"roles": {"EPD": {"tensorParallelSize": 4}}}, gpuBudget=6,
              model={"name": "m", "source": {"preset": "tiny-qwen3-vl"}})  # fmt: skip


def test_an_encoder_is_refused_by_field_and_roles_whose_cache_migrates_are_taken() -> None:
    with pytest.raises(ValidationError, match=r"E\.tensorParallelSize: .*does not run"):
        _spec({"roles": {"E": {"tensorParallelSize": 2}}})
    for role in ("P", "D", "EP", "ED"):  # caches move between sizes (kv_staging.py)
        assert _spec({"roles": {role: {"tensorParallelSize": 2}}})


def test_auto_mode_is_refused_until_the_planner_chooses_sizes() -> None:
    with pytest.raises(ValidationError, match="needs disaggregation mode Fixed"):
        _spec({"roles": {"PD": {"tensorParallelSize": 2}}}, {"mode": "Auto"})


def test_a_preset_whose_heads_do_not_divide_is_refused_with_the_sizes_that_do() -> None:
    """tiny-llava has 2 KV heads: 4 ranks would get half a head each."""
    words = r"EPD.tensorParallelSize: 4 does not divide preset tiny-llava's num_kv_heads \(2\)"
    with pytest.raises(ValidationError, match=words + "; sizes that do: 1, 2"):
        _spec({"roles": {"EPD": {"tensorParallelSize": 4}}})


def test_sizes_outside_one_node_are_refused() -> None:
    with pytest.raises(ValidationError, match="tensorParallelSize"):
        _spec({"roles": {"EPD": {"tensorParallelSize": 3}}})


def test_local_runs_pass_the_size_to_that_role_alone() -> None:
    spec = _spec({"roles": {"EPD": {"tensorParallelSize": 2}}})
    assert role_args(spec) == {Role.EPD: ("--tensor-parallel-size", "2")}
