"""Which attention backend an engine runs: ``auto`` (default), ``torch`` or ``flashinfer``.

``auto`` picks FlashInfer on a CUDA device when ``import flashinfer`` works, the model's
head size and dtype are ones its kernels are built for, and those kernels are here (built
ahead of time, or nvcc to compile them: ``flashinfer_kernels.py``); otherwise torch SDPA,
with one log line saying why. torch is the CPU backend. An explicit ``flashinfer`` that
cannot run is an error naming the reason, never a silent fallback.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from epd_engine.config import ATTENTION_BACKENDS
from epd_engine.model.attention import AttentionBackend
from epd_engine.model.attention_torch import TorchPagedAttention
from epd_engine.model.flashinfer_kernels import missing_kernels_reason
from epd_engine.model.flashinfer_plan import unsupported_reason

log = logging.getLogger(__name__)


def flashinfer_import_error() -> str | None:
    """Why ``import flashinfer`` fails here, or None when it works."""
    try:
        import flashinfer  # noqa: F401
    except Exception as exc:  # ImportError, or a CUDA/torch mismatch raised at import
        return f"flashinfer is not importable ({type(exc).__name__}: {exc})"
    return None


def select_attention_backend(
    device: torch.device | str,
    requested: str,
    dtype: torch.dtype,
    head_dim: int,
    import_error: Callable[[], str | None] = flashinfer_import_error,
    kernels_error: Callable[[int, torch.dtype], str | None] = missing_kernels_reason,
) -> str:
    """``"torch"`` or ``"flashinfer"`` for ``requested`` on ``device``; raises ValueError
    when ``flashinfer`` is requested and cannot run."""
    if requested not in ATTENTION_BACKENDS:
        raise ValueError(
            f"attention backend must be one of {ATTENTION_BACKENDS}, got {requested!r}"
        )
    if requested == "torch":
        return "torch"
    device = torch.device(device)
    reason = None
    if device.type != "cuda":
        reason = f"device {device} is not CUDA"
    if reason is None:
        unsupported = unsupported_reason(head_dim, dtype)
        reason = f"the model has {unsupported}" if unsupported else None
    if reason is None:
        reason = import_error()
    if reason is None:
        reason = kernels_error(head_dim, dtype)
    if reason is None:
        log.info(
            "attention backend: flashinfer (%s)", "requested" if requested != "auto" else "auto"
        )
        return "flashinfer"
    if requested == "flashinfer":
        raise ValueError(f"attention backend flashinfer cannot run: {reason}")
    log.info("attention backend: torch SDPA (auto: %s)", reason)
    return "torch"


def torch_only_reason(model_config: Any) -> str | None:
    """What of the model only the torch backend runs (FlashInfer plans one mask per step,
    not one per layer), or None."""
    if getattr(model_config, "sliding_window", None) is not None:
        return "sliding-window layers"
    if getattr(model_config, "image_attention_bidirectional", False):
        return "bidirectional attention over image tokens"
    return None


def make_attention_backend(
    name: str, model_config: Any, dtype: torch.dtype, device: torch.device | str
) -> AttentionBackend:
    """The backend ``name`` (from ``select_attention_backend``) for a language model of
    ``model_config`` (``num_heads``, ``num_kv_heads``, ``head_dim``)."""
    if name == "torch":
        return TorchPagedAttention()
    if name == "flashinfer":
        from epd_engine.model.attention_flashinfer import FlashInferAttention

        return FlashInferAttention(
            model_config.num_heads, model_config.num_kv_heads, model_config.head_dim, dtype, device
        )
    raise ValueError(f"unknown attention backend {name!r}")


def attention_backend_for(
    requested: str, model_config: Any, dtype: torch.dtype, device: torch.device | str
) -> AttentionBackend:
    """``select_attention_backend`` then ``make_attention_backend``: what an engine (or a
    profile or bench of it) runs for ``requested`` on ``device``."""
    reason = torch_only_reason(model_config)
    if reason is not None and requested != "torch":
        if requested == "flashinfer":
            raise ValueError(f"attention backend flashinfer cannot run: the model has {reason}")
        log.info("attention backend: torch SDPA (auto: the model has %s)", reason)
        return TorchPagedAttention()
    name = select_attention_backend(device, requested, dtype, model_config.head_dim)
    return make_attention_backend(name, model_config, dtype, device)
