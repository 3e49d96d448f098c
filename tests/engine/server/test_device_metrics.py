"""An instance's device and cache-page series (issue 30, item 6): on this CPU a real
``epdctl serve`` exports its KV and image pages (total and used) and its preemptions, and no
``epd_gpu_*`` series at all (absent, as the dashboard's GPU panels say). On a GPU the
gauges read torch's allocator (and NVML where installed): the ``gpu`` test."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from epd_engine.metrics import Metrics


def samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(f"{url}/metrics").text
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k in ("cache", "action")))): (
            s.value
        )
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_cache_pages_and_preemptions_are_exported_and_gpu_series_absent(instance_url: str) -> None:
    before = samples(instance_url)
    # the conftest's instance: --num-kv-blocks 128 --num-image-blocks 8
    assert before[("epd_cache_capacity_pages", (("cache", "kv"),))] == 128
    assert before[("epd_cache_capacity_pages", (("cache", "image"),))] == 8
    for action in ("recompute", "reroute"):
        assert ("epd_preemptions_total", (("action", action),)) in before
    answer = httpx.post(
        f"{instance_url}/v1/chat/completions",
        json={
            "model": "tiny-llava",
            "messages": [{"role": "user", "content": "count the pages"}],
            "max_tokens": 40,
            "ignore_eos": True,
        },
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    after = samples(instance_url)
    # set every step (the last one saw the request's pages, freed as it ended)
    assert 0 <= after[("epd_cache_used_pages", (("cache", "kv"),))] <= 128
    assert 0 <= after[("epd_cache_used_pages", (("cache", "image"),))] <= 8
    assert not [name for name, _ in after if name.startswith("epd_gpu_")]


@pytest.mark.gpu
def test_gpu_gauges_read_the_allocator() -> None:
    import torch

    from epd_engine.server.gpu_metrics import GpuMetrics

    metrics = Metrics("m", "EPD", "p")
    gpu = GpuMetrics.for_device(metrics, "cuda")
    assert gpu is not None
    held = torch.empty(64 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    gpu.publish()
    values = {
        (s.name, s.labels.get("memory")): s.value
        for family in metrics.registry.collect()
        for s in family.samples
        if s.name.startswith("epd_gpu_")
    }
    assert values[("epd_gpu_memory_bytes", "allocated")] >= held.numel()
    assert (
        values[("epd_gpu_memory_bytes", "reserved")]
        >= values[("epd_gpu_memory_bytes", "allocated")]
    )
    assert (
        values[("epd_gpu_memory_bytes", "total")]
        == torch.cuda.get_device_properties(0).total_memory
    )
    try:
        import pynvml  # noqa: F401
    except ImportError:
        assert ("epd_gpu_power_watts", None) not in values  # absent without NVML
        return
    assert 0 <= values[("epd_gpu_utilization_ratio", None)] <= 1
    assert values[("epd_gpu_power_watts", None)] > 0
    assert values[("epd_gpu_memory_bytes", "device_used")] >= held.numel()
    del held
