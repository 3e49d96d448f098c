from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from epd_engine.config import Stage
from epd_engine.profiler.cost_model import (
    BatchShape,
    FittedCostModel,
    Overheads,
    load_cost_model,
    save_cost_model,
)
from epd_engine.profiler.reference import reference_cost_model
from epd_engine.scheduler.output import EncodeTask, SchedulerOutput, TokenTask

from .factories import toy_cost_model


def test_batch_shape_counts_tokens_pairs_and_context() -> None:
    out = SchedulerOutput(
        encodes=[EncodeTask("a", 0, "h", 100, [0]), EncodeTask("a", 1, "g", 50, [1])],
        prefills=[TokenTask("b", Stage.PREFILL, [1] * 4, 8, [0, 1, 2], sample=True)],
        decodes=[TokenTask("c", Stage.DECODE, [1], 31, [0, 1], sample=True)],
    )
    shape = BatchShape.of(out)
    assert shape.num_images == 2
    assert shape.image_tokens == 150
    assert shape.num_tokens == 5
    assert shape.prefill_kpairs == pytest.approx(4 * (8 + 2.5) / 1000)  # causal pairs
    assert shape.decode_kcontext == pytest.approx(32 / 1000)
    assert shape.num_sampled == 2


def test_step_time_grows_with_every_field_and_is_zero_when_empty() -> None:
    model = reference_cost_model()
    assert model.step_s(BatchShape()) == 0.0
    base = BatchShape(
        num_images=1,
        image_tokens=576,
        num_tokens=64,
        prefill_kpairs=2.0,
        decode_kcontext=1.0,
        num_sampled=4,
    )
    for field, bigger in [
        ("image_tokens", 5000),
        ("num_tokens", 4000),
        ("prefill_kpairs", 900.0),
        ("decode_kcontext", 80.0),
        ("num_sampled", 64),
    ]:
        grown = BatchShape(**{**{k: getattr(base, k) for k in base.__slots__}, field: bigger})
        assert model.step_s(grown) > model.step_s(base), field


def test_colocation_overlap_hides_part_of_the_shorter_stage() -> None:
    model = toy_cost_model()
    both = BatchShape(num_images=1, image_tokens=100, num_tokens=10, num_sampled=1)
    serial = model.encode_s(100) + model.step_s(BatchShape(num_tokens=10, num_sampled=1))
    assert model.step_s(both) == pytest.approx(serial)  # overlap 0: runs back to back
    hidden = FittedCostModel(model.encode, model.language, 1.0, model.migration, model.capacity)
    assert hidden.step_s(both) < serial


def test_json_round_trip_keeps_every_coefficient(tmp_path: Path) -> None:
    model = reference_cost_model()
    path = save_cost_model(model, tmp_path / "cost.json")
    assert load_cost_model(path) == model
    overheads = Overheads(0.1, 0.002, 0.02, 0.03, (0.1, 0.2), (0.0, 0.004), (0.01,), (0.03, 0.05))
    overheads = dataclasses.replace(
        overheads,
        encode_s=0.001,
        export_s=0.0015,
        image_handoff_s=0.0004,
        image_handoff_s_quantiles=(0.0003, 0.0005),
    )
    calibrated = dataclasses.replace(model, overheads=overheads)
    path = save_cost_model(calibrated, tmp_path / "calibrated.json")
    assert load_cost_model(path) == calibrated


def test_cost_models_from_before_the_migration_overheads_still_load() -> None:
    data = reference_cost_model().to_dict()
    data["overheads"] = {"request_s": 0.05, "step_s": 0.003, "request_s_quantiles": [0.05]}
    loaded = FittedCostModel.from_dict(data)
    assert loaded.overheads.handoff_s == loaded.overheads.pull_s == 0.0
    assert loaded.overheads.request_s_quantiles == (0.05,)


def test_loading_something_else_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"kind": "epd-bench"}')
    with pytest.raises(ValueError, match=r"bad\.json: not a cost model"):
        load_cost_model(path)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="cannot read"):
        load_cost_model(path)
    data = reference_cost_model().to_dict()
    data["language"]["per_parsec_s"] = 1.0
    with pytest.raises(ValueError, match="malformed"):
        FittedCostModel.from_dict(data)


def test_migration_time_scales_with_bytes() -> None:
    model = toy_cost_model()
    assert model.migration_s("kv", 1000) > model.migration_s("kv", 10) > 0
    assert model.migration_s("image", 100) == pytest.approx(0.001 + 100 * 1024 / 1e9)
