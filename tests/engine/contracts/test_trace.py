from __future__ import annotations

import json
from pathlib import Path

import pytest

from epd_engine.contracts.trace import (
    ImageRef,
    TraceFormatError,
    TraceRecord,
    nearest_rank,
    parse_trace,
    read_trace,
    split_history,
    summarize_trace,
    tail_window,
    trace_digest,
    trace_ref,
    window,
    write_trace,
)


def make_record(arrival_s: float = 0.0, **overrides: object) -> TraceRecord:
    data: dict[str, object] = {
        "arrival_s": arrival_s,
        "prompt_tokens": 12,
        "images": [{"tokens": 576, "hash": "abc", "width": 640, "height": 480}],
        "output_tokens": 20,
    }
    data.update(overrides)
    return TraceRecord.model_validate(data)


def test_round_trip_keeps_every_field(tmp_path: Path) -> None:
    records = [
        make_record(0.0, request_id="r0"),
        make_record(
            0.5,
            images=[],
            ttft_s=0.3,
            tpot_s=[0.01, 0.02],
            e2e_s=0.4,
            path=["P", "D"],
            stage_s={"prefill": 0.2, "decode": 0.1},
        ),
        make_record(1.0, tpot_s=0.05),
    ]
    path = write_trace(records, tmp_path / "sub" / "trace.jsonl")
    assert read_trace(path) == records
    assert len(path.read_text().splitlines()) == 3


def test_derived_properties() -> None:
    multimodal = make_record(images=[{"tokens": 100, "hash": "a", "width": 1, "height": 1}] * 2)
    assert not multimodal.text_only
    assert multimodal.num_images == 2
    assert multimodal.total_prompt_tokens == 12 + 200
    text = make_record(images=[])
    assert text.text_only and text.total_prompt_tokens == 12
    assert make_record(tpot_s=0.07).tpot_p90_s == 0.07
    assert make_record().tpot_p90_s is None


def test_nearest_rank_matches_the_90_percent_of_gaps_rule() -> None:
    assert nearest_rank([0.01] * 9 + [1.0], 0.9) == 0.01  # 9 of 10 gaps are fast: met
    assert nearest_rank([0.01] * 8 + [1.0, 1.0], 0.9) == 1.0  # only 8 of 10: missed
    assert nearest_rank([], 0.9) == 0.0
    assert nearest_rank([0.3], 0.9) == 0.3


def test_blank_lines_and_comments_are_skipped_and_unknown_keys_ignored() -> None:
    lines = [
        "# recorded by the router",
        "",
        json.dumps({"arrival_s": 0, "prompt_tokens": 3, "output_tokens": 2, "model": "m"}),
    ]
    (record,) = parse_trace(lines)
    assert record.prompt_tokens == 3 and record.text_only


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ("{not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"arrival_s": 0, "prompt_tokens": 3}', "output_tokens: Field required"),
        ('{"arrival_s": -1, "prompt_tokens": 3, "output_tokens": 2}', "arrival_s"),
        (
            '{"arrival_s": 0, "prompt_tokens": 3, "output_tokens": 2, "images": [{"tokens": 1}]}',
            "images.0.hash",
        ),
    ],
)
def test_bad_lines_name_the_line_and_field(line: str, expected: str) -> None:
    good = json.dumps({"arrival_s": 0, "prompt_tokens": 3, "output_tokens": 2})
    with pytest.raises(TraceFormatError) as info:
        parse_trace([good, good, line], source="t.jsonl")
    assert str(info.value).startswith("t.jsonl:3: ")
    assert expected in str(info.value)


def test_missing_file_is_a_trace_error(tmp_path: Path) -> None:
    with pytest.raises(TraceFormatError, match="cannot read trace"):
        read_trace(tmp_path / "nope.jsonl")


def test_digest_depends_on_workload_only() -> None:
    base = [make_record(0.0), make_record(1.0)]
    measured = [make_record(0.0, ttft_s=0.5, request_id="x"), make_record(1.0, tpot_s=[0.1])]
    assert trace_digest(base) == trace_digest(measured)
    assert trace_digest(base).startswith("sha256:") and len(trace_digest(base)) == 23
    assert trace_digest(base) != trace_digest(
        [make_record(0.0), make_record(1.0, output_tokens=21)]
    )
    assert trace_digest(base) != trace_digest(base[::-1])
    ref = trace_ref(base, "last 5m")
    assert (ref.requests, ref.window, ref.digest) == (2, "last 5m", trace_digest(base))


def test_windows_rebase_and_split() -> None:
    records = [make_record(float(t)) for t in (3, 0, 1, 2, 4)]
    cut = window(records, 1.0, 3.0)
    assert [r.arrival_s for r in cut] == [0.0, 1.0]
    assert [r.arrival_s for r in window(records, 1.0, 3.0, rebase=False)] == [1.0, 2.0]
    assert [r.arrival_s for r in tail_window(records, 2.0)] == [0.0, 1.0, 2.0]
    with pytest.raises(ValueError):
        window(records, 2.0, 1.0)
    history, evaluation = split_history([make_record(float(t)) for t in range(20)])
    assert [r.arrival_s for r in history] == [0.0, 1.0]
    assert len(evaluation) == 18 and evaluation[0].arrival_s == 0.0


def test_summary_counts_shape() -> None:
    records = [make_record(0.0), make_record(1.0, images=[]), make_record(2.0)]
    summary = summarize_trace(records)
    assert summary["num_requests"] == 3
    assert summary["text_only_fraction"] == pytest.approx(0.333, abs=1e-3)
    assert summary["num_unique_images"] == 1
    assert summary["mean_rate_rps"] == 1.0
    assert summarize_trace([]) == {"num_requests": 0}


def test_image_ref_validation() -> None:
    with pytest.raises(ValueError):
        ImageRef(tokens=1, hash="", width=1, height=1)
    with pytest.raises(ValueError):
        ImageRef(tokens=1, hash="a", width=0, height=1)
