"""The router's hops between instances, from the stages' monotonic marks (one host)."""

from __future__ import annotations

import time
from typing import Any

from epd_engine.api.protocol import ChatCompletionRequest
from epd_engine.router.inflight import InflightRequest
from epd_engine.timing import clock_domain


def _request(arrival_s: float) -> InflightRequest:
    body = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "hi"}])
    return InflightRequest("req-1", body, arrival_s)


def _event(
    instance: str,
    stage: str,
    ready_at: float,
    end_at: float,
    tokens: int = 0,
    finish: str | None = None,
    clock: str | None = None,
) -> dict[str, Any]:
    timing = {
        "stage": stage,
        "queue_s": 0.0,
        "exec_s": end_at - ready_at,
        "ready_at": ready_at,
        "end_at": end_at,
        "clock": clock_domain() if clock is None else clock,
    }
    event: dict[str, Any] = {"attempt": 0, "instance_id": instance, "stage_timings": [timing]}
    if tokens:
        event.update(token_ids=[7], num_output_tokens=tokens, finish_reason=finish)
    return event


def _e_p_d(request: InflightRequest, t0: float, clock: str | None = None) -> None:
    request.apply(_event("e", "encode", t0 + 0.010, t0 + 0.012, clock=clock))
    request.apply(_event("p", "prefill", t0 + 0.015, t0 + 0.020, tokens=1, clock=clock))
    request.apply(_event("d", "decode", t0 + 0.019, t0 + 0.050, 2, "stop", clock=clock))


def test_front_and_hops_come_from_the_instances_marks() -> None:
    t0 = time.monotonic() - 1.0
    request = _request(t0)
    _e_p_d(request, t0)
    s = request.stage_s
    assert request.instances == ["e", "p", "d"]
    assert s["front"] == approx(0.010)  # arrival -> E's encode ready
    assert s["hop_image"] == approx(0.003)  # E's end -> P's prefill ready
    assert s["hop_kv"] == approx(-0.001)  # the early offer came before the prefill ended
    assert s["tail"] == approx(request.token_times_s[0] - (t0 + 0.020))  # first token's way
    assert s["encode"] == approx(0.002)  # the sums stay as they were


def test_the_front_splits_at_the_routers_post() -> None:
    """The front's router part ends when the router POSTed the request on; without that
    mark (a request from before it) the front is not split."""
    t0 = time.monotonic() - 1.0
    request = _request(t0)
    request.dispatched_s = t0 + 0.0004
    _e_p_d(request, t0)
    assert request.stage_s["front_router"] == approx(0.0004)
    assert request.stage_s["front"] == approx(0.010)
    unsplit = _request(t0)
    _e_p_d(unsplit, t0)
    assert "front_router" not in unsplit.stage_s


def test_an_instance_that_does_two_stages_hops_after_its_last() -> None:
    t0 = time.monotonic() - 1.0
    request = _request(t0)
    request.apply(_event("ep", "encode", t0 + 0.010, t0 + 0.012))
    request.apply(_event("ep", "prefill", t0 + 0.012, t0 + 0.020, tokens=1))
    request.apply(_event("d", "decode", t0 + 0.023, t0 + 0.050, 2, "stop"))
    assert request.stage_s["front"] == approx(0.010)
    assert request.stage_s["hop_kv"] == approx(0.003)
    assert "hop_image" not in request.stage_s


def test_marks_from_another_host_are_not_compared() -> None:
    t0 = time.monotonic() - 1.0
    request = _request(t0)
    _e_p_d(request, t0, clock="another-boot")
    assert not {"front", "hop_image", "hop_kv", "tail"} & set(request.stage_s)
    assert request.stage_s["prefill"] == approx(0.005)


def test_timings_without_marks_derive_nothing() -> None:
    """Instances from before the marks (or with no clock domain) report sums only."""
    request = _request(0.0)
    request.apply(
        {"attempt": 0, "instance_id": "p", "token_ids": [1], "num_output_tokens": 1,
         "stage_timings": [{"stage": "prefill", "queue_s": 0.0, "exec_s": 0.01}]}
    )  # fmt: skip
    assert request.stage_s == {"prefill_queue": 0.0, "prefill": 0.01}


def test_a_path_back_to_an_instance_is_not_read_as_hops() -> None:
    t0 = time.monotonic() - 1.0
    request = _request(t0)
    request.dispatched_s = t0 + 0.001
    request.apply(_event("a", "encode", t0 + 0.010, t0 + 0.012))
    request.apply(_event("b", "prefill", t0 + 0.015, t0 + 0.020))
    request.apply(_event("a", "decode", t0 + 0.025, t0 + 0.050, 1, "stop"))
    assert "hop_image" not in request.stage_s and "front" not in request.stage_s
    assert "front_router" not in request.stage_s


def approx(x: float) -> Any:
    import pytest

    return pytest.approx(x, abs=1e-9)
