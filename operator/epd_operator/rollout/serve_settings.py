"""The engine settings of an EPDDeployment as ``epdctl serve`` flags, for every backend.

Kubernetes pods, reconciled local pools and a static ``epdctl up`` all pass an instance the
same cache geometry, transfer backend and SLO; the command line itself is built by
``epd_engine.contracts.serve_args.ServeCommand``.
"""

from __future__ import annotations

from epd_engine.contracts.serve_args import slo_flags
from epd_operator.api.spec import EPDDeploymentSpec


def cache_settings(spec: EPDDeploymentSpec) -> list[str]:
    """Cache geometry and the transfer backend: what instances that exchange caches share."""
    e = spec.engine
    return [
        "--kv-block-size", str(e.kv_block_size),
        *e.kv_cache_args(),
        "--num-image-blocks", str(e.num_image_blocks),
        *e.image_size_args(),  # image token counts, and so cache pages, follow from it
        "--transfer-backend", e.transfer_backend,
    ]  # fmt: skip


def engine_settings(spec: EPDDeploymentSpec) -> list[str]:
    """Every instance's settings: cache geometry, transfer backend and the SLO its budget
    search aims at."""
    slo = spec.slo.to_slo()
    return [*cache_settings(spec), *slo_flags(slo.ttft_s, slo.tpot_s)]


def role_engine_args(ranks: int) -> list[str]:
    """What differs per pool: the tensor-parallel ranks of its instances (the plan's size)."""
    return ["--tensor-parallel-size", str(ranks)] if ranks > 1 else []
