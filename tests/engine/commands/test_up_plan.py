"""`epdctl up --plan plan.json`: the run starts fixed at the plan (one local backend, issue
29: no static path of its own). What the loop is given is checked here, without starting
processes; the loop itself runs in tests/operator/test_local_loop.py."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import yaml

from epd_engine.cli import UserError
from epd_engine.commands.up import _load, _manifest_text
from epd_engine.config import Method, Role
from epd_engine.contracts.plan import Budgets, Plan
from epd_operator.api.spec import EPDDeployment, fixed_plan

MANIFEST = {
    "apiVersion": "epd.serving.dev/v1alpha1",
    "kind": "EPDDeployment",
    "metadata": {"name": "planned"},
    "spec": {
        "model": {"name": "tiny-llava", "source": {"preset": "tiny-llava"}},
        "gpuBudget": 3,
        "disaggregation": {"mode": "Auto"},
        "engine": {"gpusPerInstance": 0},
    },
}


def _args(tmp_path: Path, plan: Plan, manifest: dict | None = None) -> argparse.Namespace:
    file = tmp_path / "m.yaml"
    # a second document, as `kubectl apply` files often carry: only the EPDDeployment counts
    file.write_text(yaml.safe_dump_all([{"kind": "Namespace"}, manifest or MANIFEST]))
    plan_file = tmp_path / "plan.json"
    plan_file.write_text(plan.model_dump_json())
    return argparse.Namespace(file=file, plan=plan_file)


def test_an_auto_manifest_with_a_plan_runs_fixed_at_that_plan(tmp_path: Path) -> None:
    plan = Plan(
        method=Method.EP_D,
        pools={Role.EP: 1, Role.D: 2},
        budgets={Role.EP: Budgets(image_budget=2, token_budget=256)},
    )
    args = _args(tmp_path, plan)
    _, loaded = _load(args)
    assert loaded == plan
    doc = yaml.safe_load(_manifest_text(args, loaded))
    spec = EPDDeployment.from_dict(doc).spec
    assert fixed_plan(spec).pools == plan.pools and fixed_plan(spec).method == plan.method
    assert doc["spec"]["model"] == MANIFEST["spec"]["model"]  # the rest as written


def test_a_plan_that_does_not_fit_the_manifest_is_refused_by_field(tmp_path: Path) -> None:
    plan = Plan(method=Method.E_P_D, pools={Role.E: 2, Role.P: 2, Role.D: 2})  # 6 > budget 3
    one_gpu_each = {**MANIFEST, "spec": {**MANIFEST["spec"], "engine": {"gpusPerInstance": 1}}}
    args = _args(tmp_path, plan, one_gpu_each)
    with pytest.raises(UserError, match=r"(?s)with plan .*need 6 GPUs.*gpuBudget is 3"):
        _manifest_text(args, _load(args)[1])


def test_without_a_plan_the_manifest_runs_as_written(tmp_path: Path) -> None:
    args = _args(tmp_path, Plan(method=Method.EPD, pools={Role.EPD: 1}))
    args.plan = None
    assert _manifest_text(args, None) == args.file.read_text()
