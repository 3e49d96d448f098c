"""The load driver against our real engine (``epdctl serve``, tiny random-weight model, CPU)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from epd_engine.bench.driver import DriverConfig, replay
from epd_engine.workload.arrivals import ArrivalSpec
from epd_engine.workload.generators import synthesize
from tests.processes import free_port, running

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("bench-serve") / "serve.log"
    args = ["serve", "--model", str(tiny_model_dir), "--served-model-name", "tiny-llava",
            "--port", str(port), "--token-budget", "256", "--image-budget", "4"]  # fmt: skip
    with running(args, f"http://127.0.0.1:{port}/health/ready", log):
        yield f"http://127.0.0.1:{port}/v1"


def test_mixed_trace_replays_with_fixed_output_lengths(engine_url: str) -> None:
    trace = synthesize("textcaps", 8, ArrivalSpec("poisson", 4.0), text_only_fraction=0.5)
    assert any(r.text_only for r in trace) and any(not r.text_only for r in trace)
    results = replay(trace, DriverConfig(endpoint=engine_url, model="tiny-llava", progress=False))
    by_id = {r.request_id: r for r in results}
    for record in trace:
        result = by_id[record.request_id or ""]
        assert result.ok, result.error
        assert result.num_output_tokens == record.output_tokens  # ignore_eos + max_tokens held
        assert result.ttft_s is not None and 0 < result.ttft_s < (result.e2e_s or 0)
        assert result.itl_s  # streamed token by token
        # The server counts template + text (+ image tokens): at least the text we sent.
        assert (result.server_prompt_tokens or 0) >= record.prompt_tokens
