"""An instance's GPU, read when Prometheus scrapes: memory from torch's allocator (allocated,
reserved, the card's total), and where NVML is installed (``nvidia-ml-py``) the card's used
memory, utilisation and power. On a CPU instance nothing is made and the ``epd_gpu_*``
series are absent; without NVML only the memory series from torch exist (logged once).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from epd_engine.metrics import Metrics

log = logging.getLogger(__name__)


class GpuMetrics:
    def __init__(self, metrics: Metrics, device: torch.device) -> None:
        self.metrics = metrics
        self.device = device
        self.total_bytes = torch.cuda.get_device_properties(device).total_memory
        self._nvml: Any = None
        self._handle: Any = None
        self._open_nvml()

    @classmethod
    def for_device(cls, metrics: Metrics, device: str) -> GpuMetrics | None:
        """None on a CPU instance (its GPU series stay absent)."""
        dev = torch.device(device)
        if dev.type != "cuda" or not torch.cuda.is_available():
            return None
        return cls(metrics, dev)

    def _open_nvml(self) -> None:
        """NVML's handle of our card, found by UUID: NVML numbers every GPU of the host,
        CUDA only the visible ones (``CUDA_VISIBLE_DEVICES``, a pod's device plugin)."""
        try:
            import pynvml  # type: ignore[import-not-found, import-untyped, unused-ignore]
        except ImportError:
            log.info("NVML (nvidia-ml-py) is not installed: no GPU utilisation or power series")
            return
        try:
            pynvml.nvmlInit()
            uuid = str(torch.cuda.get_device_properties(self.device).uuid)
            uuid = uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"
            self._handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
            self._nvml = pynvml
        except Exception as exc:  # pynvml.NVMLError and a torch without .uuid alike
            log.warning("NVML cannot read this GPU (%r): no utilisation or power series", exc)

    def publish(self) -> None:
        """Set the gauges now; a failing read leaves the last values (never fails a scrape)."""
        m = self.metrics
        labels = m.labels
        memory = m.gpu_memory
        device = self.device
        try:
            memory.labels(**labels, memory="allocated").set(torch.cuda.memory_allocated(device))
            memory.labels(**labels, memory="reserved").set(torch.cuda.memory_reserved(device))
            memory.labels(**labels, memory="total").set(self.total_bytes)
        except RuntimeError as exc:  # a broken device: its health says so
            log.debug("GPU memory unreadable: %r", exc)
        nvml, handle = self._nvml, self._handle
        if nvml is None:
            return
        try:
            used = nvml.nvmlDeviceGetMemoryInfo(handle).used
            utilization = nvml.nvmlDeviceGetUtilizationRates(handle).gpu / 100
            power_w = nvml.nvmlDeviceGetPowerUsage(handle) / 1000  # milliwatts
        except Exception as exc:  # pynvml.NVMLError: a card NVML lost, an unsupported query
            log.debug("NVML read failed: %r", exc)
            return
        memory.labels(**labels, memory="device_used").set(used)
        m.gpu_utilization.labels(**labels).set(utilization)
        m.gpu_power.labels(**labels).set(power_w)
