"""``epdctl router`` flags: the SLO it exports (dashboards draw it) and the plan it serves."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from epd_engine.cli import UserError
from epd_engine.commands import router as router_cmd
from epd_engine.metrics import Metrics


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    router_cmd.register(parser.add_subparsers())
    return parser.parse_args(["router", "--model", "m", *argv])


def test_slo_flags_reach_the_exported_objectives() -> None:
    settings = router_cmd.settings_from(
        _args("--slo-ttft", "0.5", "--slo-tpot", "0.02", "--slo-attainment", "0.99")
    )
    metrics = Metrics("m", "router", "router")
    metrics.publish_slo(settings.slo)
    text = generate_latest(metrics.registry).decode()
    for objective, value in (
        ("attainment_ratio", "0.99"),
        ("tpot_seconds", "0.02"),
        ("ttft_seconds", "0.5"),
    ):
        assert f'objective="{objective}",pool="router",role="router"}} {value}' in text


def test_attainment_out_of_range_is_refused() -> None:
    with pytest.raises(UserError, match="slo_attainment"):
        router_cmd.settings_from(_args("--slo-attainment", "1.5"))


def test_plan_file(tmp_path: Path) -> None:
    good = tmp_path / "plan.json"
    good.write_text(json.dumps({"method": "E+P+D", "pools": {"E": 1, "P": 1, "D": 2}}))
    assert router_cmd.settings_from(_args("--plan", str(good))).plan is not None
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"method": "X"}))
    with pytest.raises(UserError, match="invalid plan"):
        router_cmd.settings_from(_args("--plan", str(bad)))
    with pytest.raises(UserError, match="cannot read plan"):
        router_cmd.settings_from(_args("--plan", str(tmp_path / "missing.json")))


def test_counters_and_histograms_exist_at_zero_before_any_event() -> None:
    """Prometheus' increase() misses what happened before a series' first sample."""
    text = generate_latest(Metrics("m", "E", "p").registry).decode()
    assert 'epd_slo_met_total{model="m",pool="p",role="E"} 0.0' in text
    assert 'epd_requests_total{model="m",outcome="success",pool="p",role="E"} 0.0' in text
    assert 'epd_batch_images_count{model="m",pool="p",role="E"} 0.0' in text
    assert 'epd_kv_groups_pulled_total{model="m",overlapped="true",pool="p",role="E"} 0.0' in text
