"""Disaggregation overheads per method: migration times, their share of latency, the router hop.

For each method the whole local system (router + role pools as real processes, started by the
launcher) serves the same mixed workload (text-only and image requests, fixed output lengths,
greedy, ``ignore_eos``) driven by the load driver. Client-side TTFT/TPOT/e2e come from the
driver; migration times (image E→P, KV P→D: from the target's pull start until the pages have
landed) and their share of the router-measured end-to-end latency come from the router trace.

The router hop is measured on the EPD method (one EPD instance behind the router) against a
standalone ``epdctl serve`` EPD instance with the same settings: the same requests, one at a
time, alternating between the two so machine noise hits both alike; the report gives the
per-request differences (router − direct).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from epd_engine.bench.driver import DriverConfig, Messages, prepare_messages, run_trace
from epd_engine.bench.process_cpu import cpu_seconds
from epd_engine.bench.static_system import LaunchSpec, LocalSystem
from epd_engine.config import Method
from epd_engine.contracts.plan import Budgets, Plan
from epd_engine.contracts.trace import TraceRecord, parse_trace
from epd_engine.local.ports import free_port
from epd_engine.local.spawn import ChildProcess
from epd_engine.slo.outcomes import LatencyStats, RequestResult, summarize
from epd_engine.workload.generators import WorkloadShape, generate, random_mm

ENGINE_ARGS = ["--num-kv-blocks", "256", "--num-image-blocks", "16", "--max-num-running", "16"]
BUDGETS = Budgets(token_budget=256, image_budget=4)
MIGRATIONS = ("image", "kv")
Log = Callable[[str], None]
DEFINITIONS = {
    "client": "measured by the load driver (openai client, streaming): TTFT = send to first "
    "content chunk, TPOT = per-request mean inter-chunk gap, e2e = send to stream end",
    "migration": "from the router trace: seconds from the target's pull start until the pages "
    "landed in its cache (fetch over tcp + import on the engine thread), summed per request "
    "and kind; image = E->P embeddings, kv = P->D KV cache",
    "migration.fraction_of_e2e": "per request (image + kv migration) / router-measured e2e; "
    "overall = sum of migration over sum of e2e; p50/p90 over requests",
    "router_hop": "same requests one at a time, alternating between a standalone EPD instance "
    "and the router in front of one EPD instance; added = router - direct per request; "
    "router_cpu_per_request_s = the router process's CPU time over the routed requests / their "
    "number (from /proc; load elsewhere on the machine does not inflate it)",
    "router_stage_mean_s": "mean per request of the router trace's stage seconds",
}


@dataclass(frozen=True)
class DisaggBenchConfig:
    model_dir: Path
    run_dir: Path  # launcher state and process logs, one folder per method
    model_name: str = "tiny-llava"
    methods: tuple[Method, ...] = tuple(Method)
    num_requests: int = 48
    max_concurrency: int = 4
    max_tokens: int = 32
    prompt_tokens: int = 64
    image_size: tuple[int, int] = (336, 336)
    text_only_fraction: float = 0.5
    num_warmup: int = 2  # per system, excluded from every figure
    seed: int = 0
    router_hop: bool = True
    ready_timeout_s: float = 300.0
    # Bounds one run (a request hung in the system is cut off and counted as an error).
    max_run_s: float = 120.0
    kv_handoff: str = "early"  # or "after-prefill" (the engine's --kv-handoff)

    def __post_init__(self) -> None:
        if self.num_requests < 2:
            raise ValueError(f"num_requests must be >= 2, got {self.num_requests}")
        if not self.methods:
            raise ValueError("at least one method is needed")


def _shape(config: DisaggBenchConfig) -> WorkloadShape:
    return random_mm(
        input_len=config.prompt_tokens,
        output_len=config.max_tokens,
        image_sizes=(config.image_size,),
    )


def workload(config: DisaggBenchConfig, seed_offset: int = 0) -> list[TraceRecord]:
    """The mixed workload: ``text_only_fraction`` text-only, the rest one image each."""
    return generate(
        _shape(config),
        config.num_requests,
        seed=config.seed + seed_offset,
        text_only_fraction=config.text_only_fraction,
    )


def warmup_records(config: DisaggBenchConfig) -> list[TraceRecord]:
    """Alternately text-only and image requests whose images the workloads never use."""
    pool = generate(_shape(config), 64, seed=config.seed + 1000, text_only_fraction=0.5)
    texts = [r for r in pool if r.text_only]
    images = [r for r in pool if not r.text_only]
    return [(texts, images)[i % 2][i // 2] for i in range(config.num_warmup)]


@dataclass(frozen=True)
class Requests:
    """Records with their chat payloads, built once before any clock starts."""

    records: list[TraceRecord]
    messages: Messages

    @classmethod
    def of(cls, records: list[TraceRecord]) -> Requests:
        return cls(records, prepare_messages(records))

    def one(self, i: int) -> Requests:
        return Requests(self.records[i : i + 1], self.messages[i : i + 1])


def plan_for(method: Method) -> Plan:
    roles = {role: 1 for role in method.roles}
    return Plan(method=method, pools=roles, budgets={r: BUDGETS for r in roles})


def stats(values: Sequence[float]) -> dict[str, float | int]:
    s = LatencyStats.of(values)
    return {"count": s.count, "p50_s": s.p50_s, "p90_s": s.p90_s, "mean_s": s.mean_s}


def migration_report(records: Sequence[TraceRecord]) -> dict[str, Any]:
    """Per-kind migration times and the share of router-measured e2e spent migrating."""
    out: dict[str, Any] = {}
    for kind in MIGRATIONS:
        key = f"migration_{kind}"
        out[kind] = stats([r.stage_s[key] for r in records if r.stage_s and key in r.stage_s])
    fractions, total_migration_s, total_e2e_s = [], 0.0, 0.0
    for r in records:
        if not r.e2e_s:
            continue
        migration_s = sum((r.stage_s or {}).get(f"migration_{k}", 0.0) for k in MIGRATIONS)
        fractions.append(migration_s / r.e2e_s)
        total_migration_s += migration_s
        total_e2e_s += r.e2e_s
    s = LatencyStats.of(fractions)
    out["fraction_of_e2e"] = {
        "overall": total_migration_s / total_e2e_s if total_e2e_s else 0.0,
        "p50": s.p50_s,
        "p90": s.p90_s,
        "max": s.max_s,
    }
    return out


def latency_report(results: Sequence[RequestResult]) -> dict[str, Any]:
    summary = summarize(results)
    return {
        "num_requests": summary.num_requests,
        "num_ok": summary.num_ok,
        "errors": summary.errors,
        "duration_s": summary.duration_s,
        "request_throughput_rps": summary.request_throughput_rps,
        "output_throughput_tps": summary.output_throughput_tps,
        "num_short_outputs": summary.num_short_outputs,
        **{
            name: {"p50_s": st.p50_s, "p90_s": st.p90_s, "mean_s": st.mean_s}
            for name, st in (("ttft", summary.ttft), ("tpot", summary.tpot), ("e2e", summary.e2e))
        },
    }


def stage_means(records: Sequence[TraceRecord]) -> dict[str, float]:
    totals: dict[str, list[float]] = {}
    for r in records:
        for stage, seconds in (r.stage_s or {}).items():
            totals.setdefault(stage, []).append(seconds)
    return {k: sum(v) / len(v) for k, v in sorted(totals.items())}


def router_trace(router_url: str, headers: dict[str, str]) -> list[TraceRecord]:
    response = httpx.get(f"{router_url}/v1/trace", headers=headers, timeout=30)
    response.raise_for_status()
    return parse_trace(response.text.splitlines(), f"{router_url}/v1/trace")


def driver_config(base_url: str, config: DisaggBenchConfig, concurrency: int) -> DriverConfig:
    return DriverConfig(
        endpoint=f"{base_url}/v1",
        model=config.model_name,
        max_concurrency=concurrency,
        max_duration_s=config.max_run_s,
        request_timeout_s=config.max_run_s,
        progress=False,
    )


def drive(
    url: str, config: DisaggBenchConfig, requests: Requests, concurrency: int
) -> list[RequestResult]:
    cfg = driver_config(url, config, concurrency)
    return asyncio.run(run_trace(requests.records, cfg, requests.messages))


def router_hop(
    direct_url: str,
    router_url: str,
    config: DisaggBenchConfig,
    requests: Requests,
    router_pid: int,
) -> dict[str, Any]:
    """The same requests, one at a time, alternately direct and through the router (first the
    one, then the other, swapping the order every request); and the router's CPU time per
    routed request, which other load on the machine does not inflate as it does latency."""
    direct: list[RequestResult] = []
    routed: list[RequestResult] = []
    router_cpu_s = 0.0
    for i in range(len(requests.records)):
        order = [(direct_url, direct), (router_url, routed)]
        for url, sink in order if i % 2 == 0 else order[::-1]:
            cpu_before = cpu_seconds(router_pid)
            sink += drive(url, config, requests.one(i), 1)
            if url == router_url:
                router_cpu_s += cpu_seconds(router_pid) - cpu_before
    pairs = [(d, r) for d, r in zip(direct, routed, strict=True) if d.ok and r.ok]
    out: dict[str, Any] = {
        "num_requests": len(requests.records),
        "num_pairs": len(pairs),
        "router_cpu_per_request_s": router_cpu_s / max(len(routed), 1),
    }
    for name in ("ttft_s", "e2e_s"):
        d_values = [getattr(d, name) for d, _ in pairs]
        r_values = [getattr(r, name) for _, r in pairs]
        out[name.removesuffix("_s")] = {
            "direct": stats(d_values),
            "router": stats(r_values),
            "added": stats([r - d for d, r in zip(d_values, r_values, strict=True)]),
        }
    return out


@contextlib.contextmanager
def standalone(config: DisaggBenchConfig, log: Path) -> Iterator[str]:
    """One ``epdctl serve`` EPD instance, configured like the launcher's, without a router;
    yields its base URL once it is ready."""
    port = free_port()
    args = [
        sys.executable, "-m", "epd_engine", "serve", "--model", str(config.model_dir),
        "--served-model-name", config.model_name, "--role", "EPD", "--port", str(port),
        "--token-budget", str(BUDGETS.token_budget), "--image-budget", str(BUDGETS.image_budget),
        "--log-level", "warning", *ENGINE_ARGS,
    ]  # fmt: skip
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("wb") as out:
        popen = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_http_ready(popen, f"{url}/health/ready", log, config.ready_timeout_s)
        yield url
    finally:
        popen.terminate()
        try:
            popen.wait(15)
        except subprocess.TimeoutExpired:
            popen.kill()
            popen.wait()


def wait_http_ready(
    popen: ChildProcess, url: str, log: Path | None, timeout_s: float, poll_s: float = 0.3
) -> None:
    """Until ``url`` answers 200; an error (with ``log``'s tail) if the process exits first.
    A start-time benchmark polls often (``poll_s``): the poll's period is its resolution."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if popen.poll() is not None:
            tail = "" if log is None else ":\n" + log.read_text(errors="replace")[-2000:]
            raise RuntimeError(f"the process serving {url} exited with {popen.returncode}{tail}")
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url, timeout=2).status_code == 200:
                return
        time.sleep(poll_s)
    raise TimeoutError(f"{url} not ready after {timeout_s:.0f}s")


@dataclass(frozen=True)
class Workloads:
    warmup: Requests  # sent one by one to every fresh system, never measured
    mixed: Requests  # the measured workload, the same for every method
    hop: Requests  # the router-hop requests (images unseen by either instance)


def run_method(
    method: Method, config: DisaggBenchConfig, work: Workloads, log: Log
) -> dict[str, Any]:
    run_dir = config.run_dir / method.value.replace("+", "_")
    spec = LaunchSpec(
        name="bench", model_name=config.model_name, model_dir=config.model_dir,
        plan=plan_for(method), router_port=free_port(), run_dir=run_dir,
        engine_args=[*ENGINE_ARGS, "--kv-handoff", config.kv_handoff],
    )  # fmt: skip
    system = LocalSystem(spec)
    with contextlib.ExitStack() as stack:
        started = time.monotonic()
        system.start()
        stack.callback(system.stop)
        system.wait_ready(config.ready_timeout_s)
        ready_s = time.monotonic() - started
        log(f"{method.value}: {spec.plan.num_instances} instance(s) ready in {ready_s:.1f} s")
        drive(spec.router_url, config, work.warmup, 1)
        load_before = os.getloadavg()
        results = drive(spec.router_url, config, work.mixed, config.max_concurrency)
        load_after = os.getloadavg()
        trace = router_trace(spec.router_url, spec.headers())[len(work.warmup.records) :]
        report: dict[str, Any] = {
            "method": method.value,
            "kv_handoff": config.kv_handoff,
            "pools": {role.value: n for role, n in spec.plan.pools.items()},
            "loadavg_before": load_before,
            "loadavg_after": load_after,
            "client": latency_report(results),
            "num_trace_records": len(trace),
            "paths": sorted({"->".join(r.path or ()) for r in trace}),
            "migration": migration_report(trace),
            "router_stage_mean_s": stage_means(trace),
        }
        if config.router_hop and method is Method.EPD:
            url = stack.enter_context(standalone(config, run_dir / "logs" / "direct.log"))
            drive(url, config, work.warmup, 1)
            log(f"{method.value}: router hop, {len(work.hop.records)} requests each way")
            report["router_hop"] = router_hop(
                url, spec.router_url, config, work.hop, system.process("router").popen.pid
            )
    return report


@dataclass
class DisaggBenchReport:
    config: dict[str, Any]
    environment: dict[str, Any]
    methods: list[dict[str, Any]] = field(default_factory=list)
    failures: dict[str, str] = field(default_factory=dict)
    definitions: dict[str, str] = field(default_factory=lambda: dict(DEFINITIONS))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def run(
    config: DisaggBenchConfig, environment: dict[str, Any], log: Log = print
) -> DisaggBenchReport:
    work = Workloads(
        warmup=Requests.of(warmup_records(config)),
        mixed=Requests.of(workload(config)),
        hop=Requests.of(workload(config, seed_offset=1)),
    )
    report = DisaggBenchReport(
        config={k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items()},
        environment=environment,
    )
    report.config["methods"] = [m.value for m in config.methods]
    for method in config.methods:
        try:
            report.methods.append(run_method(method, config, work, log))
        except (RuntimeError, TimeoutError, httpx.HTTPError) as exc:
            log(f"{method.value}: FAILED: {exc}")
            report.failures[method.value] = str(exc)[:2000]
    return report
