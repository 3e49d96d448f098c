"""Emulated engine pods (``spec.engine.emulate``): every pool runs ``epdctl serve --emulate``.

An emulated pod runs the real scheduler, budgets and page accounting, the router link, the
migration protocol and the drain, and takes its times from the cost model the profiler
plans with: ``profiler.costModel``'s ConfigMap, mounted read-only, or the built-in reference.
It requests no GPU and reads no weights (``--model`` is only the name it serves under, with
``-emulated`` appended, and the router answers to that name), so a fleet of them fits on CPU
nodes, a kwok cluster or one real node: the control plane (router, loop, rollouts, scaling)
is exercised as a GPU fleet would exercise it. Peers test theirs the same way (Dynamo's
mocker, llm-d's inference simulator). What an emulated pod measures is never the engine's
speed, and its names say so.
"""

from __future__ import annotations

from typing import Any

from epd_engine.emulate import emulated_name
from epd_operator.rollout.pool_identity import Owner

COST_MODEL_DIR = "/etc/epd/cost-model"
COST_MODEL_VOLUME = "cost-model"
# ~60 MiB resident each (no torch, no weights); requests a spec leaves out get these, so a
# node takes dozens
EMULATED_RESOURCES: dict[str, dict[str, str]] = {
    "requests": {"cpu": "100m", "memory": "128Mi"},
    "limits": {"memory": "512Mi"},
}


def emulated(owner: Owner) -> bool:
    return owner.spec.engine.emulate


def served_model_name(owner: Owner) -> str:
    """What clients ask the router for: an emulated deployment's name says so."""
    name = owner.spec.model.name
    return emulated_name(name) if emulated(owner) else name


def emulate_args(owner: Owner) -> list[str]:
    """``--emulate`` with the profiler's cost model (mounted), else the built-in reference."""
    ref = owner.spec.profiler.cost_model
    return ["--emulate", "reference" if ref is None else f"{COST_MODEL_DIR}/{ref.key}"]


def cost_model_volumes(owner: Owner) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """(volumes, mounts) that put the profiler's cost model in an emulated pod; none when the
    built-in reference times it."""
    ref = owner.spec.profiler.cost_model
    if ref is None:
        return [], []
    volume = {"name": COST_MODEL_VOLUME, "configMap": {"name": ref.config_map_name}}
    mount = {"name": COST_MODEL_VOLUME, "mountPath": COST_MODEL_DIR, "readOnly": True}
    return [volume], [mount]
