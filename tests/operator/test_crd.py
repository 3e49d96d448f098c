from __future__ import annotations

from pathlib import Path

from epd_operator.api import crdgen

ROOT = Path(__file__).resolve().parents[2]


def test_committed_crd_matches_spec_models() -> None:
    committed = (ROOT / "crds" / crdgen.FILENAME).read_text()
    assert committed == crdgen.render(), "crds/ drifted from spec.py: run `make crds`"


def test_chart_ships_the_same_crd() -> None:
    assert (
        ROOT / "charts" / "epd-operator" / "crds" / crdgen.FILENAME
    ).read_text() == crdgen.render()


def test_schema_is_structural() -> None:
    crd = crdgen.build_crd()
    version = crd["spec"]["versions"][0]
    assert version["subresources"] == {"status": {}}
    assert crd["spec"]["names"]["shortNames"] == ["epd"]
    columns = [c["name"] for c in version["additionalPrinterColumns"]]
    assert columns == ["Method", "Pools", "Ready", "Goodput", "Age"]

    def walk(node: object, path: str) -> None:
        if isinstance(node, dict):
            for bad in ("$ref", "anyOf", "title", "$defs"):
                assert bad not in node, f"{path} has {bad}"
            for bound in ("exclusiveMinimum", "exclusiveMaximum"):  # Kubernetes: a boolean
                assert isinstance(node.get(bound, True), bool), f"{path}.{bound}"
            if "properties" in node:
                assert node.get("type") == "object", path
                assert "additionalProperties" not in node, path
            for key, value in node.items():
                walk(value, f"{path}.{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                walk(value, f"{path}[{i}]")

    walk(version["schema"]["openAPIV3Schema"], "")


def test_method_enum_and_cel_rules_present() -> None:
    spec = crdgen.build_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"][
        "spec"
    ]
    dis = spec["properties"]["disaggregation"]
    assert dis["properties"]["method"]["enum"] == ["E+P+D", "EP+D", "ED+P", "E+PD", "EPD"]
    assert len(dis["x-kubernetes-validations"]) == 4  # the last: tensorParallelSizes in Auto
    assert "gpuBudget" in spec["x-kubernetes-validations"][0]["rule"]
    assert spec["required"] == ["model", "gpuBudget"]


def test_strict_bounds_take_the_kubernetes_form() -> None:
    """The defect: pydantic's ``gt=0`` became ``exclusiveMinimum: 0`` and the API server
    refused the whole CRD ("expected boolean"), so every k8s test errored at setup."""
    schema = crdgen._structural({"type": "number", "exclusiveMinimum": 0, "maximum": 1}, {})
    assert schema == {"type": "number", "minimum": 0, "exclusiveMinimum": True, "maximum": 1}
