"""A benchmark of an emulated instance says so: ``epdctl bench`` (the real driver, the real
``openai``-shaped HTTP) against ``serve --emulate`` marks its summary and prints the note that
the figures are the cost model's, not the engine's."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from epd_engine.emulate import EMULATED_NOTE
from tests.processes import EPDCTL, free_port, running

REPO = Path(__file__).resolve().parents[3]
COST_MODEL = REPO / "benchmarks" / "results" / "cost-model-h200.json"


def test_a_bench_of_an_emulated_instance_is_marked_emulated(tmp_path: Path) -> None:
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    serve = ["serve", "--emulate", str(COST_MODEL), "--port", str(port), "--log-level", "warning"]
    out = tmp_path / "bench.json"
    with running(serve, f"{base}/health/ready", tmp_path / "serve.log"):
        bench = [*EPDCTL, "bench", "--endpoint", f"{base}/v1", "--workload", "textcaps"]
        bench += ["--num", "8", "--rate", "20", "--out", str(out)]
        done = subprocess.run(bench, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"NOTE: {EMULATED_NOTE}" in done.stdout
    summary = json.loads(out.read_text())
    assert summary["model"] == "llava-1.5-7b-emulated"
    assert summary["emulated"] is True and summary["emulated_note"] == EMULATED_NOTE
    assert summary["summary"]["num_ok"] == 8
