"""EPDDeployment spec and status as pydantic models: the one source of the CRD in ``crds/``.

Shared by the operator and the local launcher (``epdctl up -f manifest.yaml``), so this module
imports neither kopf nor the Kubernetes client. Field names are snake_case in Python and
camelCase in manifests (Kubernetes API conventions: integers and strings, no floats; conditions,
no phase). Rules that the OpenAPI schema cannot express are CEL rules
(``x-kubernetes-validations``) and are enforced here too, so both paths give the same answer.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, cast

import yaml
from pydantic import (
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    model_validator,
)

from epd_engine.config import SLO, Method, Role
from epd_engine.contracts.plan import Plan, Prediction
from epd_engine.transfer import TransferBackendName
from epd_operator.api.decision_status import PlanDecision
from epd_operator.api.model_base import SpecModel, cel
from epd_operator.api.placement import GROUP_RULES, PlacementSpec, check_groups
from epd_operator.api.pod_fields import (
    MAX_LIST_ITEMS,
    MAX_RESOURCE_NAMES,
    QUANTITY_PATTERN,
    Quantity,
    Resources,
    Toleration,
)
from epd_operator.api.pod_settings import (
    MAX_GPUS_PER_INSTANCE,
    PodSettings,
    RolePod,
    TensorParallelSize,
    role_pod,
)
from epd_operator.api.preset_ranks import check_preset_sizes

__all__ = [  # pod vocabulary re-exported: callers import the spec's types from here
    "MAX_LIST_ITEMS",
    "MAX_RESOURCE_NAMES",
    "QUANTITY_PATTERN",
    "Quantity",
    "Resources",
    "Toleration",
]

GROUP = "epd.serving.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "EPDDeployment"
PLURAL = "epddeployments"
SINGULAR = "epddeployment"
SHORT_NAME = "epd"

# CEL cannot sum a map, so pools is an object with one optional field per role.
_ROLE_SUM = " + ".join(f"(has(self.pools.{r.value}) ? self.pools.{r.value} : 0)" for r in Role)


def _role_gpus_cel(role: str) -> str:
    """CEL: GPUs of one instance of ``role`` (engine.roles.<role>.gpusPerInstance, else the
    engine's)."""
    own = f"self.engine.roles.{role}"
    return (
        f"(has(self.engine.roles) && has({own}) && has({own}.gpusPerInstance) ? "
        f"{own}.gpusPerInstance : self.engine.gpusPerInstance) * {_role_ranks_cel(role)}"
    )


def _role_ranks_cel(role: str) -> str:
    """CEL: tensor-parallel ranks of one instance of ``role`` (1 unless set)."""
    own = f"self.engine.roles.{role}"
    return (
        f"(has(self.engine.roles) && has({own}) && has({own}.tensorParallelSize) ? "
        f"{own}.tensorParallelSize : 1)"
    )


_FIXED_GPUS = (
    "("
    + " + ".join(
        f"(has(self.disaggregation.pools.{r.value}) ? self.disaggregation.pools.{r.value} : 0)"
        f" * {_role_gpus_cel(r.value)}"
        for r in Role
    )
    + ")"
)
_AUTO_ROLE_GPUS = " && ".join(
    f"{_role_gpus_cel(r.value)} <= self.engine.gpusPerInstance" for r in Role
)
_AUTO_ONE_RANK = " && ".join(f"{_role_ranks_cel(r.value)} == 1" for r in Role)
_AUTO_TP_MESSAGE = (
    "engine.roles.<role>.tensorParallelSize above 1 needs disaggregation mode Fixed: in mode "
    "Auto the profiler chooses each pool's size from disaggregation.tensorParallelSizes"
)
_AUTO_SIZES_MESSAGE = (
    "sizes above 1 are for mode Auto (the profiler chooses among them); in mode Fixed set "
    "engine.roles.<role>.tensorParallelSize"
)
_POOLS_MATCH_METHOD = " || ".join(
    f"(self.method == '{m.value}' && "
    + " && ".join(("" if r in m.roles else "!") + f"has(self.pools.{r.value})" for r in Role)
    + ")"
    for m in Method
)


_cel = cel
_Model = SpecModel


class ManifestError(ValueError):
    """An EPDDeployment manifest that does not validate; ``str()`` names every bad field."""


# --- model -----------------------------------------------------------------------------------


class PVCSource(_Model):
    """Weights on a PersistentVolumeClaim (HF hub layout under ``path``), mounted read-only (a
    ReadOnlyMany claim serves every node's pods)."""

    claim_name: str = Field(min_length=1, max_length=253, description="PVC name.")
    path: str = Field(
        default="",
        description="Sub-path of the checkpoint inside the volume; with huggingFaceCache the "
        "cache directory (holding models--<org>--<name>) inside it.",
    )


class HostPathSource(_Model):
    """Weights already on every GPU node."""

    path: str = Field(
        pattern=r"^/",
        description="Absolute checkpoint directory on the node; with huggingFaceCache the "
        "cache directory (holding models--<org>--<name>).",
    )


class HuggingFaceCache(_Model):
    """The pvc or hostPath volume is a Hugging Face hub cache (``huggingface-cli download``,
    ``HF_HUB_CACHE``): it is mounted whole, so the snapshot's files, symlinks into
    ``../../blobs``, resolve, and the engine loads ``models--<org>--<name>/snapshots/<rev>``."""

    repo: str = Field(
        max_length=200,
        pattern=r"^([A-Za-z0-9][-A-Za-z0-9_.]*/)?[A-Za-z0-9][-A-Za-z0-9_.]*$",
        description="Repository id, e.g. llava-hf/llava-1.5-7b-hf.",
    )
    revision: str = Field(
        default="main",
        max_length=255,
        pattern=r"^[A-Za-z0-9][-A-Za-z0-9_.]*$",
        description="A ref under refs/ (branch or tag) or a commit hash under snapshots/.",
    )

    def snapshot_path(self) -> str:
        """The snapshot directory relative to the cache (the engine resolves a ref name)."""
        return f"models--{self.repo.replace('/', '--')}/snapshots/{self.revision}"


class ModelSource(_Model):
    """Exactly one of pvc, hostPath or preset."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "(has(self.pvc) ? 1 : 0) + (has(self.hostPath) ? 1 : 0)"
                    " + (has(self.preset) ? 1 : 0) == 1",
                    "exactly one of pvc, hostPath or preset must be set",
                ),
                _cel(
                    "!has(self.huggingFaceCache) || has(self.pvc) || has(self.hostPath)",
                    "huggingFaceCache names a repository in the pvc or hostPath volume: "
                    "set one of them",
                    ".huggingFaceCache",
                ),
            ]
        }
    )

    pvc: PVCSource | None = None
    host_path: HostPathSource | None = None
    preset: (
        Literal["tiny-llava", "tiny-qwen2-vl", "tiny-qwen2.5-vl", "tiny-qwen3-vl", "tiny-gemma3"]
        | None
    ) = Field(default=None, description="Random-weight checkpoint made at start-up (for trials).")
    hugging_face_cache: HuggingFaceCache | None = Field(
        default=None, description="The pvc or hostPath volume is a Hugging Face hub cache."
    )

    @model_validator(mode="after")
    def _exactly_one(self) -> ModelSource:
        if sum(x is not None for x in (self.pvc, self.host_path, self.preset)) != 1:
            raise ValueError("exactly one of pvc, hostPath or preset must be set")
        if self.hugging_face_cache is not None and self.preset is not None:
            raise ValueError(
                "huggingFaceCache names a repository in the pvc or hostPath volume: set one of them"
            )
        return self


class ModelSpec(_Model):
    name: str = Field(
        min_length=1,
        max_length=63,
        pattern=r"^[a-zA-Z0-9][a-zA-Z0-9._-]*$",
        description="Served model name (the OpenAI `model` field) and mount directory.",
    )
    source: ModelSource
    dtype: Literal["float32", "float16", "bfloat16"] = "bfloat16"


# --- SLO, disaggregation, profiler -----------------------------------------------------------


class SLOSpec(_Model):
    ttft_milliseconds: int = Field(default=4000, ge=1, description="Time-to-first-token objective.")
    tpot_milliseconds: int = Field(
        default=80, ge=1, description="Time-per-output-token objective (p90)."
    )
    attainment_percent: int = Field(
        default=90, ge=1, le=100, description="Share of requests to meet both."
    )

    def to_slo(self) -> SLO:
        return SLO(
            ttft_s=self.ttft_milliseconds / 1000,
            tpot_s=self.tpot_milliseconds / 1000,
            attainment=self.attainment_percent / 100,
        )


class PoolCounts(_Model):
    """Instances per role; only the roles of the method may be set."""

    model_config = ConfigDict(alias_generator=None)

    E: int | None = Field(default=None, ge=1)
    P: int | None = Field(default=None, ge=1)
    D: int | None = Field(default=None, ge=1)
    EP: int | None = Field(default=None, ge=1)
    ED: int | None = Field(default=None, ge=1)
    PD: int | None = Field(default=None, ge=1)
    EPD: int | None = Field(default=None, ge=1)

    def as_dict(self) -> dict[Role, int]:
        return {r: n for r in Role if (n := getattr(self, r.value)) is not None}

    @classmethod
    def from_dict(cls, pools: dict[Role, int]) -> PoolCounts:
        return cls.model_validate({r.value: n for r, n in pools.items()})


class DisaggregationSpec(_Model):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "self.mode != 'Fixed' || (has(self.method) && has(self.pools))",
                    "mode Fixed needs method and pools",
                    reason="FieldValueRequired",
                ),
                _cel(
                    "self.mode != 'Auto' || !has(self.pools)",
                    "pools are chosen by the profiler in mode Auto; remove pools or use Fixed",
                    ".pools",
                ),
                _cel(
                    f"!has(self.method) || !has(self.pools) || {_POOLS_MATCH_METHOD}",
                    "pools must set exactly the roles of the method (E+P+D: E, P and D)",
                    ".pools",
                ),
                _cel(
                    "self.mode == 'Auto' || !has(self.tensorParallelSizes) || "
                    "self.tensorParallelSizes.all(s, s == 1)",
                    _AUTO_SIZES_MESSAGE,
                    ".tensorParallelSizes",
                ),
            ]
        }
    )

    mode: Literal["Auto", "Fixed"] = Field(
        default="Auto",
        description="Auto: the profiler picks method and pools; Fixed: use them as given.",
    )
    method: Method | None = None
    pools: PoolCounts | None = None
    tensor_parallel_sizes: list[TensorParallelSize] = Field(
        default_factory=lambda: [cast(TensorParallelSize, 1)],
        min_length=1,
        max_length=4,
        description="Mode Auto: the tensor-parallel sizes the profiler may give the instances "
        "of each pool that runs the language model, one rank per gpusPerInstance GPUs (the "
        "cost model must record its rank terms, as profile-costs' and the reference do; "
        "heads must divide by each). Default [1]. Mode Fixed sets "
        "engine.roles.<role>.tensorParallelSize instead.",
    )

    @model_validator(mode="after")
    def _consistent(self) -> DisaggregationSpec:
        if self.mode == "Fixed" and any(size > 1 for size in self.tensor_parallel_sizes):
            raise ValueError(f"tensorParallelSizes: {_AUTO_SIZES_MESSAGE}")
        if self.mode == "Fixed" and (self.method is None or self.pools is None):
            raise ValueError("mode Fixed needs method and pools")
        if self.mode == "Auto" and self.pools is not None:
            raise ValueError("pools are chosen by the profiler in mode Auto; remove pools")
        if self.method is not None and self.pools is not None:
            want = set(self.method.roles)
            got = set(self.pools.as_dict())
            if want != got:
                need = ", ".join(r.value for r in self.method.roles)
                raise ValueError(f"pools must set exactly the roles of {self.method.value}: {need}")
        return self


class CostModelRef(_Model):
    """A cost model JSON made by ``epdctl profile-costs``, stored in a ConfigMap."""

    config_map_name: str = Field(
        min_length=1,
        max_length=253,
        description="ConfigMap in the EPDDeployment's namespace that holds the cost model.",
    )
    key: str = Field(
        default="cost-model.json",
        min_length=1,
        max_length=253,
        pattern=r"^[-._a-zA-Z0-9]+$",
        description="Data key of the ConfigMap with the cost model JSON.",
    )


class ProfilerSpec(_Model):
    interval_seconds: int = Field(
        default=300, ge=30, description="How often to consider re-planning."
    )
    trace_window_seconds: int = Field(
        default=900, ge=60, description="Live trace window to plan on."
    )
    shift_threshold_percent: int = Field(
        default=20, ge=1, le=1000, description="Workload change that triggers a re-plan."
    )
    min_requests: int = Field(
        default=200, ge=1, description="Fewest requests in the window to re-plan."
    )
    switch_margin_percent: int = Field(
        default=10,
        ge=0,
        le=1000,
        description="A new plan replaces the current one only if its predicted goodput beats "
        "the current plan's, re-simulated on the same window, by this much.",
    )
    cooldown_seconds: int = Field(
        default=600, ge=0, description="Least time between two plan changes."
    )
    cost_model: CostModelRef | None = Field(
        default=None,
        description="Measured cost model the plan search simulates with; unset: the built-in "
        "synthetic reference (LLaVA-1.5-7B fp16 on an H800-class GPU).",
    )


class CapacitySpec(_Model):
    """How many GPUs the pools may hold, and how far ahead the loop sizes them (mode Auto)."""

    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    "!has(self.minGPUs) || !has(self.maxGPUs) || self.minGPUs <= self.maxGPUs",
                    "capacity.minGPUs must not exceed capacity.maxGPUs",
                    ".minGPUs",
                ),
            ]
        }
    )

    min_gpus: int | None = Field(
        default=None,
        ge=1,
        le=4096,
        alias="minGPUs",
        description="Fewest GPUs the loop scales down to; unset: maxGPUs (a fixed size).",
    )
    max_gpus: int | None = Field(
        default=None,
        ge=1,
        le=4096,
        alias="maxGPUs",
        description="Most GPUs the loop plans for; unset: gpuBudget. At most gpuBudget, which "
        "stays the ceiling of everything the pools hold, a rollout's old and new pools included.",
    )
    headroom_percent: int = Field(
        default=20,
        ge=0,
        le=400,
        description="The loop plans for the forecast request rate (the trend of the trace "
        "window projected over a rollout) plus this much: the fewest GPUs whose simulated "
        "goodput at the SLO covers it.",
    )
    scale_down_stabilization_seconds: int = Field(
        default=300,
        ge=0,
        le=86400,
        description="A plan with fewer GPUs replaces the current one only this long after the "
        "last plan change (scale-ups are not held back).",
    )


# --- engine, router, monitoring, rollout -----------------------------------------------------


_OBJ: Any = {"default": {}}
# Every router replica is called one by one on each drain (in-flight read, routing switch),
# so a pass grows with the count; 8 keeps a pass within a few timeouts.
MAX_ROUTER_REPLICAS = 8


class EngineSpec(PodSettings):
    """The engine every pool runs, and (``PodSettings``) what its pods carry."""

    image: str | None = Field(
        default=None,
        min_length=1,
        description="Unset: epd-engine-gpu:0.1.0 for instances with a GPU (FlashInfer, CuPy), "
        "epd-engine:0.1.0 on CPU (the same Dockerfile's two variants).",
    )
    image_pull_policy: Literal["Always", "IfNotPresent", "Never"] = "IfNotPresent"
    emulate: bool = Field(
        default=False,
        description="Run every engine pod as an emulated device (epdctl serve --emulate): the "
        "real scheduler, budgets and page accounting, timed by profiler.costModel (unset: "
        "the built-in reference); no GPU requested, no weights read, the model served as "
        "NAME-emulated. For exercising the control plane at fleet scale on CPU nodes; never "
        "evidence of engine speed.",
    )
    gpus_per_instance: int = Field(
        default=1,
        ge=0,
        le=MAX_GPUS_PER_INSTANCE,
        description="0 runs the engine on CPU, 1 on a GPU (per tensor-parallel rank: "
        "engine.roles.<role>.tensorParallelSize).",
    )
    kv_block_size: int = Field(default=16, ge=1, le=1024, description="Tokens per KV page.")
    num_kv_blocks: int | None = Field(
        default=None,
        ge=1,
        description="KV cache pages per instance; unset: 512 on CPU (more where a prompt of "
        "the model's largest image needs them), on a GPU what gpuMemoryFraction of the card "
        "leaves once the weights, the image cache and the largest step's activations are in.",
    )
    gpu_memory_fraction: float = Field(
        default=0.9, ge=0.01, le=1, description="Share of its GPU an instance may use."
    )
    num_image_blocks: int = Field(
        default=64,
        ge=1,
        description="Pages of the image-embedding cache; each engine raises it to hold the "
        "model's largest image (Qwen-VL: its processor's max_pixels).",
    )
    processor_max_pixels: int | None = Field(
        default=None,
        ge=1,
        description="Images are resized to at most this many pixels (Qwen2-VL, Qwen2.5-VL, "
        "Qwen3-VL: lowers the checkpoint processor's max_pixels, as vLLM's "
        "mm_processor_kwargs); the image cache and budgets follow. Unset: the checkpoint's.",
    )
    transfer_backend: TransferBackendName = Field(
        default="auto",
        description="Cache migration backend: auto (CPU: shared memory with same-host peers, "
        "else tcp; GPU: cuda_ipc with peers whose GPU the instance sees, else nixl, tcp "
        "without NIXL), tcp, shm, collective, nixl (NIXL over UCX: RDMA, CUDA IPC or TCP), "
        "cuda_ipc and nccl (GPU caches only).",
    )
    resources: Resources = Field(default_factory=Resources, json_schema_extra=_OBJ)
    node_selector: dict[str, str] = Field(default_factory=dict, max_length=MAX_LIST_ITEMS)
    tolerations: list[Toleration] = Field(default_factory=list, max_length=MAX_LIST_ITEMS)
    extra_args: list[str] = Field(default_factory=list, max_length=MAX_LIST_ITEMS)

    def kv_cache_args(self) -> list[str]:
        """``epdctl serve`` flags for the KV cache's size (unset: the engine sizes it)."""
        pages = [] if self.num_kv_blocks is None else ["--num-kv-blocks", str(self.num_kv_blocks)]
        return [*pages, "--gpu-memory-fraction", f"{self.gpu_memory_fraction:g}"]

    def image_size_args(self) -> list[str]:
        """``epdctl serve`` flags for how large an image may become (unset: the checkpoint's)."""
        if self.processor_max_pixels is None:
            return []
        return ["--processor-max-pixels", str(self.processor_max_pixels)]

    def gpus_for(self, role: Role, ranks: int) -> int:
        """GPUs of each instance of ``role`` at ``ranks`` tensor-parallel ranks (the plan's
        size): its own gpusPerInstance (else the engine's) for each rank."""
        own = self.roles.get(role)
        per_rank = self.gpus_per_instance
        if own is not None and own.gpus_per_instance is not None:
            per_rank = own.gpus_per_instance
        return per_rank * ranks

    def role_pod(self, role: Role, gpu_resource_name: str, without_gpus: bool = False) -> RolePod:
        """What ``role``'s pods run: its settings in ``roles`` over the engine's
        (``without_gpus``: an emulated instance's, on no GPU)."""
        return role_pod(
            role,
            self.roles,
            self.image,
            self.gpus_per_instance,
            gpu_resource_name,
            self.resources,
            self.node_selector,
            self.tolerations,
            self.extra_args,
            without_gpus,
        )


class RouterSpec(_Model):
    replicas: int = Field(
        default=1,
        ge=1,
        le=MAX_ROUTER_REPLICAS,
        description="Router pods; the operator switches and reads each one on every drain.",
    )
    service_type: Literal["ClusterIP", "NodePort", "LoadBalancer"] = "ClusterIP"
    port: int = Field(default=8080, ge=1, le=65535)
    image: str | None = Field(
        default=None, description="Defaults to engine.image, else epd-engine:0.1.0 (CPU)."
    )
    resources: Resources = Field(default_factory=Resources, json_schema_extra=_OBJ)
    node_selector: dict[str, str] = Field(default_factory=dict, max_length=MAX_LIST_ITEMS)
    tolerations: list[Toleration] = Field(default_factory=list, max_length=MAX_LIST_ITEMS)


class MonitoringSpec(_Model):
    prometheus_url: str | None = Field(default=None, pattern=r"^https?://")


class NetworkPolicySpec(_Model):
    enabled: bool = Field(
        default=True,
        description="NetworkPolicies: engine pods reachable only from this deployment's router "
        "and engines; router pods only on router.port.",
    )
    allow_from_namespaces: list[
        Annotated[str, StringConstraints(pattern=r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$", max_length=63)]
    ] = Field(
        default_factory=list,
        max_length=MAX_LIST_ITEMS,
        description="Namespaces also allowed to reach the engine port (e.g. Prometheus).",
    )


class RolloutSpec(_Model):
    drain_timeout_seconds: int = Field(
        default=60, ge=0, le=3600, description="Longest wait for in-flight requests of an old pool."
    )


EMULATE_GROUPS_MESSAGE = (
    "engine.emulate runs each instance as its own pod: placement.mode Groups is not emulated"
)


class EPDDeploymentSpec(_Model):
    model_config = ConfigDict(
        json_schema_extra={
            "x-kubernetes-validations": [
                _cel(
                    f"self.disaggregation.mode != 'Fixed' || !has(self.disaggregation.pools) || "
                    f"{_FIXED_GPUS} <= self.gpuBudget",
                    "the fixed pools need more GPUs (instances x engine.gpusPerInstance, or "
                    "the role's engine.roles.<role>.gpusPerInstance) than gpuBudget",
                    ".gpuBudget",
                ),
                _cel(
                    "!has(self.capacity) || !has(self.capacity.maxGPUs) || "
                    "self.capacity.maxGPUs <= self.gpuBudget",
                    "capacity.maxGPUs must not exceed gpuBudget (the ceiling of all the pools)",
                    ".capacity.maxGPUs",
                ),
                _cel(
                    "!has(self.capacity) || !has(self.capacity.minGPUs) || has(self.capacity."
                    "maxGPUs) || self.capacity.minGPUs <= self.gpuBudget",
                    "capacity.minGPUs must not exceed gpuBudget (capacity.maxGPUs unset)",
                    ".capacity.minGPUs",
                ),
                _cel(
                    f"self.disaggregation.mode != 'Auto' || ({_AUTO_ONE_RANK})",
                    _AUTO_TP_MESSAGE,
                    ".engine.roles",
                ),
                _cel(
                    f"self.disaggregation.mode != 'Auto' || {_AUTO_ROLE_GPUS}",
                    "mode Auto gives every instance engine.gpusPerInstance GPUs: a role's "
                    "gpusPerInstance may be lower, not higher",
                    ".engine.roles",
                ),
                *GROUP_RULES,
                _cel(
                    "!has(self.engine.emulate) || !self.engine.emulate || !has(self.placement) "
                    "|| self.placement.mode != 'Groups'",
                    EMULATE_GROUPS_MESSAGE,
                    ".engine.emulate",
                ),
            ]
        }
    )

    model: ModelSpec
    gpu_budget: int = Field(ge=1, le=4096, description="GPUs the pools may use at most, in total.")
    capacity: CapacitySpec = Field(default_factory=lambda: CapacitySpec(), json_schema_extra=_OBJ)
    gpu_resource_name: str = Field(default="nvidia.com/gpu", min_length=1)
    slo: SLOSpec = Field(default_factory=lambda: SLOSpec(), json_schema_extra=_OBJ)
    disaggregation: DisaggregationSpec = Field(
        default_factory=lambda: DisaggregationSpec(), json_schema_extra=_OBJ
    )
    profiler: ProfilerSpec = Field(default_factory=lambda: ProfilerSpec(), json_schema_extra=_OBJ)
    engine: EngineSpec = Field(default_factory=lambda: EngineSpec(), json_schema_extra=_OBJ)
    router: RouterSpec = Field(default_factory=lambda: RouterSpec(), json_schema_extra=_OBJ)
    monitoring: MonitoringSpec = Field(
        default_factory=lambda: MonitoringSpec(), json_schema_extra=_OBJ
    )
    rollout: RolloutSpec = Field(default_factory=lambda: RolloutSpec(), json_schema_extra=_OBJ)
    network_policy: NetworkPolicySpec = Field(
        default_factory=lambda: NetworkPolicySpec(), json_schema_extra=_OBJ
    )
    placement: PlacementSpec = Field(
        default_factory=lambda: PlacementSpec(),
        json_schema_extra=_OBJ,
        description="Whether the instances that exchange caches share a pod.",
    )

    @model_validator(mode="after")
    def _within_budget(self) -> EPDDeploymentSpec:
        pools = self.disaggregation.pools
        engine = self.engine
        if self.disaggregation.mode == "Fixed" and pools is not None:
            gpus = sum(
                n * engine.gpus_for(role, engine.roles.tensor_parallel_size(role))
                for role, n in pools.as_dict().items()
            )
            if gpus > self.gpu_budget:
                raise ValueError(
                    f"the fixed pools need {gpus} GPUs (instances x engine.gpusPerInstance, or "
                    f"the role's engine.roles.<role>.gpusPerInstance) but gpuBudget is "
                    f"{self.gpu_budget}"
                )
        capacity = self.capacity
        max_gpus = capacity.max_gpus if capacity.max_gpus is not None else self.gpu_budget
        if max_gpus > self.gpu_budget:
            raise ValueError(
                f"capacity.maxGPUs ({max_gpus}) must not exceed gpuBudget ({self.gpu_budget}, "
                "the ceiling of all the pools)"
            )
        if capacity.min_gpus is not None and capacity.min_gpus > max_gpus:
            raise ValueError(
                f"capacity.minGPUs ({capacity.min_gpus}) must not exceed capacity.maxGPUs "
                f"({max_gpus})"
            )
        if self.disaggregation.mode == "Auto":
            if any(engine.roles.tensor_parallel_size(r) > 1 for r in Role):
                raise ValueError(_AUTO_TP_MESSAGE)
            over = [r.value for r in Role if engine.gpus_for(r, 1) > engine.gpus_per_instance]
            if over:
                raise ValueError(
                    "mode Auto gives every instance engine.gpusPerInstance GPUs: a role's "
                    f"gpusPerInstance may be lower, not higher ({', '.join(over)})"
                )
        fixed = [(f"engine.roles.{r.value}.tensorParallelSize", ranks)
                 for r in Role if (ranks := engine.roles.tensor_parallel_size(r)) > 1]  # fmt: skip
        auto = [("disaggregation.tensorParallelSizes", n)
                for n in self.disaggregation.tensor_parallel_sizes]  # fmt: skip
        check_preset_sizes(self.model.source.preset, [*fixed, *auto])
        method = self.disaggregation.method
        check_groups(self.placement, method, engine.transfer_backend, engine.roles)
        if engine.emulate and self.placement.grouped:
            raise ValueError(EMULATE_GROUPS_MESSAGE)
        return self


# --- status ----------------------------------------------------------------------------------


class Condition(_Model):
    type: Literal["Ready", "Progressing", "Degraded", "Planned"]
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(pattern=r"^[A-Z][A-Za-z0-9]*$")
    message: str = ""
    last_transition_time: str = ""
    observed_generation: int = 0


class PlanStatus(_Model):
    method: Method
    pools: PoolCounts
    tensor_parallel: PoolCounts | None = Field(
        default=None,
        description="Tensor-parallel ranks of each instance, per role where above 1 (unset: 1).",
    )
    summary: str = Field(
        default="", description="Instances per role, e.g. `1E2P1D` (`1E 1Px2 1D`: P at 2 ranks)."
    )
    reason: str = ""
    predicted_goodput_rps: str = Field(
        default="", description="Decimal string (no floats in the API)."
    )
    predicted_ttft_p90_milliseconds: int | None = Field(
        default=None, ge=0, description="p90 TTFT the profiler predicts at that goodput."
    )
    predicted_tpot_p90_milliseconds: int | None = Field(
        default=None, ge=0, description="p90 TPOT the profiler predicts at that goodput."
    )
    revision: int = Field(default=1, ge=1)

    @classmethod
    def from_plan(cls, plan: Plan, revision: int) -> PlanStatus:
        p = plan.predicted
        return cls(
            method=plan.method,
            pools=PoolCounts.from_dict(dict(plan.pools)),
            tensor_parallel=(
                PoolCounts.from_dict(dict(plan.tensor_parallel)) if plan.tensor_parallel else None
            ),
            summary=plan.describe().split(" ", 1)[1],
            reason=plan.reason,
            predicted_goodput_rps=f"{p.goodput_rps:.2f}" if p else "",
            predicted_ttft_p90_milliseconds=round(p.ttft_p90_s * 1000) if p else None,
            predicted_tpot_p90_milliseconds=round(p.tpot_p90_s * 1000) if p else None,
            revision=revision,
        )

    def to_plan(self) -> Plan:
        """The plan as recorded (predictions at the status's precision; no batch budgets)."""
        predicted = None
        if self.predicted_goodput_rps:
            predicted = Prediction(
                goodput_rps=float(self.predicted_goodput_rps),
                ttft_p90_s=(self.predicted_ttft_p90_milliseconds or 0) / 1000,
                tpot_p90_s=(self.predicted_tpot_p90_milliseconds or 0) / 1000,
            )
        return Plan(
            method=self.method,
            pools=self.pools.as_dict(),
            tensor_parallel=self.tensor_parallel.as_dict() if self.tensor_parallel else {},
            reason=self.reason,
            predicted=predicted,
        )


class PoolStatus(_Model):
    name: str
    role: Role
    desired: int = Field(ge=0)
    ready: int = Field(ge=0)
    gpus: int = Field(ge=0)
    state: Literal["Starting", "Active", "Draining"]


class WorkloadSnapshot(_Model):
    """The live workload the current plan was made on (integers; rates in milli-units)."""

    num_requests: int = Field(ge=0)
    request_rate_milli_rps: int = Field(ge=0)
    mean_prompt_tokens: int | None = None
    mean_images_milli: int | None = None
    mean_output_tokens: int | None = None


class EPDDeploymentStatus(_Model):
    observed_generation: int = 0
    conditions: list[Condition] = Field(default_factory=list)
    plan: PlanStatus | None = None
    pools: list[PoolStatus] = Field(default_factory=list)
    active_pools: list[str] = Field(
        default_factory=list, description="Pools the router sends requests to."
    )
    ready_pools: str = Field(default="", description="Ready pools of the plan, e.g. `3/3`.")
    draining_since: str = Field(default="", description="RFC 3339 time the current drain started.")
    last_planned: str = Field(default="", description="RFC 3339 time of the last (re-)plan.")
    last_plan_change: str = Field(
        default="", description="RFC 3339 time the plan last changed (the cooldown counts from it)."
    )
    planned_on: WorkloadSnapshot | None = Field(
        default=None, description="Workload of the last re-plan (Auto mode)."
    )
    decision: PlanDecision | None = Field(
        default=None,
        description="Why the last re-plan decided what it did: rate seen, forecast, target, "
        "plan, predicted goodput, GPUs (Auto mode).",
    )
    last_switch_milliseconds: int | None = Field(
        default=None,
        ge=0,
        description="Decision to serving of the last plan change (the forecast's horizon).",
    )


# --- the object and loaders ------------------------------------------------------------------


class EPDDeployment(_Model):
    api_version: Literal["epd.serving.dev/v1alpha1"] = "epd.serving.dev/v1alpha1"
    kind: Literal["EPDDeployment"] = "EPDDeployment"
    metadata: dict[str, Any] = Field(default_factory=dict)
    spec: EPDDeploymentSpec
    status: EPDDeploymentStatus | None = None

    @property
    def name(self) -> str:
        return str(self.metadata.get("name", "epd"))

    @classmethod
    def from_dict(cls, data: Any, source: str = "manifest") -> EPDDeployment:
        if not isinstance(data, dict):
            raise ManifestError(f"{source}: expected a mapping with apiVersion, kind and spec")
        try:
            return cls.model_validate(data)
        except ValidationError as exc:
            raise ManifestError(f"{source}: invalid EPDDeployment\n{_describe(exc)}") from None

    @classmethod
    def from_yaml(cls, path: str | Path) -> EPDDeployment:
        """Load and validate a manifest file (the first EPDDeployment document in it)."""
        text = Path(path).read_text()
        try:
            docs = [d for d in yaml.safe_load_all(text) if d is not None]
        except yaml.YAMLError as exc:
            raise ManifestError(f"{path}: not valid YAML: {exc}") from None
        for doc in docs:
            if isinstance(doc, dict) and doc.get("kind") == KIND:
                return cls.from_dict(doc, str(path))
        raise ManifestError(f"{path}: no document with kind: {KIND}")


def _describe(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        loc = ".".join(str(p) for p in err["loc"] if not str(p).startswith("function-"))
        msg = err["msg"].removeprefix("Value error, ")
        lines.append(f"  {loc or '(root)'}: {msg}")
    return "\n".join(lines)


def fixed_plan(spec: EPDDeploymentSpec) -> Plan:
    """The plan of a ``mode: Fixed`` spec. Raises ValueError for ``mode: Auto``."""
    d = spec.disaggregation
    if d.mode != "Fixed" or d.method is None or d.pools is None:
        raise ValueError("disaggregation.mode is Auto: the plan comes from the profiler")
    sizes = {r: n for r in d.method.roles if (n := spec.engine.roles.tensor_parallel_size(r)) > 1}
    return Plan(
        method=d.method,
        pools=d.pools.as_dict(),
        tensor_parallel=sizes,
        reason="fixed by spec.disaggregation",
    )
