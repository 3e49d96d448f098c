"""Local mode plans with a measured cost model: ``epdctl up --cost-model FILE``.

The file (``epdctl profile-costs`` output) is read once at start; a bad one is refused with a
message naming it before anything starts; the local loop's profiler plans with it, over the
``shm`` link local processes use, and its reason and status name it.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
import yaml

from benchmarks.demo_loop import up_args
from epd_engine.profiler.cost_model import save_cost_model
from epd_engine.profiler.links import LinkCoeffs
from epd_engine.profiler.reference import reference_cost_model
from epd_engine.workload.arrivals import ArrivalSpec
from epd_engine.workload.generators import synthesize
from epd_operator.api.conditions import ConditionState
from epd_operator.api.spec import EPDDeploymentSpec
from epd_operator.local import reconciler as local_reconciler
from epd_operator.local.pools import LocalEngines
from epd_operator.local.reconciler import LocalReconciler
from epd_operator.planning.cost_file import (
    checkpoint_mismatch,
    cost_source,
    describe,
    file_cost_source,
)
from epd_operator.planning.planner import REFERENCE_LABEL
from epd_operator.rollout.driver import RolloutOutcome
from epd_operator.rollout.router_api import TraceWindow
from epd_operator.rollout.state_machine import Decision
from tests.operator.conftest import make_spec_dict
from tests.processes import EPDCTL

PROFILED_META = {
    "hardware": {"device": "cpu", "cpu": "test", "num_threads": 1, "host": "vm"},
    "model": {"name": "tiny-llava", "config_sha256": "0123456789abcdef", "dtype": "float32"},
}


def measured_file(tmp_path: Path, **meta: Any) -> Path:
    """The reference model's coefficients with a profile's meta and two measured links (shm
    fast, tcp slow), written as ``epdctl profile-costs`` writes it."""
    model = dataclasses.replace(
        reference_cost_model(),
        meta={**PROFILED_META, **meta},
        links={"shm": LinkCoeffs(1e-4, 50e9), "tcp": LinkCoeffs(0.5, 1e6)},
    )
    return save_cost_model(model, tmp_path / "cost.json")


def test_describe_names_the_file_device_model_and_calibration(tmp_path: Path) -> None:
    path = measured_file(tmp_path)
    model, label = file_cost_source(path)()
    assert label == f"{path} (profiled on cpu, tiny-llava)"
    calibrated = dataclasses.replace(model, meta={**model.meta, "calibration": {"x": 1}})
    assert describe(calibrated, "c.json") == "c.json (profiled on cpu, tiny-llava, calibrated)"
    assert describe(dataclasses.replace(model, meta={}), "bare.json") == "bare.json"
    assert cost_source(None)()[1] == REFERENCE_LABEL


@pytest.mark.parametrize(
    ("content", "why"),
    [
        (None, "cannot read cost model"),
        ("{", "cannot read cost model"),
        ("[1, 2]", "not a cost model (expected a JSON object)"),
        ('{"kind": "plan"}', "not a cost model (kind is 'plan')"),
        ('{"kind": "epd-cost-model", "version": 1, "encode": {"bogus": 1}}', "malformed"),
    ],
)
def test_a_bad_file_is_refused_naming_it(tmp_path: Path, content: str | None, why: str) -> None:
    path = tmp_path / "bad.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(ValueError, match=rf"{path}: .*{why.replace('(', '.').replace(')', '.')}"):
        file_cost_source(path)


def test_a_profile_of_another_checkpoint_is_a_warning(tmp_path: Path) -> None:
    model_dir = tmp_path / "ckpt"
    model_dir.mkdir()
    (model_dir / "config.json").write_text('{"a": 1}')
    digest = hashlib.sha256(b'{"a": 1}').hexdigest()[:16]
    model, _ = file_cost_source(measured_file(tmp_path))()
    why = checkpoint_mismatch(model, model_dir)
    assert why is not None and "0123456789abcdef" in why and digest in why
    same = dataclasses.replace(model, meta={"model": {"config_sha256": digest}})
    assert checkpoint_mismatch(same, model_dir) is None
    assert checkpoint_mismatch(reference_cost_model(), model_dir) is None  # nothing to compare


# --- the local loop plans with it --------------------------------------------------------------


class FakeRouter:
    def __init__(self, records: list[Any]) -> None:
        self.records = records

    def trace_window(self, window_s: float, in_flight: bool = False) -> TraceWindow:
        return TraceWindow(self.records, 900.0)


def test_the_local_loop_plans_with_the_file_over_the_shm_link(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One real pass of ``LocalReconciler`` (plan_pass, the bounded profiler in its child
    process) with the rollout stubbed: the plan's reason and the status name the file, and
    ``auto`` plans over the measured shm link (pods would get tcp)."""
    rolled: list[str] = []

    def rollout(backend: Any, fleet: Any, desired: Any, plan: Any, state: Any, *_: Any) -> Any:
        rolled.append(plan.describe())
        progressing = ConditionState("True", "RolloutComplete", "done")
        return RolloutOutcome(Decision(conditions={"Progressing": progressing}), state, False)

    monkeypatch.setattr(local_reconciler, "rollout_pass", rollout)
    path = measured_file(tmp_path)
    engines = LocalEngines(tmp_path, "tiny-llava", "http://127.0.0.1:9", tmp_path, "token")
    events: list[tuple[str, str, str]] = []
    reconciler = LocalReconciler(
        "demo", engines, lambda *e: events.append(e), cost_source=file_cost_source(path)
    )
    records = synthesize("textvqa", 60, ArrivalSpec("poisson", 5.0), seed=0)
    reconciler.router = FakeRouter(records)  # type: ignore[assignment]
    spec = EPDDeploymentSpec.model_validate(
        make_spec_dict(gpuBudget=2, disaggregation={"mode": "Auto"}, profiler={"minRequests": 50})
    )
    status = reconciler.reconcile(spec, datetime.now(UTC))
    label = f"{path} (profiled on cpu, tiny-llava)"
    assert status.reason.startswith("profiler: best of"), status.reason
    assert status.reason.endswith(f"cost model: {label}, shm link")
    assert status.cost_model == label and status.to_json()["cost_model"] == label
    assert status.conditions["Planned"][2] == status.reason
    assert rolled == [status.plan]
    assert any(label in message for _, reason, message in events if reason == "PlanChanged")


def test_without_a_file_the_local_loop_names_the_reference(tmp_path: Path) -> None:
    engines = LocalEngines(tmp_path, "tiny-llava", "http://127.0.0.1:9", tmp_path, "token")
    reconciler = LocalReconciler("demo", engines, lambda *e: None)
    assert reconciler.cost_label == REFERENCE_LABEL


# --- the CLI -----------------------------------------------------------------------------------


def up(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*EPDCTL, "up", *args], capture_output=True, text=True, timeout=60)


def manifest(tmp_path: Path, disaggregation: dict[str, Any]) -> Path:
    data = {
        "apiVersion": "epd.serving.dev/v1alpha1",
        "kind": "EPDDeployment",
        "metadata": {"name": "costs"},
        "spec": {
            "model": {"name": "tiny-llava", "source": {"preset": "tiny-llava"}},
            "gpuBudget": 2,
            "disaggregation": disaggregation,
            "engine": {"gpusPerInstance": 0},
        },
    }
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_up_refuses_a_malformed_cost_model_before_starting_anything(tmp_path: Path) -> None:
    bad = tmp_path / "cost.json"
    bad.write_text(json.dumps({"kind": "epd-cost-model", "version": 1, "overlap": 7}))
    runs, models = tmp_path / "runs", tmp_path / "models"
    auto = manifest(tmp_path, {"mode": "Auto"})
    got = up("-f", str(auto), "--cost-model", str(bad), "--runs-dir", str(runs),
             "--models-dir", str(models), "--detach")  # fmt: skip
    assert got.returncode != 0
    assert f"--cost-model: {bad}: malformed cost model (overlap must be in [0, 1]" in got.stderr
    assert "Traceback" not in got.stderr
    assert not runs.exists() and not models.exists()  # nothing started, nothing made

    fixed = manifest(tmp_path, {"mode": "Fixed", "method": "EPD", "pools": {"EPD": 1}})
    got = up("-f", str(fixed), "--cost-model", str(bad), "--runs-dir", str(runs))
    assert got.returncode != 0 and "malformed cost model" in got.stderr  # every run plans
    assert not runs.exists()


def test_demo_loop_passes_the_cost_model_to_up(tmp_path: Path) -> None:
    args = up_args(Path("m.yaml"), Path("ckpt"), Path("runs"), 8090, Path("cost.json"))
    assert args[:3] == ["up", "-f", "m.yaml"] and args[-2:] == ["--cost-model", "cost.json"]
    assert "--cost-model" not in up_args(Path("m.yaml"), Path("ckpt"), Path("runs"), 8090)


def test_up_announces_its_cost_model_and_warns_of_what_it_cannot_use(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No process starts here: ``LocalRun`` is built and its start-up events read."""
    from epd_operator.local.run import LocalRun, Options

    text = yaml.safe_dump(
        {
            "apiVersion": "epd.serving.dev/v1alpha1",
            "kind": "EPDDeployment",
            "metadata": {"name": "costs"},
            "spec": {
                **make_spec_dict(gpuBudget=2, disaggregation={"mode": "Auto"}),
                "model": {"name": "tiny-llava", "source": {"preset": "tiny-llava"}},
                "profiler": {"costModel": {"configMapName": "costs"}},
            },
        }
    )
    model_dir = tmp_path / "ckpt"
    model_dir.mkdir()
    (model_dir / "config.json").write_text("{}")

    def events(cost_model: Path | None) -> str:
        opts = Options("costs", "tiny-llava", model_dir, tmp_path / "run", 9, cost_model=cost_model)
        LocalRun(opts, text)._announce_cost_model()
        return capsys.readouterr().err

    got = events(None)
    assert f"CostModel: the profiler plans with {REFERENCE_LABEL}" in got
    assert "CostModelNotRead: profiler.costModel (ConfigMap costs) is read in a cluster" in got
    path = measured_file(tmp_path)
    got = events(path)
    assert f"CostModel: the profiler plans with {path} (profiled on cpu, tiny-llava)" in got
    assert "CostModelMismatch: the cost model was profiled on a checkpoint" in got
    assert "CostModelNotRead" not in got
    with pytest.raises(ValueError, match="cannot read cost model"):
        events(tmp_path / "missing.json")
