"""A tensor-parallel rank that dies or hangs takes its instance down cleanly (issue 34):
with a real two-rank instance of the tiny model serving streams from the real ``openai``
client, a rank killed (SIGKILL) or hung (SIGSTOP: a CPU cannot hang as a GPU does) mid-load
ends every stream -- completed, or with an error that says why -- never a hang; the instance
exits with its "restart me" code, leaving no rank behind, and started again it serves."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import openai
import pytest

from epd_engine.server.app import RANKS_LOST_EXIT
from tests.processes import free_port, rank_pids, running

pytestmark = pytest.mark.slow
STREAMS = 6
MAX_TOKENS = 300
RANK_TIMEOUT_S = 3


def serve_args(model_dir: Path, port: int) -> list[str]:
    return [
        "serve", "--model", str(model_dir), "--served-model-name", "tiny-llava",
        "--port", str(port), "--token-budget", "256", "--image-budget", "2",
        "--num-kv-blocks", "256", "--num-image-blocks", "8",
        "--tensor-parallel-size", "2", "--rank-timeout-s", str(RANK_TIMEOUT_S),
    ]  # fmt: skip


def alive(pid: int) -> bool:
    """Running or stopped: not gone, not a zombie and not exiting (its memory released,
    which a SIGKILLed process of this size can take seconds to finish on a busy host)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return False
    state, vsize = fields[0], int(fields[20])
    return state not in ("Z", "X") and vsize > 0


async def stream_one(client: openai.AsyncOpenAI, index: int, first: asyncio.Event) -> str:
    """'done' or the error the client raised; sets ``first`` at the first token."""
    try:
        stream = await client.chat.completions.create(  # type: ignore[call-overload]
            model="tiny-llava",
            messages=[{"role": "user", "content": f"Tell me story number {index}."}],
            max_tokens=MAX_TOKENS, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        async for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                first.set()
        return "done"
    except (openai.APIError, openai.APIConnectionError) as exc:
        return f"error: {exc}"


async def load_then(url: str, fault: object) -> list[str]:
    first = asyncio.Event()
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=60)
    streams = [asyncio.create_task(stream_one(client, i, first)) for i in range(STREAMS)]
    await asyncio.wait_for(first.wait(), 60)
    fault()  # type: ignore[operator]
    return await asyncio.wait_for(asyncio.gather(*streams), 60)  # a hang fails here


@pytest.mark.parametrize("fault", ["killed", "hung"])
def test_a_lost_rank_ends_every_stream_and_the_instance_restarts(tiny_model_dir, tmp_path, fault):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    args = serve_args(tiny_model_dir, port)
    with running(args, f"{url}/health/ready", tmp_path / "first.log") as leader:
        (rank1,) = rank_pids(leader.pid)
        sig = signal.SIGKILL if fault == "killed" else signal.SIGSTOP
        started = time.monotonic()
        outcomes = asyncio.run(load_then(url, lambda: os.kill(rank1, sig)))
        ended_s = time.monotonic() - started
        errors = [o for o in outcomes if o != "done"]
        assert errors, "the rank was lost mid-load: some stream must have failed"
        assert all("out of service" in e or "Connection" in e for e in errors), errors
        if fault == "hung":  # noticed at the collective's timeout, not the stall's (120 s)
            assert ended_s < RANK_TIMEOUT_S + 10
        leader.wait(30)
        assert leader.returncode == RANKS_LOST_EXIT
        assert not alive(rank1), "the lost rank outlived its instance"
    log = (tmp_path / "first.log").read_text()
    assert "tensor" in log and "exiting to be restarted" in log
    with running(args, f"{url}/health/ready", tmp_path / "again.log"):  # what a supervisor does
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        answer = client.chat.completions.create(
            model="tiny-llava", messages=[{"role": "user", "content": "Hi"}], max_tokens=5
        )
        assert answer.choices[0].message.content
