"""What the instance app's routes share, built once in the lifespan."""

from __future__ import annotations

from dataclasses import dataclass

import httpx

from epd_engine.config import EngineConfig
from epd_engine.disagg.migration import Migration
from epd_engine.disagg.router_link import RouterLink
from epd_engine.engine.async_engine import AsyncEngine
from epd_engine.inputs.preprocess_pool import PreprocessPool
from epd_engine.inputs.processor import InputProcessor
from epd_engine.metrics import Metrics
from epd_engine.server.gpu_metrics import GpuMetrics


@dataclass
class InstanceState:
    config: EngineConfig
    engine: AsyncEngine
    processor: InputProcessor
    metrics: Metrics
    http: httpx.AsyncClient
    link: RouterLink | None = None  # set when a router owns this instance
    migration: Migration | None = None  # set with the link
    preprocess: PreprocessPool | None = None  # worker processes for images and the processor
    ready: bool = False
    frozen_objects: int = 0  # start-up objects full collections skip (gc_heap)
    gpu: GpuMetrics | None = None  # CUDA instances: the epd_gpu_* gauges, read at scrape time
