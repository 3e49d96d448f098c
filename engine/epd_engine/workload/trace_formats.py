"""Peer trace formats in and out of the DESIGN.md §4 trace.

Read: Mooncake-style JSONL (what AIPerf replays: ``timestamp`` in ms, ``input_length``,
``output_length``, ``hash_ids``: shared-prefix blocks), BurstGPT CSV (``Timestamp`` s,
``Request tokens``, ``Response tokens``) and Azure's LLM inference trace CSV (``TIMESTAMP``
date-time, ``ContextTokens``, ``GeneratedTokens``). All three are text-only; arrivals are
rebased so the first request arrives at 0. Write: Mooncake-style JSONL, with ``input_length``
the whole prefill (text plus image tokens), so a text-only peer sends as many tokens, or
with the prompt text itself (``text_input``), built token-exact with a model's tokenizer.
"""

from __future__ import annotations

import csv
import datetime as dt
import json
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from epd_engine.contracts.trace import TraceFormatError, TraceRecord, read_trace

if TYPE_CHECKING:  # the module stays free of transformers until prompts are asked for
    from epd_engine.bench.token_prompts import TokenExactPrompts

FORMATS = ("auto", "epd", "mooncake", "burstgpt", "azure")


def _rebased(records: list[TraceRecord]) -> list[TraceRecord]:
    start = min((r.arrival_s for r in records), default=0.0)
    return [r.model_copy(update={"arrival_s": r.arrival_s - start}) for r in records]


def _int(value: object, where: str, name: str, minimum: int = 0) -> int:
    try:
        number = int(float(str(value)))
    except ValueError:
        raise TraceFormatError(f"{where}: {name} is not a number: {value!r}") from None
    if number < minimum:
        raise TraceFormatError(f"{where}: {name} must be >= {minimum}, got {number}")
    return number


def read_mooncake(path: str | Path) -> list[TraceRecord]:
    """Mooncake / AIPerf ``mooncake_trace`` JSONL; ``timestamp`` (ms) may be absent (all 0)."""
    records = []
    with Path(path).open(encoding="utf-8") as lines:
        for line_no, raw in enumerate(lines, start=1):
            if not raw.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                row = json.loads(raw)
            except json.JSONDecodeError as exc:
                raise TraceFormatError(f"{where}: not valid JSON ({exc.msg})") from exc
            if isinstance(row, dict) and "text_input" in row and "input_length" not in row:
                raise TraceFormatError(
                    f"{where}: a prompt text (text_input) without input_length: replay the "
                    "trace it was converted from, or send it with AIPerf"
                )
            if not isinstance(row, dict) or "input_length" not in row:
                raise TraceFormatError(f"{where}: expected an object with input_length")
            hash_ids = row.get("hash_ids")
            if hash_ids is not None and not (
                isinstance(hash_ids, list) and all(isinstance(h, int) for h in hash_ids)
            ):
                raise TraceFormatError(f"{where}: hash_ids must be a list of integers")
            records.append(
                TraceRecord(
                    request_id=f"mooncake-{line_no:06d}",
                    arrival_s=_int(row.get("timestamp", 0), where, "timestamp") / 1000,
                    prompt_tokens=_int(row["input_length"], where, "input_length"),
                    output_tokens=_int(row.get("output_length", 1), where, "output_length", 1),
                    hash_ids=tuple(hash_ids) if hash_ids is not None else None,
                    session_id=str(row["session_id"]) if "session_id" in row else None,
                )
            )
    return _rebased(records)


def _read_csv(
    path: str | Path,
    columns: tuple[str, str, str],
    parse_time: Callable[[str], float],
    prefix: str,
) -> list[TraceRecord]:
    """Rows with (time, prompt tokens, output tokens) columns; rows with no output (failed
    requests in BurstGPT) are skipped, as they generated nothing to replay."""
    time_col, prompt_col, output_col = columns
    records = []
    with Path(path).open(encoding="utf-8", newline="") as handle:
        reader = csv.DictReader(handle)
        missing = [c for c in columns if c not in (reader.fieldnames or [])]
        if missing:
            raise TraceFormatError(f"{path}: missing columns {missing}")
        for row_no, row in enumerate(reader, start=2):
            where = f"{path}:{row_no}"
            output = _int(row[output_col], where, output_col)
            if output == 0:
                continue
            try:
                arrival_s = parse_time(row[time_col])
            except ValueError as exc:
                raise TraceFormatError(f"{where}: bad {time_col} {row[time_col]!r}") from exc
            records.append(
                TraceRecord(
                    request_id=f"{prefix}-{row_no:06d}",
                    arrival_s=arrival_s,
                    prompt_tokens=_int(row[prompt_col], where, prompt_col),
                    output_tokens=output,
                )
            )
    return _rebased(sorted(records, key=lambda r: r.arrival_s))


def read_burstgpt(path: str | Path) -> list[TraceRecord]:
    return _read_csv(path, ("Timestamp", "Request tokens", "Response tokens"), float, "burstgpt")


def _azure_time(text: str) -> float:
    """``2023-11-16 18:15:46.6805900``: 7 fractional digits, more than ``datetime`` takes."""
    whole, _, fraction = text.strip().partition(".")
    moment = dt.datetime.fromisoformat(whole)
    return moment.timestamp() + (float(f"0.{fraction}") if fraction else 0.0)


def read_azure(path: str | Path) -> list[TraceRecord]:
    return _read_csv(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens"), _azure_time, "azure")


def detect_format(path: str | Path) -> str:
    """The format of a trace file, from its first line."""
    with Path(path).open(encoding="utf-8") as handle:
        first = next((line for line in handle if line.strip() and not line.startswith("#")), "")
    if "Request tokens" in first and "Timestamp" in first:
        return "burstgpt"
    if "ContextTokens" in first and "TIMESTAMP" in first:
        return "azure"
    try:
        row = json.loads(first)
    except json.JSONDecodeError:
        raise TraceFormatError(f"{path}: neither a JSONL trace nor a known CSV header") from None
    return "mooncake" if isinstance(row, dict) and "input_length" in row else "epd"


READERS: dict[str, Callable[[str | Path], list[TraceRecord]]] = {
    "epd": read_trace,
    "mooncake": read_mooncake,
    "burstgpt": read_burstgpt,
    "azure": read_azure,
}


def read_any(path: str | Path, fmt: str = "auto") -> list[TraceRecord]:
    """Read a trace in ``fmt`` (``auto``: detected from the file)."""
    if fmt not in FORMATS:
        raise TraceFormatError(f"unknown trace format {fmt!r}; known: {', '.join(FORMATS)}")
    try:
        chosen = detect_format(path) if fmt == "auto" else fmt
    except OSError as exc:
        raise TraceFormatError(f"{path}: cannot read trace ({exc.strerror or exc})") from exc
    return READERS[chosen](path)


def mooncake_lines(
    records: Sequence[TraceRecord],
    prompts: TokenExactPrompts | None = None,
    block_tokens: int = 512,
) -> Iterable[str]:
    """One Mooncake row per record. With ``prompts`` a row carries the prompt itself
    (``text_input``, which AIPerf sends as it is) instead of ``input_length``: a text of
    the record's whole prefill length as ``prompts`` counts it, the ``hash_ids`` blocks as
    its shared prefix, the same text ``epdctl bench`` sends for a text-only record."""
    start = min((r.arrival_s for r in records), default=0.0)
    order = sorted(range(len(records)), key=lambda i: records[i].arrival_s)
    for index in order:
        record = records[index]
        row: dict[str, object] = {"timestamp": round((record.arrival_s - start) * 1000)}
        if prompts is None:
            row["input_length"] = record.total_prompt_tokens
            if record.hash_ids is not None:
                row["hash_ids"] = list(record.hash_ids)
        else:
            seed = record.request_id or str(index)
            blocks = record.hash_ids or ()
            block = record.hash_block_tokens or block_tokens  # a live trace says its own
            row["text_input"] = prompts.text(record.total_prompt_tokens, seed, 0, blocks, block)
        row["output_length"] = record.output_tokens
        if record.session_id is not None:
            row["session_id"] = record.session_id
        yield json.dumps(row) + "\n"


def write_mooncake(
    records: Sequence[TraceRecord],
    path: str | Path,
    prompts: TokenExactPrompts | None = None,
    block_tokens: int = 512,
) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(mooncake_lines(records, prompts, block_tokens)), encoding="utf-8")
    return path
