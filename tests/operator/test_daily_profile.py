"""The daily profile (issue 32 item 4): yesterday's rate curve, scaled to today's level, as a
floor under the forecast. The ratio is read from a real Prometheus (Debian's binary) that
scrapes a real HTTP exporter on loopback whose request counter follows a periodic rate; the
"day" is 20 s so that the test holds a period of history (the code takes the period)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from epd_engine.contracts.trace import TraceRecord
from epd_operator.api.spec import EPDDeploymentSpec
from epd_operator.planning.choice import WorkloadStats
from epd_operator.planning.daily_profile import profile_ratio
from epd_operator.planning.forecast import GROWTH_CAP, forecast_rates, with_profile
from epd_operator.planning.plan_pass import with_forecast
from epd_operator.planning.prometheus import Prometheus
from tests.operator.conftest import make_spec_dict
from tests.processes import free_port
from tests.prometheus_server import prometheus

PERIOD_S = 20
LOW_RPS, HIGH_RPS = 2.0, 4.0  # the first half of each period, then the second


def test_the_profile_raises_the_forecast_and_says_so() -> None:
    flat = forecast_rates([2.0, 2.0, 2.0], 10.0, 2.0, 120.0, 10.0)
    assert flat.forecast_rps == pytest.approx(2.0) and flat.rule == "trend"
    up = with_profile(flat, 1.5)  # a day ago the rate rose by half over the next 120 s
    assert up.forecast_rps == pytest.approx(3.0) and up.profile_rps == pytest.approx(3.0)
    assert up.rule.startswith("daily profile: a day ago the rate 120 s later was 1.50x")
    # capped as the trend is, and never a reason to plan below the trend or the held peak
    assert with_profile(flat, 10.0).forecast_rps == pytest.approx(2.0 * GROWTH_CAP)
    down = with_profile(flat, 0.5)
    assert down.forecast_rps == pytest.approx(2.0) and down.rule == "trend"
    assert with_profile(flat, None) == flat


def test_the_pass_forecast_takes_the_profile_where_there_is_history() -> None:
    spec = EPDDeploymentSpec.model_validate(
        make_spec_dict(
            gpuBudget=8, disaggregation={"mode": "Auto"}, capacity={"minGPUs": 1, "maxGPUs": 8}
        )
    )
    records = [
        TraceRecord(arrival_s=i * 0.5, prompt_tokens=10, output_tokens=4) for i in range(120)
    ]
    stats = WorkloadStats(num_requests=120, request_rate_rps=2.0, window_s=60.0)
    horizons: list[float] = []

    def read_profile(horizon_s: float) -> float | None:
        horizons.append(horizon_s)
        return 1.5

    plain, _ = with_forecast(spec, records, stats, 30.0)
    profiled, forecast = with_forecast(spec, records, stats, 30.0, read_profile)
    assert horizons == [30.0]
    assert plain is not None and plain.forecast_rps == pytest.approx(2.0, rel=0.05)
    assert profiled is not None and profiled.forecast_rps == pytest.approx(3.0, rel=0.05)
    assert forecast is not None and forecast.rule.startswith("daily profile")


def requests_at(t: float) -> float:
    """The counter: the integral of a rate that is LOW for half of each period, HIGH after."""
    whole, part = divmod(t, PERIOD_S)
    half = PERIOD_S / 2
    per_period = (LOW_RPS + HIGH_RPS) * half
    into = LOW_RPS * min(part, half) + HIGH_RPS * max(0.0, part - half)
    return whole * per_period + into


@pytest.fixture
def exporter() -> Iterator[tuple[str, float]]:
    started = time.time()

    class Metrics(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            count = requests_at(time.time() - started)
            body = (
                "# TYPE epd_requests_total counter\n"
                f'epd_requests_total{{model="m",namespace="ns"}} {count}\n'
            ).encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *_: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", free_port()), Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"127.0.0.1:{server.server_address[1]}", started
    finally:
        server.shutdown()


@pytest.mark.slow
def test_the_ratio_is_read_from_a_period_of_prometheus_history(
    exporter: tuple[str, float], tmp_path: Path
) -> None:
    target, started = exporter
    with prometheus({target: {}}, tmp_path / "prom") as url:
        scraped = time.time() - started  # history begins about here
        prom = Prometheus(url)
        assert profile_ratio(prom, "m", "ns", 5, 5.0, PERIOD_S) is None  # no history yet
        # at phase 7 of a period (3 s before its high half), once the window a period
        # earlier ([t - 25, t - 20]) lies wholly within the scraped history
        at = PERIOD_S + 7.0
        while at - PERIOD_S - 5 < scraped + 2:
            at += PERIOD_S
        time.sleep(max(0.0, at - (time.time() - started)))
        ratio = profile_ratio(prom, "m", "ns", 5, 5.0, PERIOD_S)
    # a period ago: 2 rps over phases 2-7, then 3 s of 2 and 2 s of 4 over phases 7-12
    expected = (3 * LOW_RPS + 2 * HIGH_RPS) / (5 * LOW_RPS)
    print(f"ratio {ratio:.3f}, expected {expected:.3f}")
    assert ratio is not None and ratio == pytest.approx(expected, rel=0.25), (ratio, expected)
