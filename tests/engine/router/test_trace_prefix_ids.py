"""The router's live trace names each request's prefix (``hash_ids``, from the entry
instance's tokens and images; ``cache/trace_blocks.py``), so replaying it in the simulator
models prefix-cache hits on live traffic (issue 33): a real router and a real EPD instance of
the tiny model, one multi-turn conversation with images; the simulator finds the hits the
engine found."""

from __future__ import annotations

from collections.abc import Iterator
from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import pytest

from epd_engine.config import SLO, Method, Role, internal_token
from epd_engine.contracts.plan import Plan
from epd_engine.contracts.trace import TraceRecord, parse_trace
from epd_engine.profiler.simulator import simulate
from tests.engine.profiler.factories import toy_cost_model
from tests.engine.server.images import image_message
from tests.processes import free_port, running

pytestmark = pytest.mark.slow  # two processes: a router and an instance (about 10 s)
TRACE_BLOCK, PAGE = 64, 16  # tokens per hash id; per KV page (the engine's default)
SYSTEM = "You are a careful assistant who describes pictures in plain words, briefly and well."
ASK = " Answer in full sentences, name every object you can see, where it sits in the frame,"
ASK += " its colour and its size, and say what you are least sure of and why that is so."
TURNS = [f"What is in it?{ASK}", f"Say more about the colours.{ASK}", f"And this one?{ASK}"]


@pytest.fixture(scope="module")
def router_url(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    logs = tmp_path_factory.mktemp("trace-prefix")
    router_port, instance_port = free_port(), free_port()
    url = f"http://127.0.0.1:{router_port}"
    router = ["router", "--model", "tiny-llava", "--port", str(router_port)]
    instance = [
        "serve", "--model", str(tiny_model_dir), "--served-model-name", "tiny-llava",
        "--port", str(instance_port), "--router-url", url, "--token-budget", "256",
        "--image-budget", "4", "--num-kv-blocks", "128", "--num-image-blocks", "8",
        "--max-model-len", "512",
    ]  # fmt: skip
    with (
        running(router, f"{url}/health/live", logs / "router.log"),
        running(instance, f"http://127.0.0.1:{instance_port}/health/ready", logs / "serve.log"),
    ):
        yield url


def _converse(url: str) -> list[TraceRecord]:
    """One conversation, turn by turn (turns 1 and 3 bring an image each); its trace rows."""
    history: list[Any] = [{"role": "system", "content": SYSTEM}]
    for turn, text in enumerate(TURNS):
        with_image = turn != 1
        history.append(image_message(text, 7 + turn) if with_image else _user(text))
        body = {"model": "tiny-llava", "messages": history, "max_tokens": 6, "ignore_eos": True}
        answer = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert answer.status_code == 200, answer.text
        reply = answer.json()["choices"][0]["message"]["content"]
        history.append({"role": "assistant", "content": reply})
    trace = httpx.get(f"{url}/v1/trace", headers={"X-EPD-Token": internal_token()}, timeout=10)
    return sorted(parse_trace(trace.text.splitlines()), key=lambda r: r.arrival_s)


def _user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


def test_later_turns_lead_with_the_earlier_turns_ids_and_replay_finds_hits(
    router_url: str,
) -> None:
    records = _converse(router_url)
    assert len(records) == len(TURNS)
    ids = [record.hash_ids or () for record in records]
    assert all(record.hash_block_tokens == TRACE_BLOCK for record in records)
    assert len(ids[0]) >= 1 and len(ids[0]) < len(ids[1]) < len(ids[2])
    for earlier, later in pairwise(ids):
        assert later[: len(earlier)] == earlier  # the conversation so far is its prefix
    # the images sit where the server put them: after the system prompt, the second later
    first, second = records[2].images
    assert first.offset is not None and second.offset is not None
    assert 0 < first.offset < second.offset

    plan = Plan(method=Method.EPD, pools={Role.EPD: 1})
    cost, slo = toy_cost_model(), SLO(ttft_s=60.0, tpot_s=10.0)
    modelled = simulate(plan, records, cost, slo)
    rate = modelled.prefix_hit_rate(Role.EPD.value)
    assert rate is not None and rate > 0
    # turns 2 and 3 find the turn before, its answer's pages too (sim_turns.py): what the
    # engine found (176 + 304 tokens here), or up to a page more each where a resent answer
    # tokenizes unlike the generated one
    engine_hits = sum(record.cached_tokens or 0 for record in records)
    sim_hits = modelled.prefix_hit_tokens[Role.EPD.value]
    assert engine_hits <= sim_hits <= engine_hits + 2 * PAGE
    assert sim_hits > TRACE_BLOCK * (len(ids[0]) + len(ids[1]))  # more than the blocks
    nameless = [r.model_copy(update={"hash_ids": None, "cached_tokens": None}) for r in records]
    assert simulate(plan, nameless, cost, slo).prefix_hit_tokens == {}
