"""An emulated instance's metrics: the engine's ``epd_*`` families under a model name that
ends in ``-emulated``, plus ``epd_emulated_info`` naming the cost model, so no dashboard or
scrape can take an emulated fleet for a real one."""

from __future__ import annotations

from prometheus_client import Counter, Info

from epd_engine.emulate import EMULATED_NOTE
from epd_engine.emulate.engine import EmulatedEngine, EmulatedStep
from epd_engine.metrics import Metrics


class InstanceMetrics:
    def __init__(self, metrics: Metrics, engine: EmulatedEngine) -> None:
        self.metrics = metrics
        self.engine = engine
        info = Info(
            "epd_emulated",
            "Present only on emulated instances: " + EMULATED_NOTE + ".",
            tuple(metrics.labels),
            registry=metrics.registry,
        )
        meta = engine.costs.model.meta.get("hardware", {})
        info.labels(**metrics.labels).info(
            {"cost_model": engine.costs.source, "device": str(meta.get("device", "unknown"))}
        )
        # the bytes a real pull would have moved (none move here: the time is the link's)
        self.migration_bytes = Counter(
            "epd_emulated_migration_bytes",
            "Bytes the migrations this emulated instance pulled would move (the cost model's "
            "bytes per token; no bytes move), by cache kind.",
            (*metrics.labels, "kind"),
            registry=metrics.registry,
        )
        scheduler = engine.scheduler
        for cache, manager in (("kv", scheduler.kv), ("image", scheduler.images)):
            if manager is not None:
                gauge = metrics.cache_capacity_pages.labels(**metrics.labels, cache=cache)
                gauge.set(manager.pool.num_blocks)

    def record_step(self, step: EmulatedStep, duration_s: float) -> None:
        metrics, labels, out = self.metrics, self.metrics.labels, step.out
        scheduler = self.engine.scheduler
        metrics.batch_tokens.labels(**labels).observe(out.num_batched_tokens)
        if out.decodes:
            metrics.batch_decodes.labels(**labels).observe(len(out.decodes))
        if out.encodes:
            metrics.batch_images.labels(**labels).observe(len(out.encodes))
        metrics.running.labels(**labels).set(len(scheduler.running))
        metrics.waiting.labels(**labels).set(len(scheduler.waiting))
        for cache, manager in (("kv", scheduler.kv), ("image", scheduler.images)):
            if manager is not None:
                metrics.cache_usage.labels(**labels, cache=cache).set(manager.pool.usage)
                metrics.cache_used_pages.labels(**labels, cache=cache).set(manager.pool.num_used)

    def record_pull(self, kind: str, num_bytes: int, seconds: float) -> None:
        """One pull of a migrated-in request, as a real target reports it (backend
        ``emulated``), and the bytes it stands for."""
        labels = self.metrics.labels
        self.migration_bytes.labels(**labels, kind=kind).inc(num_bytes)
        pull = self.metrics.migration_pull.labels(**labels, kind=kind, backend="emulated")
        pull.observe(seconds)
