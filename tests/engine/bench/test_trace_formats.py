"""Peer trace formats: the sample files in tests/data were written by us in each format's
published layout (Mooncake / AIPerf JSONL, BurstGPT CSV, Azure LLM inference CSV)."""

from __future__ import annotations

from pathlib import Path

import pytest

from epd_engine.contracts.trace import TraceFormatError, read_trace, write_trace
from epd_engine.workload.arrivals import ArrivalSpec
from epd_engine.workload.generators import synthesize
from epd_engine.workload.trace_formats import (
    detect_format,
    read_any,
    read_mooncake,
    write_mooncake,
)

DATA = Path(__file__).parents[2] / "data"


def test_mooncake_jsonl_keeps_times_lengths_and_prefix_blocks() -> None:
    records = read_any(DATA / "mooncake_sample.jsonl")
    assert [r.arrival_s for r in records] == pytest.approx([0.0, 0.25, 0.6, 1.0])
    assert [r.prompt_tokens for r in records] == [600, 700, 300, 520]
    assert [r.output_tokens for r in records] == [12, 8, 20, 5]
    assert [r.hash_ids for r in records] == [(0, 1), (0, 2), (3,), (0, 1)]
    assert all(r.text_only for r in records)


def test_burstgpt_csv_rebases_time_and_skips_failed_requests() -> None:
    records = read_any(DATA / "burstgpt_sample.csv")
    # the GPT-4 row has 0 response tokens: a failed request, nothing to replay
    assert [r.arrival_s for r in records] == pytest.approx([0.0, 1.25, 4.0])
    assert [(r.prompt_tokens, r.output_tokens) for r in records] == [(472, 18), (88, 240),
                                                                     (301, 57)]  # fmt: skip


def test_azure_csv_reads_seven_digit_timestamps() -> None:
    records = read_any(DATA / "azure_llm_sample.csv")
    assert [r.arrival_s for r in records] == pytest.approx([0.0, 0.34941, 2.5], abs=1e-6)
    assert [(r.prompt_tokens, r.output_tokens) for r in records] == [(374, 44), (396, 109),
                                                                     (879, 20)]  # fmt: skip


def test_formats_are_detected_from_the_first_line(tmp_path: Path) -> None:
    ours = write_trace(synthesize("pope", 3, ArrivalSpec("uniform", 2.0)), tmp_path / "t.jsonl")
    assert detect_format(ours) == "epd"
    assert detect_format(DATA / "mooncake_sample.jsonl") == "mooncake"
    assert detect_format(DATA / "burstgpt_sample.csv") == "burstgpt"
    assert detect_format(DATA / "azure_llm_sample.csv") == "azure"


def test_export_as_mooncake_counts_the_whole_prefill(tmp_path: Path) -> None:
    """A text-only peer replaying our export must prefill as many tokens as we did."""
    ours = synthesize("textcaps", 5, ArrivalSpec("uniform", 4.0), seed=3)
    back = read_mooncake(write_mooncake(ours, tmp_path / "m.jsonl"))
    assert [r.prompt_tokens for r in back] == [r.total_prompt_tokens for r in ours]
    assert [r.output_tokens for r in back] == [r.output_tokens for r in ours]
    assert [r.arrival_s for r in back] == pytest.approx([r.arrival_s for r in ours], abs=1e-3)


def test_prefix_blocks_survive_our_own_format(tmp_path: Path) -> None:
    records = read_mooncake(DATA / "mooncake_sample.jsonl")
    again = read_trace(write_trace(records, tmp_path / "ours.jsonl"))
    assert [r.hash_ids for r in again] == [r.hash_ids for r in records]
    exported = read_mooncake(write_mooncake(again, tmp_path / "m.jsonl"))
    assert [r.hash_ids for r in exported] == [r.hash_ids for r in records]


def test_bad_files_name_the_problem(tmp_path: Path) -> None:
    missing = tmp_path / "b.csv"
    missing.write_text("Timestamp,Model,Request tokens\n1,x,3\n")
    with pytest.raises(TraceFormatError, match=r"missing columns \['Response tokens'\]"):
        read_any(missing)
    garbage = tmp_path / "g.txt"
    garbage.write_text("hello\n")
    with pytest.raises(TraceFormatError, match="neither"):
        read_any(garbage)
    bad = tmp_path / "m.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 10, "hash_ids": ["a"]}\n')
    with pytest.raises(TraceFormatError, match=r"m.jsonl:1: hash_ids"):
        read_any(bad)
