"""The cost model local mode plans with: ``epdctl up --cost-model FILE`` (or
``reference[:MODEL]``, one of the built-in synthetic references).

In a cluster the operator reads ``spec.profiler.costModel`` from a ConfigMap
(``controller._cost_model``); ``epdctl up`` has no cluster, so it takes the JSON file that
``epdctl profile-costs`` wrote. The file is read once, when the run starts: a bad file stops
the start with a message naming it (nothing has started yet), and a file changed or removed
later does not change the running loop. Without a file, the built-in reference plans.

``describe`` is how the plan's reason, the run's events and ``epdctl status`` name it, e.g.
``cost.json (profiled on cpu, tiny-llava)``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from epd_engine.profiler.cost_model import FittedCostModel, config_fingerprint
from epd_engine.profiler.reference import named_cost_model
from epd_operator.planning.planner import CostSource, reference_cost


def _section(meta: dict[str, Any], name: str) -> dict[str, Any]:
    value = meta.get(name)
    return value if isinstance(value, dict) else {}


def describe(model: FittedCostModel, where: str) -> str:
    """``where`` with what the model was measured on: device, model, calibrated or not."""
    hardware, checkpoint = _section(model.meta, "hardware"), _section(model.meta, "model")
    parts = []
    if hardware.get("device"):
        parts.append(f"profiled on {hardware['device']}")
    if checkpoint.get("name"):
        parts.append(str(checkpoint["name"]))
    if model.meta.get("calibration"):
        parts.append("calibrated")
    return f"{where} ({', '.join(parts)})" if parts else where


def file_cost_source(path: Path) -> CostSource:
    """A cost source over the model in ``path`` (or ``reference[:MODEL]``, a built-in
    synthetic one), read now; ValueError naming the file when it cannot be read or is not a
    cost model."""
    model = named_cost_model(path)
    label = describe(model, str(path))
    return lambda: (model, label)


def cost_source(path: Path | None) -> CostSource:
    """``--cost-model``'s file, or the built-in reference without one."""
    return reference_cost if path is None else file_cost_source(path)


def checkpoint_mismatch(model: FittedCostModel, model_dir: Path) -> str | None:
    """Why ``model`` may not fit the checkpoint this run serves (its ``config.json`` differs
    from the one profiled), or None. A warning, not an error: a stand-in profile is allowed."""
    profiled = _section(model.meta, "model").get("config_sha256")
    if not profiled:
        return None
    try:
        digest = config_fingerprint(model_dir)
    except OSError:
        return None
    if digest == profiled:
        return None
    return (
        f"the cost model was profiled on a checkpoint with another config.json "
        f"({profiled}); {model_dir} has {digest}: plans may not fit this model"
    )
