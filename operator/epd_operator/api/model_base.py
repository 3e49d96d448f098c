"""The base of every EPDDeployment model, and CEL rules as the CRD carries them.

Field names are snake_case in Python and camelCase in manifests; models are frozen and refuse
unknown fields (kubectl's strict validation does the same with the generated CRD).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel
from pydantic.config import JsonDict


class SpecModel(BaseModel):
    model_config = ConfigDict(
        extra="forbid", frozen=True, populate_by_name=True, alias_generator=to_camel
    )


def cel(rule: str, message: str, field_path: str = "", reason: str = "FieldValueInvalid") -> dict:
    """One ``x-kubernetes-validations`` entry; ``field_path`` (e.g. ``.name``) is where the
    API server reports it, relative to the object the rule sits on."""
    entry = {"rule": rule, "message": message, "reason": reason}
    if field_path:
        entry["fieldPath"] = field_path
    return entry


# A Kubernetes object the spec passes through without interpreting it (affinity, a volume's
# source, ...): kept whole by the API server instead of pruned, checked when the operator's
# Deployment is admitted.
PRESERVE_UNKNOWN: JsonDict = {"x-kubernetes-preserve-unknown-fields": True}


def map_list(*keys: str) -> JsonDict:
    """A list the API server treats as a map by ``keys``: duplicates rejected at admission."""
    return {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": [*keys]}
