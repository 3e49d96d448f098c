"""Prometheus for real: Debian's ``prometheus`` scrapes a running ``epdctl up`` (router,
E+P+D instances of the tiny model and the reconcile loop, 127.0.0.1) under live traffic.
Every query of every dashboard is evaluated against it and must return data (the loop's
rates and decisions must not: a Fixed deployment makes no re-plan); the SLO lines are the manifest's
SLO as the router exports it; the operator's ``Prometheus`` client reads the workload and
SLO attainment the clients produced, and those statistics trigger a re-plan.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
import yaml

from benchmarks.switch_drill import Traffic, prompts
from epd_engine.config import SLO
from epd_operator.api.spec import EPDDeployment, PlanStatus
from epd_operator.planning.choice import choose_plan, heuristic_planner
from epd_operator.planning.planner import workload_stats
from epd_operator.planning.prometheus import Prometheus, with_live_attainment
from epd_operator.rollout.router_api import RouterAPI
from tests.operator.test_dashboards import (
    absent_on_cpu,
    auto_only,
    dashboard_files,
    load,
    queries,
)
from tests.processes import EPDCTL, free_port
from tests.prometheus_server import label_values, prometheus, query

pytestmark = pytest.mark.slow

NAMESPACE = "epd-live"
MODEL = "tiny-llava"
TRAFFIC_S = 20.0
WINDOW = "2m"  # $__rate_interval and $__range: covers the whole traffic
MANIFEST = {
    "apiVersion": "epd.serving.dev/v1alpha1",
    "kind": "EPDDeployment",
    "metadata": {"name": "live"},
    "spec": {
        "model": {"name": MODEL, "source": {"preset": "tiny-llava"}, "dtype": "float32"},
        "gpuBudget": 8,
        # not the defaults (4 s, 80 ms, 90 %): the dashboards must draw these
        "slo": {"ttftMilliseconds": 1, "tpotMilliseconds": 250, "attainmentPercent": 95},
        "disaggregation": {"mode": "Fixed", "method": "E+P+D", "pools": {"E": 1, "P": 1, "D": 1}},
        "engine": {
            "gpusPerInstance": 0,
            "numKvBlocks": 256,
            "numImageBlocks": 16,
            "extraArgs": ["--token-budget", "256", "--image-budget", "4"],
        },
    },
}


@dataclass
class Live:
    prom_url: str
    router_url: str
    manifest: Path
    answers: int
    failed: int
    images_sent: int
    pools: list[str]
    token: str


def _up(manifest: Path, model_dir: Path, runs: Path, port: int) -> dict:
    args = [*EPDCTL, "up", "-f", str(manifest), "--model-dir", str(model_dir), "--runs-dir",
            str(runs), "--port", str(port), "--detach", "--timeout", "240"]  # fmt: skip
    done = subprocess.run(args, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    state = json.loads((runs / "live" / "state.json").read_text())
    assert isinstance(state, dict)
    return state


@pytest.fixture(scope="module")
def live(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    folder = tmp_path_factory.mktemp("prom-live")
    manifest = folder / "live.yaml"
    manifest.write_text(yaml.safe_dump(MANIFEST))
    runs = folder / "runs"
    state = _up(manifest, tiny_model_dir, runs, free_port())
    try:
        router = state["router_url"]
        targets = {router.removeprefix("http://"): {"namespace": NAMESPACE, "pod": "router"}}
        for inst in state["instances"]:
            targets[f"127.0.0.1:{inst['port']}"] = {"namespace": NAMESPACE, "pod": inst["name"]}
        loop = state["metrics_url"].removeprefix("http://").removesuffix("/metrics")
        targets[loop] = {"namespace": NAMESPACE, "pod": "loop"}  # the loop's epd_loop_*
        with prometheus(targets, folder / "prometheus") as prom_url:
            headers = {"X-EPD-Token": state["token"]}
            pools = sorted(httpx.get(f"{router}/internal/pools", headers=headers).json()["pools"])
            with Traffic(router, clients=2) as traffic:
                time.sleep(TRAFFIC_S / 2)
                # the switch the operator makes at a rollout: a reconfiguration on the dashboard
                httpx.put(
                    f"{router}/internal/routing", json={"active_pools": pools}, headers=headers
                ).raise_for_status()
                time.sleep(TRAFFIC_S / 2)
            time.sleep(3)  # a few scrapes after the last request
            per_prompt = [len(re.findall('"type": "image_url"', json.dumps(p))) for p in prompts()]
            yield Live(
                prom_url,
                router,
                manifest,
                answers=len(traffic.answers),
                failed=sum(1 for a in traffic.answers if a.error),
                images_sent=sum(per_prompt[a.prompt] for a in traffic.answers),
                pools=pools,
                token=state["token"],
            )
    finally:
        subprocess.run([*EPDCTL, "down", "live", "--runs-dir", str(runs)], timeout=60)


def _substitute(expr: str) -> str:
    return (
        expr.replace("$namespace", NAMESPACE)
        .replace("$model", MODEL)
        .replace("$pool", ".*")
        .replace("$__rate_interval", WINDOW)
        .replace("$__range", WINDOW)
    )


def _finite(result: list[dict]) -> list[float]:
    values = [float(r["value"][1]) for r in result]
    return [v for v in values if math.isfinite(v)]


def test_traffic_went_through(live: Live) -> None:
    assert live.answers >= 10
    assert live.failed == 0


@pytest.mark.parametrize("path", dashboard_files(), ids=lambda p: p.name)
def test_every_dashboard_query_returns_data(live: Live, path: Path) -> None:
    empty = []
    checked = 0
    dashboard = load(path)
    # GPU series are absent on this CPU system: their queries must evaluate, with no data
    gpu_only = {f"panel {title!r}" for title in absent_on_cpu(dashboard)}
    for where, expr in queries(dashboard):
        checked += 1
        label_query = re.match(r"^\s*label_values\((.*),\s*(\w+)\s*\)\s*$", expr)
        if label_query:
            selector, label = label_query.groups()
            if not label_values(live.prom_url, label, [_substitute(selector)]):
                empty.append(f"{where}: {expr}")
            continue
        values = _finite(query(live.prom_url, _substitute(expr)))  # raises on bad PromQL
        if where.split(" target ")[0] in gpu_only:
            assert not values, f"{where}: GPU series on a CPU system"
        elif auto_only(expr):
            assert not values, f"{where}: a Fixed deployment made a re-plan decision"
        elif not values:
            empty.append(f"{where}: {expr}")
    # every query was found and evaluated (the overview has dozens; a focused board a few)
    assert checked >= (30 if path.name == "epd-overview.json" else 5)
    assert not empty, "no data for:\n" + "\n".join(empty)


def test_loop_shows_instances_per_role_and_gpus(live: Live) -> None:
    """The loop's series are the running plan's: 1 E, 1 P, 1 D ready, no GPU on CPU, and
    the capacity range of a fixed size (gpuBudget)."""
    where = f'namespace="{NAMESPACE}", model="{MODEL}", name="live"'
    by_role = query(live.prom_url, f"epd_loop_instances{{{where}}}")
    assert {r["metric"]["role"]: float(r["value"][1]) for r in by_role} == {
        "E": 1.0, "P": 1.0, "D": 1.0
    }  # fmt: skip
    assert _finite(query(live.prom_url, f"epd_loop_gpus{{{where}}}")) == [0.0]
    bounds = query(live.prom_url, f"epd_loop_gpus_bound{{{where}}}")
    assert {r["metric"]["bound"]: float(r["value"][1]) for r in bounds} == {"min": 8, "max": 8}


def test_slo_lines_are_the_manifests(live: Live) -> None:
    """The dashboards' SLO lines are the resource's SLO, exported by its router."""
    got = {}
    for objective in ("ttft_seconds", "tpot_seconds", "attainment_ratio"):
        expr = f'max(epd_slo_objective{{namespace="{NAMESPACE}", objective="{objective}"}})'
        got[objective] = _finite(query(live.prom_url, expr))
    assert got == {"ttft_seconds": [0.001], "tpot_seconds": [0.25], "attainment_ratio": [0.95]}


def test_plan_served_is_the_running_plan(live: Live) -> None:
    result = query(live.prom_url, f'epd_plan_info{{namespace="{NAMESPACE}", role="router"}}')
    assert [r["metric"]["method"] for r in result] == ["E+P+D"]
    assert result[0]["metric"]["pools"] == "1E1P1D"


def test_operator_client_reads_the_live_workload(live: Live) -> None:
    stats = Prometheus(live.prom_url).workload(MODEL, NAMESPACE, 120)
    assert stats is not None
    # increase() extrapolates to the window's edges: a few percent
    assert stats.num_requests == pytest.approx(live.answers, rel=0.15)
    assert stats.mean_images == pytest.approx(live.images_sent / live.answers, rel=0.01)
    assert stats.mean_output_tokens == pytest.approx(8, rel=0.01)  # switch_drill.MAX_TOKENS
    assert stats.mean_prompt_tokens is not None and stats.mean_prompt_tokens > 1
    # a 1 ms TTFT SLO: nobody met it, and attainment 0 is data, not "unknown"
    assert stats.slo_attainment == 0.0


def test_unreachable_or_unknown_gives_none(live: Live) -> None:
    assert Prometheus(f"http://127.0.0.1:{free_port()}", timeout_s=1).scalar("1") is None
    assert Prometheus(live.prom_url).workload("no-such-model", NAMESPACE, 120) is None
    assert Prometheus(live.prom_url).scalar("sum(") is None  # a PromQL error


def test_live_attainment_triggers_a_replan(live: Live) -> None:
    """Auto mode, a plan made on this very workload (no shift): only the SLO attainment
    Prometheus reports (0 against 95 %) makes the re-plan due."""
    deployment = EPDDeployment.from_yaml(live.manifest)
    raw = deployment.spec.model_dump(mode="json", by_alias=True)
    raw["disaggregation"] = {"mode": "Auto"}
    raw["profiler"] = {"minRequests": 5, "intervalSeconds": 60}
    spec = type(deployment.spec).model_validate(raw)
    stats = Prometheus(live.prom_url).workload(MODEL, NAMESPACE, 120)
    assert stats is not None
    current = PlanStatus.from_plan(choose_plan(spec, None, stats, None, 0).plan, 1)
    calls = []

    def planner(spec_, stats_, now):  # the real heuristic, recording that it ran
        calls.append(stats_)
        return heuristic_planner(spec_, stats_, now)

    choice = choose_plan(spec, current, stats, stats, 120, planner)
    assert calls == [stats], "the re-plan was not due"
    assert choice.ran
    healthy = type(stats)(**{**stats.__dict__, "slo_attainment": 1.0})
    assert not choose_plan(spec, current, healthy, healthy, 120, planner).ran


def test_trace_shape_with_prometheus_attainment(live: Live) -> None:
    """The operator's two sources together: the router's trace gives the workload's shape,
    Prometheus the attainment (every router replica, every outcome). Read against a lenient
    SLO the trace says all met; the router's own 1 ms SLO, as Prometheus counts it, says none."""
    trace = RouterAPI(live.router_url, live.token).trace_window(600)
    assert trace is not None
    from_trace = workload_stats(trace.records, trace.span_s, SLO(ttft_s=60, tpot_s=60))
    assert from_trace.slo_attainment == 1.0
    live_stats = Prometheus(live.prom_url).workload(MODEL, NAMESPACE, 120)
    both = with_live_attainment(from_trace, live_stats)
    assert both is not None
    assert both.num_requests == from_trace.num_requests == live.answers
    assert both.mean_images == from_trace.mean_images
    assert both.slo_attainment == 0.0
    assert with_live_attainment(None, live_stats) is live_stats
    assert with_live_attainment(from_trace, None) is from_trace
