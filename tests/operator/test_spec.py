from __future__ import annotations

from pathlib import Path

import pytest
from pydantic import ValidationError

from epd_engine.config import Method, Role
from epd_operator.api.spec import EPDDeployment, EPDDeploymentSpec, ManifestError, fixed_plan
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


@pytest.mark.parametrize(
    ("overrides", "field", "words"),
    [
        ({"engine": {"gpusPerInstance": 2}}, "spec.engine.gpusPerInstance",
         "less than or equal to 1"),
        ({"router": {"replicas": 9}}, "spec.router.replicas", "less than or equal to 8"),
        ({"engine": {"resources": {"limits": {"memory": "8Gb"}}}},
         "spec.engine.resources.limits.memory", "should match pattern"),
        ({"router": {"resources": {"requests": {"cpu": "lots"}}}},
         "spec.router.resources.requests.cpu", "should match pattern"),
        ({"engine": {"extraArgs": ["--x"] * 65}}, "spec.engine.extraArgs", "at most 64"),
        ({"engine": {"processorMaxPixels": 0}}, "spec.engine.processorMaxPixels",
         "greater than or equal to 1"),
    ],
    ids=["gpus-per-instance", "router-replicas", "memory-quantity", "cpu-quantity", "extra-args",
         "processor-max-pixels"],
)  # fmt: skip
def test_spec_bounds_match_what_the_engine_and_operator_support(
    overrides: dict, field: str, words: str
) -> None:
    """Defect: the CRD accepted gpusPerInstance up to 16 (the engine uses one device), router
    replicas up to 64, and any string as a resource quantity (a 422 from the API server later)."""
    with pytest.raises(ValidationError) as err:
        EPDDeploymentSpec.model_validate(make_spec_dict(**overrides))
    first = err.value.errors()[0]
    where = "spec." + ".".join(str(p) for p in first["loc"])
    assert where == field, err.value
    assert words in first["msg"], first["msg"]


@pytest.mark.parametrize("quantity", ["8", "500m", "64Gi", "1.5", "1e3", "100M", ".5"])
def test_valid_quantities_are_accepted(quantity: str) -> None:
    spec = EPDDeploymentSpec.model_validate(
        make_spec_dict(engine={"resources": {"limits": {"memory": quantity}}})
    )
    assert spec.engine.resources.limits["memory"] == quantity


# --- pod settings (engine.roles, env, volumes, ...) ---------------------------------------


@pytest.mark.parametrize(
    ("engine", "field", "words"),
    [
        ({"env": [{"name": "EPD_INTERNAL_TOKEN", "value": "x"}]}, "engine.env.0",
         "set by the operator"),
        ({"env": [{"name": "A", "value": "x", "valueFrom": {}}]}, "engine.env.0", "not both"),
        ({"env": [{"name": "A"}, {"name": "A"}]}, "engine", "names must be unique"),
        ({"envFrom": [{"prefix": "X"}]}, "engine.envFrom.0", "exactly one of configMapRef"),
        ({"volumes": [{"name": "shm", "emptyDir": {}}]}, "engine.volumes.0", "operator's"),
        ({"volumeMounts": [{"name": "x", "mountPath": "/data"}]}, "engine", "must name one of"),
        ({"volumes": [{"name": "x", "emptyDir": {}}],
          "volumeMounts": [{"name": "x", "mountPath": "/models/extra"}]},
         "engine.volumeMounts.0", "operator's mounts"),
        ({"shmSize": "16GB"}, "engine.shmSize", "should match pattern"),
        ({"runtimeClassName": "Nvidia_GPU"}, "engine.runtimeClassName", "should match pattern"),
        ({"podLabels": {"epd.serving.dev/pool": "x"}}, "engine", "podLabels may not set"),
        ({"terminationGracePeriodSeconds": 5}, "engine.terminationGracePeriodSeconds",
         "greater than or equal to 15"),
        ({"roles": {"E": {"gpusPerInstance": 2}}}, "engine.roles.E.gpusPerInstance",
         "less than or equal to 1"),
        ({"roles": {"X": {}}}, "engine.roles.X", "Extra inputs are not permitted"),
    ],
)  # fmt: skip
def test_invalid_pod_settings_name_the_field(engine: dict, field: str, words: str) -> None:
    with pytest.raises(ValidationError) as err:
        EPDDeploymentSpec.model_validate(make_spec_dict(engine=engine))
    first = err.value.errors()[0]
    where = ".".join(str(p) for p in first["loc"] if not str(p).startswith("function-"))
    assert where == field, err.value
    assert words in first["msg"], first["msg"]


def test_auto_mode_may_not_give_a_role_more_gpus_than_the_planner() -> None:
    spec = make_spec_dict(
        disaggregation={"mode": "Auto"},
        engine={"gpusPerInstance": 0, "roles": {"P": {"gpusPerInstance": 1}}},
    )
    with pytest.raises(ValidationError, match="a role's gpusPerInstance may be lower, not higher"):
        EPDDeploymentSpec.model_validate(spec)


def test_huggingface_cache_needs_a_volume() -> None:
    model = {"name": "m", "source": {"preset": "tiny-llava", "huggingFaceCache": {"repo": "a/b"}}}
    with pytest.raises(ValidationError, match="huggingFaceCache names a repository"):
        EPDDeploymentSpec.model_validate(make_spec_dict(model=model))
