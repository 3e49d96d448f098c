"""Kubernetes pod vocabulary an EPDDeployment carries into its engine pods.

What the operator interprets is typed and validated here (names, mount paths, quantities,
references); what it only passes through (a volume's source, an env var's ``valueFrom``,
affinity, topology spread) is kept whole (``x-kubernetes-preserve-unknown-fields``) and
checked by the API server when the operator's Deployment is admitted, so the CRD does not
repeat the core API's schema.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, StringConstraints, model_validator

from epd_operator.api.model_base import PRESERVE_UNKNOWN, SpecModel, cel

# A Kubernetes resource quantity (apimachinery's resource.Quantity grammar: a decimal number
# and an optional binary or decimal suffix or exponent), so "8Gb" is rejected at admission.
QUANTITY_PATTERN = r"^[+]?([0-9]+(\.[0-9]*)?|\.[0-9]+)(([KMGTPE]i)|[numkMGTPE]|([eE][+-]?[0-9]+))?$"
Quantity = Annotated[str, StringConstraints(pattern=QUANTITY_PATTERN, max_length=64)]
MAX_RESOURCE_NAMES = 16
MAX_LIST_ITEMS = 64
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$"
ObjectName = Annotated[str, StringConstraints(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)]

# Names the operator gives its own volumes, mounts and environment variables: a pod setting
# may not take them (a second "model" volume, or another EPD_INTERNAL_TOKEN, would break the
# pod the operator renders).
RESERVED_VOLUMES = ("model", "shm", "tmp")
RESERVED_ENV = ("EPD_INTERNAL_TOKEN", "EPD_DEPLOYMENT_ID", "POD_IP", "POD_NAME")
RESERVED_MOUNT_PATHS = ("/models", "/dev/shm", "/tmp")


def _cel_list(values: tuple[str, ...]) -> str:
    return "[" + ", ".join(f"'{v}'" for v in values) + "]"


def _passthrough(description: str) -> Any:
    return Field(default=None, description=description, json_schema_extra=PRESERVE_UNKNOWN)


class Toleration(SpecModel):
    key: str = ""
    operator: Literal["Exists", "Equal"] = "Equal"
    value: str = ""
    effect: Literal["", "NoSchedule", "PreferNoSchedule", "NoExecute"] = ""
    # NoExecute only: how long a pod stays on a node with the taint (e.g. 30 with
    # node.kubernetes.io/unreachable reschedules a lost node's pods after 30 s, not 300 s)
    toleration_seconds: int | None = Field(default=None, ge=0)


class Resources(SpecModel):
    """Container resources as Kubernetes quantity strings (e.g. ``cpu: "8"``, ``memory: 64Gi``)."""

    requests: dict[str, Quantity] = Field(default_factory=dict, max_length=MAX_RESOURCE_NAMES)
    limits: dict[str, Quantity] = Field(default_factory=dict, max_length=MAX_RESOURCE_NAMES)


class EnvVar(SpecModel):
    """A container environment variable: a ``value``, or a ``valueFrom`` (a Secret's key, a
    ConfigMap's, a field of the pod) passed through as Kubernetes defines it."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "!(has(self.value) && has(self.valueFrom))",
                    "set value or valueFrom, not both",
                ),
                cel(
                    f"!(self.name in {_cel_list(RESERVED_ENV)})",
                    f"{', '.join(RESERVED_ENV)} are set by the operator",
                    ".name",
                ),
            ]
        }
    )

    name: str = Field(min_length=1, max_length=253, pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
    value: str | None = None
    value_from: dict[str, Any] | None = _passthrough(
        "secretKeyRef, configMapKeyRef, fieldRef or resourceFieldRef, as in a Pod."
    )

    @model_validator(mode="after")
    def _one_source(self) -> EnvVar:
        if self.value is not None and self.value_from is not None:
            raise ValueError("set value or valueFrom, not both")
        if self.name in RESERVED_ENV:
            raise ValueError(f"{', '.join(RESERVED_ENV)} are set by the operator")
        return self


class ObjectRef(SpecModel):
    name: ObjectName
    optional: bool | None = None


class EnvFromSource(SpecModel):
    """Every key of a ConfigMap or Secret as environment variables (e.g. an HF token)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    "has(self.configMapRef) != has(self.secretRef)",
                    "set exactly one of configMapRef or secretRef",
                )
            ]
        }
    )

    prefix: str = Field(default="", max_length=253)
    config_map_ref: ObjectRef | None = None
    secret_ref: ObjectRef | None = None

    @model_validator(mode="after")
    def _exactly_one(self) -> EnvFromSource:
        if (self.config_map_ref is None) == (self.secret_ref is None):
            raise ValueError("set exactly one of configMapRef or secretRef")
        return self


class Volume(SpecModel):
    """A pod volume: its ``name`` (mounted by ``volumeMounts``) and one volume source
    (``persistentVolumeClaim``, ``configMap``, ``secret``, ``emptyDir``, ``hostPath``, ``csi``,
    ...) passed through as Kubernetes defines it."""

    model_config = ConfigDict(
        extra="allow",
        json_schema_extra={
            **PRESERVE_UNKNOWN,
            "x-kubernetes-validations": [
                cel(
                    f"!(self.name in {_cel_list(RESERVED_VOLUMES)})",
                    f"the volume names {', '.join(RESERVED_VOLUMES)} are the operator's",
                    ".name",
                )
            ],
        },
    )

    name: str = Field(max_length=63, pattern=DNS_LABEL)

    @model_validator(mode="after")
    def _not_reserved(self) -> Volume:
        if self.name in RESERVED_VOLUMES:
            raise ValueError(f"the volume names {', '.join(RESERVED_VOLUMES)} are the operator's")
        return self

    def manifest(self) -> dict[str, Any]:
        return {"name": self.name, **(self.model_extra or {})}


def _reserved_path_rule() -> str:
    exact = " || ".join(f"self.mountPath == '{p}'" for p in RESERVED_MOUNT_PATHS)
    under = " || ".join(f"self.mountPath.startsWith('{p}/')" for p in RESERVED_MOUNT_PATHS)
    return f"!({exact} || {under})"


class VolumeMount(SpecModel):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    _reserved_path_rule(),
                    f"{', '.join(RESERVED_MOUNT_PATHS)} and what is under them are the "
                    "operator's mounts",
                    ".mountPath",
                )
            ]
        }
    )

    name: str = Field(max_length=63, pattern=DNS_LABEL)
    mount_path: str = Field(min_length=2, max_length=1024, pattern=r"^/")
    read_only: bool = False
    sub_path: str = Field(default="", max_length=1024, pattern=r"^([^/].*)?$")

    @model_validator(mode="after")
    def _not_reserved(self) -> VolumeMount:
        path = self.mount_path.rstrip("/")
        if any(path == p or path.startswith(f"{p}/") for p in RESERVED_MOUNT_PATHS):
            raise ValueError(
                f"{', '.join(RESERVED_MOUNT_PATHS)} and what is under them are the operator's "
                "mounts"
            )
        return self

    def manifest(self) -> dict[str, Any]:
        return self.model_dump(by_alias=True, exclude_defaults=True) | {
            "name": self.name,
            "mountPath": self.mount_path,
        }


# Label values as Kubernetes allows them (at most 63 characters, alphanumeric at both ends).
LabelValue = Annotated[
    str,
    StringConstraints(max_length=63, pattern=r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$"),
]
