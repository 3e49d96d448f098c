from __future__ import annotations

from pathlib import Path

import pytest

from epd_engine.config import Method, Role
from epd_operator.spec import EPDDeployment, EPDDeploymentSpec, ManifestError, fixed_plan
from tests.operator.conftest import make_spec_dict

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "k8s"


@pytest.mark.parametrize("path", sorted(EXAMPLES.glob("*.yaml")), ids=lambda p: p.name)
def test_examples_validate(path: Path) -> None:
    dep = EPDDeployment.from_yaml(path)
    assert dep.spec.model.name


def test_defaults_fill_nested_sections() -> None:
    spec = EPDDeploymentSpec.model_validate(make_spec_dict())
    assert spec.slo.ttft_milliseconds == 4000
    assert spec.engine.gpus_per_instance == 1
    assert spec.router.port == 8080
    assert spec.rollout.drain_timeout_seconds == 60
    assert spec.slo.to_slo().tpot_s == pytest.approx(0.08)


def test_fixed_plan_matches_spec() -> None:
    plan = fixed_plan(EPDDeploymentSpec.model_validate(make_spec_dict()))
    assert plan.method is Method.E_P_D
    assert dict(plan.pools) == {Role.E: 1, Role.P: 2, Role.D: 1}


def test_fixed_plan_refuses_auto() -> None:
    spec = EPDDeploymentSpec.model_validate(make_spec_dict(disaggregation={"mode": "Auto"}))
    with pytest.raises(ValueError, match="Auto"):
        fixed_plan(spec)


def _fixed(method: str, pools: dict[str, int]) -> dict:
    return {"disaggregation": {"mode": "Fixed", "method": method, "pools": pools}}


GE1 = "greater than or equal to 1"


@pytest.mark.parametrize(
    ("overrides", "field", "words"),
    [
        ({"gpuBudget": -1}, "spec.gpuBudget", GE1),
        (_fixed("X+Y", {"E": 1}), "spec.disaggregation.method", "E+P+D"),
        (_fixed("EP+D", {"E": 1, "D": 1}), "spec.disaggregation", "EP+D"),
        (_fixed("EPD", {"EPD": 9}), "spec", "gpuBudget"),
        ({"slo": {"ttftMilliseconds": 0}}, "spec.slo.ttftMilliseconds", GE1),
        ({"model": {"name": "m", "source": {}}}, "spec.model.source", "exactly one"),
    ],
)
def test_invalid_manifest_errors_name_the_field(
    tmp_path: Path, overrides: dict, field: str, words: str
) -> None:
    import yaml

    doc = {"apiVersion": "epd.serving.dev/v1alpha1", "kind": "EPDDeployment",
           "metadata": {"name": "x"}, "spec": make_spec_dict(**overrides)}  # fmt: skip
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ManifestError) as err:
        EPDDeployment.from_yaml(path)
    text = str(err.value)
    assert f"{field}:" in text or f"{field}." in text, text
    assert words in text


def test_missing_model_is_named(tmp_path: Path) -> None:
    spec = make_spec_dict()
    del spec["model"]
    with pytest.raises(ManifestError, match=r"spec\.model: Field required"):
        EPDDeployment.from_dict({"kind": "EPDDeployment", "spec": spec})


def test_yaml_without_epddeployment(tmp_path: Path) -> None:
    path = tmp_path / "cm.yaml"
    path.write_text("kind: ConfigMap\n")
    with pytest.raises(ManifestError, match="no document with kind: EPDDeployment"):
        EPDDeployment.from_yaml(path)
