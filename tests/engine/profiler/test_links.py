"""The planner sees the real link: per-backend link coefficients in the cost model, chosen by
the deployment's transfer backend, and used by the simulator for every migration."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from epd_engine.bench.report import load_report
from epd_engine.cli import main
from epd_engine.config import SLO, Method, Role
from epd_engine.contracts.plan import Plan
from epd_engine.contracts.trace import write_trace
from epd_engine.profiler.cost_model import (
    FittedCostModel,
    MigrationCoeffs,
    load_cost_model,
    save_cost_model,
)
from epd_engine.profiler.links import LinkCoeffs, fit_link, link_backend
from epd_engine.profiler.simulator import simulate

from .factories import make_trace, toy_cost_model

REPO = Path(__file__).resolve().parents[3]
LINKS = {  # far apart, so a test can tell which one a migration used
    "tcp": LinkCoeffs(latency_s=0.050, bytes_per_s=1e6),
    "shm": LinkCoeffs(latency_s=0.0001, bytes_per_s=5e9),
    "collective": LinkCoeffs(latency_s=0.010, bytes_per_s=1e8),
}


def with_links() -> FittedCostModel:
    model = dataclasses.replace(toy_cost_model(), links=LINKS)
    return model.for_backend("auto")  # what profile-costs saves: the one-host default


def test_fit_link_recovers_latency_and_bandwidth() -> None:
    latency, bandwidth = 0.002, 1e9
    page = 4096
    bulk, transfers = 32 << 20, 4
    link = fit_link(page, latency + page / bandwidth, bulk, transfers,
                    transfers * latency + bulk / bandwidth)  # fmt: skip
    assert link.latency_s == pytest.approx(latency)
    assert link.bytes_per_s == pytest.approx(bandwidth)


def test_a_bulk_pull_faster_than_its_latencies_still_gives_a_finite_link() -> None:
    link = fit_link(4096, page_s=0.01, bulk_bytes=1 << 20, bulk_transfers=4, bulk_s=0.02)
    assert link.bytes_per_s == pytest.approx((1 << 20) / 0.02)  # the bulk pull alone
    assert 0 <= link.latency_s <= 0.01


def test_auto_is_shm_on_one_host_and_tcp_across_hosts() -> None:
    assert link_backend("auto", same_host=True) == "shm"
    assert link_backend("auto", same_host=False) == "tcp"
    assert link_backend("collective", same_host=False) == "collective"


def test_links_round_trip_through_json(tmp_path: Path) -> None:
    model = dataclasses.replace(with_links(), migration=MigrationCoeffs(kv_transfers=4))
    loaded = load_cost_model(save_cost_model(model, tmp_path / "cost.json"))
    assert loaded == model
    assert loaded.links["tcp"] == LINKS["tcp"] and loaded.migration.kv_transfers == 4


def test_the_committed_cost_model_from_before_links_loads_and_keeps_its_link() -> None:
    old = load_cost_model(REPO / "tests/data/cost-model-cpu-before-links.json")
    assert old.links == {} and old.transfer_backend == ""
    assert old.migration.kv_transfers == 1
    assert old.for_backend("auto") == old  # nothing measured per backend: the stored link


def replace_early(migration: MigrationCoeffs, early: bool) -> MigrationCoeffs:
    return dataclasses.replace(migration, early_kv=early)


def test_each_backend_gets_its_own_link_and_kv_pays_latency_per_layer_group() -> None:
    model = with_links()
    assert model.transfer_backend == "shm" and model.migration.latency_s == 0.0001
    tcp = model.for_backend("tcp")
    assert (tcp.transfer_backend, tcp.migration.bytes_per_s) == ("tcp", 1e6)
    assert model.for_backend("auto", same_host=False).transfer_backend == "tcp"
    assert model.for_backend("cuda_ipc") == model  # not measured: unchanged
    grouped = dataclasses.replace(tcp, migration=dataclasses.replace(tcp.migration, kv_transfers=4))
    assert grouped.migration_s("image", 0) == pytest.approx(0.050)
    # early hand-off: three groups moved while prefill ran, the last is on the request's path
    assert grouped.migration_s("kv", 0) == pytest.approx(0.050)
    after = dataclasses.replace(grouped, migration=replace_early(grouped.migration, False))
    assert after.migration_s("kv", 0) == pytest.approx(4 * 0.050)


@pytest.mark.parametrize("backend", ["tcp", "shm", "collective"])
def test_the_simulator_migrates_over_the_chosen_backends_link(backend: str) -> None:
    cost = with_links().for_backend(backend)
    plan = Plan(method=Method.E_P_D, pools={Role.E: 1, Role.P: 1, Role.D: 1})
    [r] = simulate(plan, make_trace(num=1), cost, SLO(ttft_s=100, tpot_s=10)).results
    link = LINKS[backend]
    assert r.stage_s is not None
    image_bytes, kv_bytes = 100 * 1024, 120 * 4096  # toy model: per-token bytes
    assert r.stage_s["migration_image"] == pytest.approx(
        link.latency_s + image_bytes / link.bytes_per_s
    )
    assert r.stage_s["migration_kv"] == pytest.approx(link.latency_s + kv_bytes / link.bytes_per_s)


def test_simulate_uses_the_transfer_backend_flag(tmp_path: Path) -> None:
    trace = write_trace(make_trace(num=4, rate_rps=2), tmp_path / "trace.jsonl")
    cost = save_cost_model(with_links(), tmp_path / "cost.json")
    kv_s = {}
    for flag in (["--transfer-backend", "tcp"], []):  # default auto: shm on one host
        out = tmp_path / f"sim{len(flag)}.json"
        argv = ["simulate", "--trace", str(trace), "--cost-model", str(cost),
                "--pools", "1E1P1D", "--slo-ttft", "100", "--slo-tpot", "10",
                "--out", str(out), *flag]  # fmt: skip
        assert main(argv) == 0
        report = load_report(out)
        kv_s[report["link"]["backend"]] = report["requests"][0]["stage_s"]["migration_kv"]
    assert set(kv_s) == {"tcp", "shm"}
    assert kv_s["tcp"] > 100 * kv_s["shm"]
    assert json.loads(cost.read_text())["transfer_backend"] == "shm"
