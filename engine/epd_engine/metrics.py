"""Prometheus metrics (DESIGN.md §4): prefix ``epd_``, base units, ``_total`` for counters.

Each app gets its own registry so several instances can live in one test process.
Labels: ``model``, ``role``, ``pool`` on everything, plus ``stage``/``kind``/``cache``/
``outcome``/``backend`` where they apply. The ``epd_gpu_*`` gauges are set at scrape time on
CUDA instances (``server/gpu_metrics.py``): absent on CPU, and utilisation and power absent
where NVML (``nvidia-ml-py``) is not installed.
"""

from __future__ import annotations

from collections.abc import Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info

from epd_engine.config import SLO
from epd_engine.engine.gc_heap import GcPauses

_LATENCY_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.08, 0.1, 0.25, 0.5, 1, 2, 4, 8, 16, 32, 64)
_TPOT_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.03, 0.05, 0.08, 0.1, 0.2, 0.3, 0.6, 1)
_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# a step's phases run from tens of microseconds (a decode's schedule) to seconds (a CPU prefill)
_PHASE_BUCKETS_S = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25,
                    0.5, 1, 2.5)  # fmt: skip
# GPU migrations take about a millisecond, CPU ones tens; whole requests' up to seconds
_MIGRATION_BUCKETS_S = (1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.05, 0.1, 0.25,
                        0.5, 1, 2, 4, 8)  # fmt: skip
_BASE = ("model", "role", "pool")
PREEMPTION_ACTIONS = ("recompute", "reroute")


class Metrics:
    def __init__(self, model: str, role: str, pool: str) -> None:
        self.registry = CollectorRegistry()
        self.labels = {"model": model, "role": role, "pool": pool}
        r = self.registry
        r.register(GcPauses(self.labels))
        self.ttft = Histogram(
            "epd_request_ttft_seconds",
            "Time to first token.",
            _BASE,
            registry=r,
            buckets=_LATENCY_BUCKETS_S,
        )
        self.tpot = Histogram(
            "epd_request_tpot_seconds",
            "Gap between consecutive output tokens.",
            _BASE,
            registry=r,
            buckets=_TPOT_BUCKETS_S,
        )
        self.tpot_p90 = Histogram(
            "epd_request_tpot_p90_seconds",
            "Each finished request's own p90 gap between output tokens (what the TPOT SLO tests).",
            _BASE,
            registry=r,
            buckets=_TPOT_BUCKETS_S,
        )
        self.e2e = Histogram(
            "epd_request_e2e_seconds",
            "End-to-end request latency.",
            _BASE,
            registry=r,
            buckets=_LATENCY_BUCKETS_S,
        )
        # The workload's shape, which the operator's Auto mode re-plans on (router side).
        self.request_prompt_tokens = Histogram(
            "epd_request_prompt_tokens",
            "Text tokens per finished request (image tokens not included).",
            _BASE,
            registry=r,
            buckets=_BATCH_BUCKETS,
        )
        self.request_images = Histogram(
            "epd_request_images",
            "Images per finished request.",
            _BASE,
            registry=r,
            buckets=(0, 1, 2, 4, 8, 16),
        )
        self.request_output_tokens = Histogram(
            "epd_request_output_tokens",
            "Output tokens per finished request.",
            _BASE,
            registry=r,
            buckets=_BATCH_BUCKETS,
        )
        self.stage_queue = Histogram(
            "epd_stage_queue_seconds",
            "Wait from a stage becoming next to its first batch.",
            (*_BASE, "stage"),
            registry=r,
            buckets=_LATENCY_BUCKETS_S,
        )
        self.stage_execution = Histogram(
            "epd_stage_execution_seconds",
            "Duration of iterations that ran the stage.",
            (*_BASE, "stage"),
            registry=r,
            buckets=_LATENCY_BUCKETS_S,
        )
        self.step_phase = Histogram(
            "epd_step_phase_seconds",
            "Time of each phase of an engine step (step_phases.py); step: decode (every request "
            "decodes one token) or mixed.",
            (*_BASE, "phase", "step"),
            registry=r,
            buckets=_PHASE_BUCKETS_S,
        )
        self.migration = Histogram(
            "epd_migration_seconds",
            "Cache migration time from pull start to confirm.",
            (*_BASE, "kind"),
            registry=r,
            buckets=_MIGRATION_BUCKETS_S,
        )
        self.migration_pull = Histogram(
            "epd_migration_pull_seconds",
            "A migration target's pulls: from the pull's scheduling to the bytes in its pages, "
            "by cache kind and the transfer backend that moved them (auto: the one it chose).",
            (*_BASE, "kind", "backend"),
            registry=r,
            buckets=_MIGRATION_BUCKETS_S,
        )
        self.kv_groups_pulled = Counter(
            "epd_kv_groups_pulled_total",
            "KV layer groups this instance pulled; overlapped: the source was still prefilling.",
            (*_BASE, "overlapped"),
            registry=r,
        )
        self.batch_tokens = Histogram(
            "epd_batch_tokens",
            "Tokens per iteration.",
            _BASE,
            registry=r,
            buckets=_BATCH_BUCKETS,
        )
        self.batch_decodes = Histogram(
            "epd_batch_decode_requests",
            "Requests decoded together in one iteration.",
            _BASE,
            registry=r,
            buckets=_BATCH_BUCKETS[:10],
        )
        self.batch_images = Histogram(
            "epd_batch_images",
            "Images encoded per iteration.",
            _BASE,
            registry=r,
            buckets=_BATCH_BUCKETS[:8],
        )
        self.cache_usage = Gauge(
            "epd_cache_usage_ratio", "Used share of a paged cache.", (*_BASE, "cache"), registry=r
        )
        self.cache_capacity_pages = Gauge(
            "epd_cache_capacity_pages", "Pages of a paged cache.", (*_BASE, "cache"), registry=r
        )
        self.cache_used_pages = Gauge(
            "epd_cache_used_pages",
            "Pages of a paged cache held by requests (or kept for reuse, image cache).",
            (*_BASE, "cache"),
            registry=r,
        )
        self.preemptions = Counter(
            "epd_preemptions_total",
            "Running requests that lost their KV pages: recompute (they wait and are computed "
            "again here) or reroute (a decode-only instance sends them down a fresh path).",
            (*_BASE, "action"),
            registry=r,
        )
        # Set at scrape time on CUDA instances only (server/gpu_metrics.py).
        self.gpu_memory = Gauge(
            "epd_gpu_memory_bytes",
            "This instance's GPU memory: allocated (its tensors), reserved (torch's caching "
            "allocator), total (the card); device_used (every process on the card, NVML).",
            (*_BASE, "memory"),
            registry=r,
        )
        self.gpu_utilization = Gauge(
            "epd_gpu_utilization_ratio",
            "Share of the last sample period a kernel ran on the GPU (NVML; every process).",
            _BASE,
            registry=r,
        )
        self.gpu_power = Gauge(
            "epd_gpu_power_watts", "The GPU's power draw (NVML).", _BASE, registry=r
        )
        self.running = Gauge("epd_requests_running", "Requests holding pages.", _BASE, registry=r)
        self.waiting = Gauge("epd_requests_waiting", "Requests queued.", _BASE, registry=r)
        self.encoder_cache_hits = Counter(
            "epd_encoder_cache_hits_total",
            "Images whose embeddings were reused.",
            _BASE,
            registry=r,
        )
        self.encoder_cache_lookups = Counter(
            "epd_encoder_cache_lookups_total",
            "Images looked up in the encoder cache.",
            _BASE,
            registry=r,
        )
        self.prefix_cache_queried = Counter(
            "epd_prefix_cache_queried_tokens_total",
            "Tokens looked up in the KV prefix cache (a prefill from its first token, a "
            "migration's pull); the hit rate per role is hits over these.",
            _BASE,
            registry=r,
        )
        self.prefix_cache_hits = Counter(
            "epd_prefix_cache_hit_tokens_total",
            "Of the tokens looked up, those whose KV pages were found (not computed, or not "
            "pulled).",
            _BASE,
            registry=r,
        )
        self.kv_pages_migrated = Counter(
            "epd_migration_kv_pages_total",
            "KV pages a migration target needed: pulled from the source, or held already "
            "(source=cache: its prefix cache had them).",
            (*_BASE, "source"),
            registry=r,
        )
        self.affinity = Counter(
            "epd_routing_affinity_total",
            "Placements by cache affinity (the router's entry instance, a source's prefill or "
            "decode target): followed the key's instance, overridden by the load bound, or "
            "none (no key).",
            (*_BASE, "outcome"),
            registry=r,
        )
        self.handoffs = Counter(
            "epd_handoffs_total",
            "Requests this instance handed to the next stage's instance, by cache kind and "
            "where that instance runs: group (this placement group, one pod: shm or CUDA IPC), "
            "node (this machine), remote.",
            (*_BASE, "kind", "locality"),
            registry=r,
        )
        self.requests = Counter(
            "epd_requests_total",
            "Finished requests by outcome.",
            (*_BASE, "outcome"),
            registry=r,
        )
        self.slo_met = Counter(
            "epd_slo_met_total",
            "Requests that met both the TTFT and the TPOT SLO.",
            _BASE,
            registry=r,
        )
        # The deployment's objectives (router side), so dashboards draw the resource's SLO.
        self.slo_objective = Gauge(
            "epd_slo_objective",
            "The SLO this deployment serves to: ttft_seconds, tpot_seconds (a request's p90 "
            "gap), attainment_ratio (share of requests to meet both).",
            (*_BASE, "objective"),
            registry=r,
        )
        self.plan = Info("epd_plan", "The plan currently served.", _BASE, registry=r)
        self.reconfigurations = Counter(
            "epd_reconfigurations_total", "Plan changes applied.", _BASE, registry=r
        )
        # Counters and histograms exist from the start at 0, so Prometheus sees their first
        # increments (increase() cannot count what came before a series' first sample: an
        # encoder whose images all hit its cache after the first few would chart nothing)
        # and a goodput of 0 is 0, not "no data".
        labels = self.labels
        for metric in vars(self).values():
            if isinstance(metric, Counter | Histogram) and metric._labelnames == _BASE:
                metric.labels(**labels)
        self.requests.labels(**labels, outcome="success")
        for overlapped in ("true", "false"):
            self.kv_groups_pulled.labels(**labels, overlapped=overlapped)
        for action in PREEMPTION_ACTIONS:
            self.preemptions.labels(**labels, action=action)

    def publish_slo(self, slo: SLO) -> None:
        for objective, value in (
            ("ttft_seconds", slo.ttft_s),
            ("tpot_seconds", slo.tpot_s),
            ("attainment_ratio", slo.attainment),
        ):
            self.slo_objective.labels(**self.labels, objective=objective).set(value)

    def observe_tokens(
        self, ttft_s: float, gaps_s: Sequence[float], slo: SLO, success: bool
    ) -> None:
        """A finished request's token latencies: TTFT, every gap, its own p90 gap, and the
        SLO counter (successful requests whose TTFT and p90 gap are both within the SLO)."""
        labels = self.labels
        self.ttft.labels(**labels).observe(ttft_s)
        tpot = self.tpot.labels(**labels)  # one lookup, not one per gap (the event loop pays)
        for gap in gaps_s:
            tpot.observe(float(gap))
        tpot_p90 = percentile_90(gaps_s) if len(gaps_s) else 0.0
        if len(gaps_s):
            self.tpot_p90.labels(**labels).observe(tpot_p90)
        if success and ttft_s <= slo.ttft_s and tpot_p90 <= slo.tpot_s:
            self.slo_met.labels(**labels).inc()


def percentile_90(values: Sequence[float]) -> float:
    """``np.percentile(values, 90)`` (linear interpolation) without numpy's per-call cost
    (20 us for a 64-token reply, on the event loop once per finished request)."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * 0.9
    low = int(rank)
    if low + 1 >= len(ordered):
        return float(ordered[low])
    return float(ordered[low] + (ordered[low + 1] - ordered[low]) * (rank - low))
