"""The window a plan is sized on counts the requests in flight with a finished one's shape
(``planning/offered.py``): their arrivals are the offered rate; their shapes are not known."""

from __future__ import annotations

from epd_engine.contracts.trace import ImageRef, TraceRecord
from epd_operator.planning.offered import offered
from epd_operator.planning.planner import workload_stats

IMAGE = ImageRef(tokens=16, hash="cat", width=64, height=64)


def _finished(at_s: float, images: tuple[ImageRef, ...] = ()) -> TraceRecord:
    return TraceRecord(
        arrival_s=at_s, prompt_tokens=40, images=images, output_tokens=20, ttft_s=0.1
    )


def _waiting(at_s: float, name: str, tokens_out: int = 1) -> TraceRecord:
    return TraceRecord(
        arrival_s=at_s, prompt_tokens=0, output_tokens=tokens_out, request_id=name, in_flight=True
    )


def test_requests_in_flight_take_finished_shapes_with_their_own_arrivals() -> None:
    records = [_finished(0.0, (IMAGE,)), _finished(1.0), _waiting(2.0, "a"), _waiting(3.0, "b", 25)]
    out = offered(records)
    assert [r.arrival_s for r in out] == [0.0, 1.0, 2.0, 3.0]
    assert out[:2] == records[:2]  # finished ones unchanged
    a, b = out[2], out[3]
    assert (a.prompt_tokens, a.output_tokens, a.num_images) == (40, 20, 1)
    assert a.images[0].hash != "cat"  # a copied image is not a cache hit
    assert (b.prompt_tokens, b.output_tokens, b.num_images) == (40, 25, 0)  # 25 already out
    assert a.in_flight and b.in_flight and a.ttft_s is None


def test_the_rate_counts_them_and_attainment_only_what_was_measured() -> None:
    records = [_finished(float(i)) for i in range(6)] + [
        _waiting(6.0 + i / 4, f"w{i}") for i in range(24)
    ]
    stats = workload_stats(offered(records), window_s=12.0)
    served = workload_stats([r for r in records if not r.in_flight], window_s=12.0)
    assert stats.request_rate_rps == 2.5 and served.request_rate_rps == 0.5


def test_with_nothing_finished_they_keep_what_is_known() -> None:
    out = offered([_waiting(0.0, "a"), _waiting(1.0, "b", 3)])
    assert [(r.prompt_tokens, r.output_tokens) for r in out] == [(1, 1), (1, 3)]
