"""Factories for EPDDeployment specs and owners (pure, no cluster)."""

from __future__ import annotations

from typing import Any

import pytest

from epd_engine.contracts.plan import Plan
from epd_operator.api.spec import EPDDeploymentSpec
from epd_operator.kube.manifests import Owner
from epd_operator.planning.choice import PlanChoice


def make_spec_dict(**overrides: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {
        "model": {"name": "llava", "source": {"preset": "tiny-llava"}},
        "gpuBudget": 8,
        "disaggregation": {"mode": "Fixed", "method": "E+P+D", "pools": {"E": 1, "P": 2, "D": 1}},
    }
    spec.update(overrides)
    return spec


def make_owner(**overrides: Any) -> Owner:
    spec = EPDDeploymentSpec.model_validate(make_spec_dict(**overrides))
    return Owner(name="demo", namespace="serving", uid="uid-1234", spec=spec)


@pytest.fixture
def owner() -> Owner:
    return make_owner()


def plan_and_ran(choice: PlanChoice) -> tuple[Plan, bool]:
    return choice.plan, choice.ran
