"""The KV prefix cache's counters as Prometheus counters: tokens looked up and found (the hit
rate per role), and the pages migrations pulled or found here already."""

from __future__ import annotations

from epd_engine.metrics import Metrics
from epd_engine.scheduler import Scheduler


class CacheCounters:
    """Adds what the cache counted since the last call (engine thread, once per step)."""

    def __init__(self, metrics: Metrics, scheduler: Scheduler) -> None:
        self.metrics = metrics
        self.kv = scheduler.kv
        self._seen = (0, 0, 0, 0)

    def record(self) -> None:
        kv = self.kv
        if kv is None:
            return
        now = (kv.num_queried_tokens, kv.num_hit_tokens, kv.num_pulled_pages, kv.num_held_pages)
        if now == self._seen:
            return
        queried, hits, pulled, held = (a - b for a, b in zip(now, self._seen, strict=True))
        self._seen = now
        m, labels = self.metrics, self.metrics.labels
        m.prefix_cache_queried.labels(**labels).inc(queried)
        m.prefix_cache_hits.labels(**labels).inc(hits)
        m.kv_pages_migrated.labels(**labels, source="pulled").inc(pulled)
        m.kv_pages_migrated.labels(**labels, source="cache").inc(held)
