"""What an engine pod carries besides the engine's own settings: per-role image, GPUs, placement
and arguments (``engine.roles``), and pod-level settings every pool shares (environment, extra
volumes, ``/dev/shm``, runtime and priority class, pull secrets, labels, annotations, affinity,
topology spread, the termination grace period).

``EngineSpec`` (spec.py) inherits ``PodSettings``, so these are fields of ``spec.engine``.
``role_pod`` resolves what one role's pods get: a field a role sets replaces the engine's,
except ``resources`` (merged per resource name) and ``extraArgs`` (appended).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import ConfigDict, Field, model_validator

from epd_engine.config import Role
from epd_operator.api.images import default_engine_image
from epd_operator.api.model_base import PRESERVE_UNKNOWN, SpecModel, cel, map_list
from epd_operator.api.pod_fields import (
    DNS_SUBDOMAIN,
    MAX_LIST_ITEMS,
    EnvFromSource,
    EnvVar,
    LabelValue,
    ObjectRef,
    Quantity,
    Resources,
    Toleration,
    Volume,
    VolumeMount,
)

# GPUs of one rank; an instance of N tensor-parallel ranks has N of them (tensorParallelSize)
MAX_GPUS_PER_INSTANCE = 1
# Labels the operator sets on every engine pod (selectors and the NetworkPolicy use them).
OPERATOR_LABEL_PREFIX = "epd.serving.dev/"
OPERATOR_LABELS = (
    "app.kubernetes.io/name",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/component",
)
# Seconds the engine keeps for its own shutdown after draining (router link, transfer
# backend, process exit) within the pod's termination grace period.
SHUTDOWN_MARGIN_S = 10
DEFAULT_TERMINATION_GRACE_S = 60

ClassName = Annotated[str, Field(min_length=1, max_length=253, pattern=DNS_SUBDOMAIN)]


TensorParallelSize = Literal[1, 2, 4, 8]  # config.TENSOR_PARALLEL_SIZES, for the schema


class RoleSettings(SpecModel):
    """One role's pods, where they differ from ``spec.engine`` (e.g. encoders on a cheaper GPU
    tier: another ``nodeSelector``, ``gpuResourceName`` or image)."""

    image: str | None = Field(default=None, min_length=1, description="Replaces engine.image.")
    gpus_per_instance: int | None = Field(
        default=None,
        ge=0,
        le=MAX_GPUS_PER_INSTANCE,
        description="Replaces engine.gpusPerInstance for this role (0: on CPU).",
    )
    tensor_parallel_size: TensorParallelSize | None = Field(
        default=None,
        description="Ranks each instance splits its language model over, one device each: "
        "the pods request gpusPerInstance x this many GPUs. Not for E (an encoder runs whole); "
        "in mode Fixed; heads must divide by it. Unset: 1.",
    )
    gpu_resource_name: str | None = Field(
        default=None, min_length=1, description="Replaces spec.gpuResourceName for this role."
    )
    resources: Resources | None = Field(
        default=None, description="Merged over engine.resources, per resource name."
    )
    node_selector: dict[str, str] | None = Field(
        default=None, max_length=MAX_LIST_ITEMS, description="Replaces engine.nodeSelector."
    )
    tolerations: list[Toleration] | None = Field(
        default=None, max_length=MAX_LIST_ITEMS, description="Replaces engine.tolerations."
    )
    extra_args: list[str] = Field(
        default_factory=list,
        max_length=MAX_LIST_ITEMS,
        description="Appended after engine.extraArgs (a flag given twice: the last wins).",
    )


# roles that run the language model (KV caches move between any sizes: kv_staging.py)
TENSOR_PARALLEL_ROLES = tuple(r for r in Role if r.needs_language)
_TP_ROLES_MESSAGE = (
    "tensorParallelSize above 1 splits the language model, which an E instance does not "
    "run (an encoder runs whole on one device)"
)


def _tp_rule(role: Role) -> dict:
    own = f"self.{role.value}"
    return cel(
        f"!has({own}) || !has({own}.tensorParallelSize) || {own}.tensorParallelSize == 1",
        _TP_ROLES_MESSAGE,
        f".{role.value}.tensorParallelSize",
    )


class RoleSettingsByRole(SpecModel):
    """Per-role settings; a role not named here runs as ``spec.engine`` says."""

    model_config = ConfigDict(
        alias_generator=None,
        json_schema_extra={
            "x-kubernetes-validations": [
                _tp_rule(r) for r in Role if r not in TENSOR_PARALLEL_ROLES
            ]
        },
    )

    E: RoleSettings | None = None
    P: RoleSettings | None = None
    D: RoleSettings | None = None
    EP: RoleSettings | None = None
    ED: RoleSettings | None = None
    PD: RoleSettings | None = None
    EPD: RoleSettings | None = None

    def get(self, role: Role) -> RoleSettings | None:
        settings: RoleSettings | None = getattr(self, role.value)
        return settings

    def tensor_parallel_size(self, role: Role) -> int:
        own = self.get(role)
        return own.tensor_parallel_size or 1 if own is not None else 1

    @model_validator(mode="after")
    def _tensor_parallel_roles(self) -> RoleSettingsByRole:
        for role in Role:
            if role not in TENSOR_PARALLEL_ROLES and self.tensor_parallel_size(role) > 1:
                raise ValueError(f"{role.value}.tensorParallelSize: {_TP_ROLES_MESSAGE}")
        return self


def _mounts_name_volumes_rule() -> str:
    return (
        "!has(self.volumeMounts) || self.volumeMounts.all(m, has(self.volumes) && "
        "self.volumes.exists(v, v.name == m.name))"
    )


def _labels_rule() -> str:
    ours = "[" + ", ".join(f"'{k}'" for k in OPERATOR_LABELS) + "]"
    return (
        f"!has(self.podLabels) || "
        f"self.podLabels.all(k, !k.startsWith('{OPERATOR_LABEL_PREFIX}') && !(k in {ours}))"
    )


class PodSettings(SpecModel):
    """Fields of ``spec.engine`` that shape the pods rather than the engine."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                cel(
                    _mounts_name_volumes_rule(),
                    "every volumeMounts[].name must name one of engine.volumes",
                    ".volumeMounts",
                ),
                cel(
                    _labels_rule(),
                    f"podLabels may not set {OPERATOR_LABEL_PREFIX}* or the "
                    "app.kubernetes.io labels the operator sets",
                    ".podLabels",
                ),
            ]
        }
    )

    roles: RoleSettingsByRole = Field(
        default_factory=lambda: RoleSettingsByRole(),
        description="Per-role image, GPUs, resources, placement and arguments.",
    )
    env: list[EnvVar] = Field(
        default_factory=list,
        max_length=MAX_LIST_ITEMS,
        description="Environment of the engine container (e.g. NCCL settings, HF_TOKEN from "
        "a Secret).",
        json_schema_extra=map_list("name"),
    )
    env_from: list[EnvFromSource] = Field(
        default_factory=list,
        max_length=MAX_LIST_ITEMS,
        description="ConfigMaps and Secrets whose keys become environment variables.",
    )
    volumes: list[Volume] = Field(
        default_factory=list,
        max_length=MAX_LIST_ITEMS,
        description="Extra pod volumes, each a name and a Kubernetes volume source.",
        json_schema_extra=map_list("name"),
    )
    volume_mounts: list[VolumeMount] = Field(
        default_factory=list,
        max_length=MAX_LIST_ITEMS,
        description="Where the engine container mounts engine.volumes.",
        json_schema_extra=map_list("mountPath"),
    )
    shm_size: Quantity | None = Field(
        default=None,
        description="sizeLimit of the memory-backed /dev/shm (shared-memory transfers, NCCL); "
        "unset: no limit of its own (it counts against the pod's memory).",
    )
    runtime_class_name: ClassName | None = Field(
        default=None, description="e.g. nvidia, where the GPU runtime is not the default."
    )
    priority_class_name: ClassName | None = None
    image_pull_secrets: list[ObjectRef] = Field(
        default_factory=list,
        max_length=MAX_LIST_ITEMS,
        description="Secrets for a private registry (engine and router pods).",
    )
    pod_labels: dict[str, LabelValue] = Field(default_factory=dict, max_length=MAX_LIST_ITEMS)
    pod_annotations: dict[str, str] = Field(default_factory=dict, max_length=MAX_LIST_ITEMS)
    affinity: dict[str, Any] | None = Field(
        default=None,
        description="A Pod's affinity (nodeAffinity, podAffinity, podAntiAffinity), as is.",
        json_schema_extra=PRESERVE_UNKNOWN,
    )
    topology_spread_constraints: list[
        Annotated[dict[str, Any], Field(json_schema_extra=PRESERVE_UNKNOWN)]
    ] = Field(default_factory=list, max_length=16, description="A Pod's, as is.")
    termination_grace_period_seconds: int = Field(
        default=DEFAULT_TERMINATION_GRACE_S,
        ge=SHUTDOWN_MARGIN_S + 5,
        le=3600,
        description="A terminating engine drains (no new requests, in-flight ones finish) "
        f"for this long less {SHUTDOWN_MARGIN_S} s, then hands back what is left.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> PodSettings:
        names = [v.name for v in self.volumes]
        if len(set(names)) != len(names):
            raise ValueError("engine.volumes names must be unique")
        if len({e.name for e in self.env}) != len(self.env):
            raise ValueError("engine.env names must be unique")
        if len({m.mount_path for m in self.volume_mounts}) != len(self.volume_mounts):
            raise ValueError("engine.volumeMounts mountPaths must be unique")
        unknown = sorted({m.name for m in self.volume_mounts} - set(names))
        if unknown:
            raise ValueError(
                "every volumeMounts[].name must name one of engine.volumes "
                f"(not found: {', '.join(unknown)})"
            )
        reserved = sorted(
            k
            for k in self.pod_labels
            if k.startswith(OPERATOR_LABEL_PREFIX) or k in OPERATOR_LABELS
        )
        if reserved:
            raise ValueError(f"podLabels may not set {', '.join(reserved)} (the operator's)")
        return self

    @property
    def drain_timeout_s(self) -> int:
        """How long a terminating engine drains before it hands back what is left."""
        return self.termination_grace_period_seconds - SHUTDOWN_MARGIN_S


@dataclass(frozen=True)
class RolePod:
    """One role's pod settings, resolved: the role's where set, else the engine's."""

    image: str
    gpus_per_rank: int  # an instance has one set per tensor-parallel rank (the plan's size)
    gpu_resource_name: str
    requests: dict[str, str]
    limits: dict[str, str]
    node_selector: dict[str, str]
    tolerations: list[Toleration]
    extra_args: list[str]


def role_pod(
    role: Role,
    roles: RoleSettingsByRole,
    image: str | None,
    gpus_per_instance: int,
    gpu_resource_name: str,
    resources: Resources,
    node_selector: dict[str, str],
    tolerations: list[Toleration],
    extra_args: list[str],
    without_gpus: bool = False,
) -> RolePod:
    """``role``'s settings over the engine's. ``without_gpus``: its pods take no GPU (an
    emulated instance), so the default image is the CPU one."""
    own = roles.get(role) or RoleSettings()
    gpus = own.gpus_per_instance if own.gpus_per_instance is not None else gpus_per_instance
    gpus = 0 if without_gpus else gpus
    return RolePod(
        # neither names one: the GPU image where the role has a GPU (api/images.py)
        image=own.image or image or default_engine_image(gpus),
        gpus_per_rank=gpus,
        gpu_resource_name=own.gpu_resource_name or gpu_resource_name,
        requests={**resources.requests, **(own.resources.requests if own.resources else {})},
        limits={**resources.limits, **(own.resources.limits if own.resources else {})},
        node_selector=dict(own.node_selector if own.node_selector is not None else node_selector),
        tolerations=list(own.tolerations if own.tolerations is not None else tolerations),
        extra_args=[*extra_args, *own.extra_args],
    )
