"""Roles, SLOs and engine configuration: frozen, validated at construction.

This module imports no torch so the operator, the planner and the simulator can use it.
Environment variables are read only here (prefix ``EPD_``).
"""

from __future__ import annotations

import enum
import functools
import os
import secrets
from dataclasses import dataclass, field
from pathlib import Path


class Stage(enum.StrEnum):
    """The three stages of a multimodal request, in execution order."""

    ENCODE = "encode"
    PREFILL = "prefill"
    DECODE = "decode"


STAGE_ORDER: tuple[Stage, ...] = (Stage.ENCODE, Stage.PREFILL, Stage.DECODE)
_LETTER = {"E": Stage.ENCODE, "P": Stage.PREFILL, "D": Stage.DECODE}


class Role(enum.StrEnum):
    """The stages one instance runs. A method is a set of roles covering each stage once."""

    E = "E"
    P = "P"
    D = "D"
    EP = "EP"
    ED = "ED"
    PD = "PD"
    EPD = "EPD"

    @property
    def stages(self) -> frozenset[Stage]:
        # a table, not a new frozenset per call: the simulator asks millions of times
        return _ROLE_STAGES[self]

    def runs(self, stage: Stage) -> bool:
        return stage in _ROLE_STAGES[self]

    @property
    def needs_vision(self) -> bool:
        return Stage.ENCODE in self.stages

    @property
    def needs_language(self) -> bool:
        return bool(self.stages & {Stage.PREFILL, Stage.DECODE})

    @property
    def decodes(self) -> bool:
        return Stage.DECODE in self.stages


_ROLE_STAGES = {role: frozenset(_LETTER[c] for c in role.value) for role in Role}


class Method(enum.StrEnum):
    """A disaggregation method: pools whose roles cover every stage exactly once."""

    E_P_D = "E+P+D"
    EP_D = "EP+D"
    ED_P = "ED+P"
    E_PD = "E+PD"
    EPD = "EPD"

    @property
    def roles(self) -> tuple[Role, ...]:
        return tuple(Role(part) for part in self.value.split("+"))

    def role_for(self, stage: Stage) -> Role:
        """The pool role that runs ``stage`` under this method."""
        return next(role for role in self.roles if role.runs(stage))


ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")


@dataclass(frozen=True)
class SLO:
    """Latency objectives. A request meets them when TTFT <= ttft_s and p90 TPOT <= tpot_s."""

    ttft_s: float = 4.0  # HydraInfer v2, LLaVA-1.5-7B
    tpot_s: float = 0.08
    attainment: float = 0.9

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.tpot_s <= 0:
            raise ValueError(
                f"SLOs must be positive, got ttft_s={self.ttft_s} tpot_s={self.tpot_s}"
            )
        if not 0 < self.attainment <= 1:
            raise ValueError(f"attainment must be in (0, 1], got {self.attainment}")


TENSOR_PARALLEL_SIZES = (1, 2, 4, 8)  # the GPUs of one node an instance may span


@dataclass(frozen=True)
class EngineConfig:
    """Everything one engine instance needs to start. Built from CLI flags or a ConfigMap."""

    model_dir: Path
    role: Role = Role.EPD
    served_model_name: str | None = None
    device: str = "cpu"
    dtype: str = "float32"
    kv_block_size: int = 16  # tokens per KV page (HydraInfer)
    # keep written KV pages, keyed by their prefix, for later requests (cache/kv_cache.py)
    prefix_cache: bool = True
    # KV pages; None: 512 on CPU (more where a prompt of the largest image needs them), on
    # CUDA what ``gpu_memory_fraction`` of the card leaves once the weights, the image cache
    # and the largest step's activations are counted (worker/memory_plan.py)
    num_kv_blocks: int | None = None
    gpu_memory_fraction: float = 0.9  # this instance's share of its GPU (weights + caches)
    dual_stream: bool = True  # CUDA: encode on its own stream beside the LM (encode_stream.py)
    # pages of the image-embedding cache (LLaVA: one image a page; Qwen: 64 tokens a page); the
    # engine raises it to hold the model's largest image (model/image_bounds.py)
    num_image_blocks: int = 64
    # images are resized to at most this many pixels (dynamic-resolution models: lowers the
    # processor's max_pixels, as vLLM's mm_processor_kwargs); None: the checkpoint's
    processor_max_pixels: int | None = None
    max_num_running: int = 256  # decode concurrency cap
    max_model_len: int | None = None  # defaults to the model's context window
    token_budget: int | None = None  # None: found at start-up by binary search against the SLO
    # tau_e, image tokens encoded per iteration: give it as tokens, or as images of one
    # image-cache page each (``image_budget`` x the model's page tokens: LLaVA-1.5 576); neither:
    # found at start-up like the token budget
    image_budget: int | None = None
    image_token_budget: int | None = None
    max_images_per_request: int = 8
    max_image_bytes: int = 20 * 1024 * 1024
    slo: SLO = field(default_factory=SLO)
    budget_alpha: float = 0.5  # iteration must stay under alpha * TTFT (or TPOT when decoding)
    # attention kernels: auto (FlashInfer on CUDA when it can run, else torch SDPA), torch,
    # flashinfer (model/attention_select.py)
    attention_backend: str = "auto"
    # capture the decode forward in CUDA graphs per padded batch size; used only on CUDA
    # with a graph-safe attention backend (FlashInfer), ignored elsewhere (model/decode_graphs.py)
    cuda_graphs: bool = True
    # launch the next step before reading this one's tokens back (engine/inflight.py). None:
    # on where a CUDA device runs the step while the host prepares the next (+10-29 % served
    # tokens/s on an H200, docs/gpu.md), off on a CPU, where the host runs the step itself
    async_scheduling: bool | None = None
    # image decoding, chat template and tokenizing in this many worker processes, off the
    # engine's GIL (server/preprocess_pool.py); 0: in a thread of the instance's process
    preprocess_workers: int = 0
    cpu_threads: int = (
        1  # per instance; several instances share the cores, oversubscribing is 20x slower
    )
    # limits at the edge (server/limits.py, images.py, remote_images.py): checked before work
    max_request_bytes: int = 32 * 1024 * 1024
    max_image_pixels: int = 4096 * 4096  # per image, read from its header before decoding
    max_request_pixels: int = 2 * 4096 * 4096  # all images of one request together
    max_prompt_tokens: int | None = None  # None: the context window less one output token
    remote_image_hosts: tuple[str, ...] = ()  # http(s) image hosts allowed; () = none, "*" any
    # out of service when the engine thread makes no progress this long while it has work
    # (engine/health.py); 0: never. Above any step's time (a cold kernel's compile included)
    stall_timeout_s: float = 120.0
    # ranks the language model is split over, one device each (parallel/); the vision tower
    # and the image cache stay on rank 0
    tensor_parallel_size: int = 1
    # a rank waits this long in a collective for a hung peer (a dead one fails it at once)
    rank_timeout_s: float = 120.0
    fault_injection: str = ""  # tests only: EPD_FAULT_INJECT (worker/fault_injection.py)

    def __post_init__(self) -> None:
        self._check_tensor_parallel()
        if self.async_scheduling is None:
            on = self.device.startswith("cuda") and self.tensor_parallel_size == 1
            object.__setattr__(self, "async_scheduling", on)
        for name in (
            "kv_block_size",
            "num_image_blocks",
            "max_num_running",
            "max_request_bytes",
            "max_image_pixels",
            "max_request_pixels",
        ):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 < self.gpu_memory_fraction <= 1:
            raise ValueError(
                f"gpu_memory_fraction must be in (0, 1], got {self.gpu_memory_fraction}"
            )
        names = (
            "num_kv_blocks",
            "token_budget",
            "image_budget",
            "image_token_budget",
            "processor_max_pixels",
        )
        for name in (*names, "max_prompt_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.image_budget is not None and self.image_token_budget is not None:
            raise ValueError(
                "give image_budget (images of one cache page) or image_token_budget (tokens), "
                "not both"
            )
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"attention_backend must be one of {', '.join(ATTENTION_BACKENDS)}, "
                f"got {self.attention_backend!r}"
            )
        if self.dtype not in ("float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {self.dtype!r}")
        if self.preprocess_workers < 0:
            raise ValueError(f"preprocess_workers must be >= 0, got {self.preprocess_workers}")
        if self.stall_timeout_s < 0:
            raise ValueError(f"stall_timeout_s must be >= 0, got {self.stall_timeout_s}")

    def _check_tensor_parallel(self) -> None:
        size = self.tensor_parallel_size
        if size not in TENSOR_PARALLEL_SIZES:
            sizes = ", ".join(map(str, TENSOR_PARALLEL_SIZES))
            raise ValueError(f"tensor_parallel_size must be one of {sizes}, got {size}")
        if size == 1:
            return
        if not self.role.needs_language:
            raise ValueError(
                f"tensor_parallel_size {size} splits the language model, which an {self.role} "
                "instance does not run (encoders run whole on one device)"
            )
        if self.async_scheduling:
            raise ValueError(
                "async_scheduling is not supported with tensor_parallel_size > 1 (the other "
                "ranks would need each step's draws)"
            )
        if self.rank_timeout_s <= 0:
            raise ValueError(f"rank_timeout_s must be > 0, got {self.rank_timeout_s}")

    @property
    def model_name(self) -> str:
        return self.served_model_name or Path(self.model_dir).name


def env_str(name: str, default: str) -> str:
    """Read an ``EPD_``-prefixed environment variable (the only place the engine reads env)."""
    return os.environ.get(f"EPD_{name}", default)


def fault_injection_spec() -> str:
    """``EPD_FAULT_INJECT``: a device fault to inject, in tests (worker/fault_injection.py)."""
    return env_str("FAULT_INJECT", "")


def internal_token_set() -> bool:
    """Whether this process was given the deployment's shared secret."""
    return bool(env_str("INTERNAL_TOKEN", ""))


@functools.cache
def _process_token() -> str:
    return secrets.token_urlsafe(32)


def internal_token() -> str:
    """Shared secret for internal endpoints (registration, migration, trace).

    Never a well-known default: without ``EPD_INTERNAL_TOKEN`` the process makes a random
    one nobody else knows, so its internal endpoints refuse every caller."""
    return env_str("INTERNAL_TOKEN", "") or _process_token()


def deployment_id() -> str:
    """Which deployment (one ``epdctl up`` run, one EPDDeployment) this process belongs to;
    instances prove it on registration so a stale process of an earlier run is refused.
    Empty: not checked."""
    return env_str("DEPLOYMENT_ID", "")


def placement_group() -> str:
    """``EPD_GROUP``: the placement group this instance is a member of, set by ``epdctl
    group`` for its members (one pod); the router's table carries it so a source hands a
    request to a peer of its own group first. Empty: not in a group."""
    return env_str("GROUP", "")
