"""The live trace: one TraceRecord per finished request, in a bounded, rotating JSONL file.

Arrival times are seconds since the router started; ``since`` queries read the files back.
"""

from __future__ import annotations

import threading
from pathlib import Path

from epd_engine.contracts.trace import TraceRecord, dump_record, parse_trace


class TraceRecorder:
    def __init__(self, directory: Path | None, max_bytes: int, max_files: int) -> None:
        self.directory = directory
        self.max_bytes = max_bytes
        self.max_files = max_files
        self._memory: list[TraceRecord] = []  # used when no directory is configured
        self._lock = threading.Lock()
        if directory is not None:
            directory.mkdir(parents=True, exist_ok=True)

    @property
    def current(self) -> Path:
        assert self.directory is not None
        return self.directory / "trace.jsonl"

    def files_oldest_first(self) -> list[Path]:
        if self.directory is None:
            return []
        rotated = [self.directory / f"trace.jsonl.{i}" for i in range(self.max_files - 1, 0, -1)]
        return [p for p in [*rotated, self.current] if p.exists()]

    def record(self, record: TraceRecord) -> None:
        with self._lock:
            if self.directory is None:
                self._memory.append(record)
                del self._memory[:-100_000]
                return
            line = dump_record(record) + "\n"
            if self.current.exists() and self.current.stat().st_size + len(line) > self.max_bytes:
                self._rotate()
            with self.current.open("a") as out:
                out.write(line)

    def _rotate(self) -> None:
        assert self.directory is not None
        for i in range(self.max_files - 1, 0, -1):
            src = self.directory / ("trace.jsonl" if i == 1 else f"trace.jsonl.{i - 1}")
            if src.exists():
                src.replace(self.directory / f"trace.jsonl.{i}")  # the oldest is overwritten

    def since(self, since_s: float) -> list[TraceRecord]:
        with self._lock:
            if self.directory is None:
                return [r for r in self._memory if r.arrival_s >= since_s]
            records: list[TraceRecord] = []
            for path in self.files_oldest_first():
                records += parse_trace(path.read_text().splitlines(), str(path))
        return [r for r in records if r.arrival_s >= since_s]
