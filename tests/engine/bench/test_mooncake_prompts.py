"""``epdctl trace convert --to mooncake --tokenizer DIR``: the prompts themselves
(``text_input``, which AIPerf sends as it is), token-exact with the model's tokenizer, so a
peer replays the same prompts ``epdctl bench`` sends, not prompts of its own making."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from epd_engine.bench.payloads import chat_payload
from epd_engine.bench.token_prompts import TokenExactPrompts
from epd_engine.cli import main
from epd_engine.contracts.trace import ImageRef, TraceRecord, write_trace
from epd_engine.workload.trace_formats import read_mooncake

DATA = Path(__file__).resolve().parents[2] / "data"


def _rows(path: Path) -> list[dict[str, object]]:
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("mode", ["template", "content"])
def test_exported_prompt_texts_have_the_traces_token_counts(
    tiny_model_dir: Path, tmp_path: Path, mode: str
) -> None:
    out = tmp_path / "texts.jsonl"
    args = ["trace", "convert", str(DATA / "mooncake_sample.jsonl"), "--to", "mooncake",
            "--tokenizer", str(tiny_model_dir), "--prompt-count", mode, "--block-size", "64",
            "-o", str(out)]  # fmt: skip
    assert main(args) == 0
    rows, source = _rows(out), _rows(DATA / "mooncake_sample.jsonl")
    prompts = TokenExactPrompts.from_model_dir(tiny_model_dir, mode)  # type: ignore[arg-type]
    assert len(rows) == len(source)
    for row, original in zip(rows, source, strict=True):
        # AIPerf takes exactly one of text_input and input_length, and hash_ids only with
        # input_length: the shared blocks are in the text
        assert set(row) == {"timestamp", "text_input", "output_length"}
        assert row["timestamp"] == original["timestamp"]
        assert row["output_length"] == original["output_length"]
        assert prompts.count(str(row["text_input"])) == original["input_length"]
    first, second = str(rows[0]["text_input"]), str(rows[1]["text_input"])  # hash_ids [0, ...]
    block = prompts.block_text(0, 64)
    assert first.startswith(block) and second.startswith(block)
    assert first[: len(block) + 20] != second[: len(block) + 20]  # block 1 vs block 2


def test_a_text_only_record_exports_the_text_bench_sends(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    records = [
        TraceRecord(request_id="a", arrival_s=0.0, prompt_tokens=90, output_tokens=4),
        TraceRecord(request_id="b", arrival_s=0.5, prompt_tokens=40, output_tokens=3,
                    images=(ImageRef(tokens=16, hash="h", width=32, height=32),)),
    ]  # fmt: skip
    ours = write_trace(records, tmp_path / "ours.jsonl")
    out = tmp_path / "texts.jsonl"
    assert main(["trace", "convert", str(ours), "--to", "mooncake",
                 "--tokenizer", str(tiny_model_dir), "-o", str(out)]) == 0  # fmt: skip
    rows = _rows(out)
    prompts = TokenExactPrompts.from_model_dir(tiny_model_dir)
    assert (
        rows[0]["text_input"] == chat_payload(records[0], 0, prompts=prompts).messages[0]["content"]
    )
    # an image's tokens become text for a text-only peer: it prefills as many tokens
    assert prompts.count(str(rows[1]["text_input"])) == 40 + 16
    assert [r["timestamp"] for r in rows] == [0, 500]


def test_texts_need_mooncake_and_a_real_tokenizer(tmp_path: Path) -> None:
    sample = str(DATA / "mooncake_sample.jsonl")
    out = str(tmp_path / "x.jsonl")
    assert main(["trace", "convert", sample, "--tokenizer", str(tmp_path), "-o", out]) == 2
    assert main(["trace", "convert", sample, "--to", "mooncake", "--tokenizer",
                 str(tmp_path / "missing"), "-o", out]) == 2  # fmt: skip
    assert main(["trace", "convert", sample, "--to", "mooncake", "-o", out]) == 0
    assert read_mooncake(out)  # without a tokenizer: lengths, as before
