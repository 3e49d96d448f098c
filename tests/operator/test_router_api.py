"""The operator's drain client against the real router process (``epdctl router``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest

from epd_engine.config import Method, Role
from epd_engine.contracts.plan import Plan
from epd_engine.contracts.trace import TraceRecord, write_trace
from epd_engine.local.ports import free_port
from epd_engine.router.settings import RouterSettings
from epd_operator.kube import manifests as r
from epd_operator.rollout.router_api import RouterAPI, parse_in_flight
from tests.operator.conftest import make_owner

TOKEN = "test-token"
PLAN = Plan(method="E+P+D", pools={"E": 1, "P": 2, "D": 1})


def test_router_accepts_the_operator_configmap(tmp_path: Path) -> None:
    owner = make_owner()
    names = [p.name for p in r.pool_specs(owner, PLAN)]
    cm = r.render_configmap(owner, PLAN, names)
    path = tmp_path / "router.json"
    path.write_text(cm["data"]["router.json"])
    settings = RouterSettings.from_file(path)
    assert settings.model == "llava"
    assert settings.active_pools == sorted(names)
    assert settings.slo_tpot_s == pytest.approx(0.08)


def test_parse_in_flight_shapes() -> None:
    real = {"active_pools": None, "pools": {"a": {"inflight": 2, "instances": []}}}
    assert parse_in_flight(real) == {"a": 2}
    assert parse_in_flight({"pools": [{"name": "b", "in_flight": 1}]}) == {"b": 1}
    assert parse_in_flight({"c": {"instances": [{"inflight": 1}, {"inflight": 3}]}}) == {"c": 4}
    with pytest.raises(ValueError):
        parse_in_flight({"pools": {"a": 3}})


@pytest.fixture
def router_url(tmp_path: Path) -> Iterator[str]:
    yield from _router(tmp_path, {"model": "llava"})


RECORDED = [
    TraceRecord(arrival_s=float(i), prompt_tokens=10 * i, output_tokens=4, ttft_s=0.1)
    for i in range(3)
]


@pytest.fixture
def router_with_trace_url(tmp_path: Path) -> Iterator[str]:
    """A router whose trace directory already holds three records (arrivals 0, 1 and 2 s)."""
    write_trace(RECORDED, tmp_path / "trace" / "trace.jsonl")
    yield from _router(tmp_path, {"model": "llava", "trace_dir": str(tmp_path / "trace")})


@contextmanager
def start_router(
    tmp_path: Path, settings: dict[str, object] | None = None, port: int | None = None
) -> Iterator[str]:
    """A real ``epdctl router`` process on loopback; yields its URL."""
    with start_routers(tmp_path, 1, settings, [port] if port else None) as urls:
        yield urls[0]


@contextmanager
def start_routers(
    tmp_path: Path,
    count: int,
    settings: dict[str, object] | None = None,
    ports: list[int] | None = None,
) -> Iterator[list[str]]:
    """``count`` real router processes, started together (each takes seconds to import)."""
    tmp_path.mkdir(parents=True, exist_ok=True)
    config = tmp_path / "router.json"
    config.write_text(json.dumps(settings or {"model": "llava"}))
    env = {**os.environ, "EPD_INTERNAL_TOKEN": TOKEN}
    main = "import sys; from epd_engine.cli import main; sys.exit(main(sys.argv[1:]))"
    procs, urls = [], []
    try:
        for port in ports or [free_port() for _ in range(count)]:
            cmd = [sys.executable, "-c", main, "router", "--config", str(config), "--host",
                   "127.0.0.1", "--port", str(port), "--log-level", "warning"]  # fmt: skip
            procs.append(
                subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
            )
            urls.append(f"http://127.0.0.1:{port}")
        for proc, url in zip(procs, urls, strict=True):
            _wait_live(proc, url)
        yield urls
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(timeout=10)


def _wait_live(proc: subprocess.Popen[bytes], url: str, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health/live", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.2)
        if proc.poll() is not None:
            out = proc.stdout.read().decode() if proc.stdout else ""
            pytest.fail(f"router exited: {out[-2000:]}")
    pytest.fail(f"router did not come up in {timeout_s:g} s")


def _router(tmp_path: Path, settings: dict[str, object]) -> Iterator[str]:
    with start_routers(tmp_path, 1, settings) as urls:
        yield urls[0]


@pytest.mark.slow
def test_drain_client_against_the_real_router(router_url: str) -> None:
    api = RouterAPI(router_url, TOKEN, timeout_s=5)
    assert api.in_flight() == {}  # reachable, no pool has requests in flight
    assert api.set_routing(["llava-ep-1", "llava-d-2"])
    body = httpx.get(f"{router_url}/internal/pools", headers={"X-EPD-Token": TOKEN}).json()
    assert body["active_pools"] == ["llava-d-2", "llava-ep-1"]
    assert api.set_routing(["llava-d-2", "llava-ep-1"])  # the same switch again
    assert api.set_routing(["llava-epd-3"])
    metrics = httpx.get(f"{router_url}/metrics").text
    assert 'epd_reconfigurations_total{model="llava",pool="router",role="router"} 2.0' in metrics
    plan = Plan(method=Method.EP_D, pools={Role.EP: 3, Role.D: 1}, reason="profiler: best")
    assert api.set_routing(["llava-ep-4", "llava-d-4"], plan)
    metrics = httpx.get(f"{router_url}/metrics").text
    assert 'method="EP+D"' in metrics and 'pools="3EP1D"' in metrics
    assert 'reason="profiler: best"' in metrics
    bad = {"active_pools": ["x"], "plan": {"method": "E+X", "pools": {}}}
    resp = httpx.put(f"{router_url}/internal/routing", json=bad, headers={"X-EPD-Token": TOKEN})
    assert resp.status_code == 422 and "plan" in resp.text
    body = httpx.get(f"{router_url}/internal/pools", headers={"X-EPD-Token": TOKEN}).json()
    assert body["active_pools"] == ["llava-d-4", "llava-ep-4"]  # a bad plan changes nothing
    wrong = RouterAPI(router_url, "wrong-token")
    assert wrong.in_flight() is None and not wrong.set_routing(["x"])


def test_unreachable_router_reads_as_unknown() -> None:
    api = RouterAPI(f"http://127.0.0.1:{free_port()}", TOKEN, timeout_s=0.5)
    assert api.in_flight() is None
    assert api.set_routing(["a"]) is False
    assert api.trace(0) is None
    assert api.trace_window(900) is None


@pytest.mark.slow
def test_trace_of_a_fresh_router_is_empty(router_url: str) -> None:
    api = RouterAPI(router_url, TOKEN, timeout_s=5)
    assert api.trace(0) == []
    recent = api.trace_window(900)
    assert recent is not None and recent.records == []
    assert 0 < recent.span_s < 900  # the router is younger than the window


@pytest.mark.slow
def test_trace_since_and_window_read_the_recorded_trace(router_with_trace_url: str) -> None:
    api = RouterAPI(router_with_trace_url, TOKEN, timeout_s=5)
    assert api.trace(0) == RECORDED
    assert api.trace(1.0) == RECORDED[1:]
    recent = api.trace_window(600)
    assert recent is not None
    assert recent.records == RECORDED  # window starts at the router's start: not rebased
    clock_s = recent.span_s
    assert 0 < clock_s < 600
    # a window 0.5 s shorter than the router's age starts ~0.5 s after it: rebased records
    short = api.trace_window(clock_s - 0.5)
    assert short is not None and short.span_s == pytest.approx(clock_s - 0.5)
    by_prompt = {r.prompt_tokens: r for r in RECORDED}
    starts = [by_prompt[r.prompt_tokens].arrival_s - r.arrival_s for r in short.records]
    start_s = starts[0]
    assert starts == pytest.approx([start_s] * len(starts))  # rebased to the window start
    assert 0.5 <= start_s <= 1.0
    assert short.records[0].prompt_tokens == 10  # the record at 0 s is outside the window


def test_trace_needs_the_internal_token(router_with_trace_url: str) -> None:
    """Defect: the router served every request's shape and timing (the trace) to anyone who
    could reach its public Service."""
    url = f"{router_with_trace_url}/v1/trace"
    assert httpx.get(url).status_code == 403
    assert httpx.get(url, headers={"X-EPD-Token": "wrong"}).status_code == 403
    assert len(RouterAPI(router_with_trace_url, TOKEN, timeout_s=5).trace() or []) == 3


def test_calls_every_pass_share_one_ssl_context(
    router_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Defect: each call built an httpx Client and with it a new SSL context (native memory
    the allocator kept once several threads called): the ``epdctl up`` supervisor, which asks
    the router every pass, grew +36 % in the one-hour soak. Now at most one per process."""
    import ssl

    made: list[object] = []
    original_new = ssl.SSLContext.__new__

    def counting_new(cls: type[ssl.SSLContext], *args: object, **kwargs: object) -> object:
        made.append(cls)
        return original_new(cls, *args, **kwargs)

    monkeypatch.setattr(ssl.SSLContext, "__new__", counting_new)
    api = RouterAPI(router_url, TOKEN)
    for _ in range(10):  # what passes call: routing and in-flight, waiting, trace, switch
        assert api.pools_state() is not None
        assert api.waiting() is not None
        assert api.trace_window(60.0) is not None
        assert api.set_routing([])
    assert len(made) <= 1, f"{len(made)} SSL contexts for 40 calls"
