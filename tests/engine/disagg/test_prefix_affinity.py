"""Multi-turn conversations through EP+D with two instances in each pool: the router sends
each conversation's turns to the EP instance holding its prefix, which computes only the
rest; that instance hands each turn to the D instance holding the earlier turns, which pulls
only the pages it lacks. Every answer equals one EPD instance's with the prefix cache off."""

from __future__ import annotations

from itertools import pairwise
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from epd_engine.config import Method, internal_token
from tests.engine.disagg.systems import local_system, plan_for
from tests.engine.server.images import image_message
from tests.processes import free_port, running

pytestmark = pytest.mark.slow
PAGE = 16  # the default KV page
SYSTEM = "You are a helpful assistant. Answer in one short sentence, and be precise."


def _openings() -> list[list[Any]]:
    """Six conversations: two with an image, four text (all share the system prompt)."""
    texts = [f"Tell me about topic number {k}, please." for k in range(4)]
    return [
        [{"role": "system", "content": SYSTEM}, image_message("What is in it?", 700 + k)]
        for k in range(2)
    ] + [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": t}] for t in texts]


def _converse(client: openai.OpenAI, turns: int = 3) -> list[list[tuple[str, int, int]]]:
    """Each conversation turn by turn: (answer, prompt tokens, cached tokens) per turn."""
    out = []
    for messages in _openings():
        history: list[Any] = list(messages)
        answers = []
        for turn in range(turns):
            reply = client.chat.completions.create(
                model="tiny-llava", messages=history, max_tokens=6, temperature=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            usage = reply.usage
            assert usage is not None and usage.prompt_tokens_details is not None
            text = reply.choices[0].message.content or ""
            cached = usage.prompt_tokens_details.cached_tokens or 0
            answers.append((text, usage.prompt_tokens, cached))
            history += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": f"Go on with part {turn + 2}."},
            ]
        out.append(answers)
    return out


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, timeout=120)


def _metric(router_url: str, name: str, role: str) -> tuple[dict[str, float], dict[str, float]]:
    """``name`` over the instances of ``role``: per instance, and per value of its labels."""
    headers = {"X-EPD-Token": internal_token()}
    pools = httpx.get(f"{router_url}/internal/pools", headers=headers).json()["pools"]
    by_instance: dict[str, float] = {}
    by_label: dict[str, float] = {}
    for pool in pools.values():
        for instance in pool["instances"]:
            if instance["role"] != role:
                continue
            text = httpx.get(f"{instance['url']}/metrics").text
            for family in text_string_to_metric_families(text):
                for sample in family.samples:
                    if sample.name != name:
                        continue
                    key = instance["instance_id"]
                    by_instance[key] = by_instance.get(key, 0.0) + sample.value
                    for value in sample.labels.values():
                        by_label[value] = by_label.get(value, 0.0) + sample.value
    return by_instance, by_label


def test_conversations_follow_their_cache_through_ep_d(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    args = [
        "serve", "--model", str(tiny_model_dir), "--served-model-name", "tiny-llava",
        "--port", str(port), "--token-budget", "256", "--image-budget", "4",
        "--num-kv-blocks", "256", "--num-image-blocks", "16", "--no-prefix-cache",
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    with running(args, f"{url}/health/ready", tmp_path / "reference.log"):
        expected = _converse(_client(url))

    plan = plan_for(Method.EP_D, {"EP": 2, "D": 2})
    with local_system(tiny_model_dir, tmp_path, plan) as system:
        router = system.spec.router_url
        served = _converse(_client(router))
        ep_queried, _ = _metric(router, "epd_prefix_cache_queried_tokens_total", "EP")
        _, d_pages = _metric(router, "epd_migration_kv_pages_total", "D")
        routing = httpx.get(f"{router}/metrics").text

    assert [[a for a, _, _ in conv] for conv in served] == [
        [a for a, _, _ in conv] for conv in expected
    ]
    for conv in served:
        for (_, before, _), (_, _, cached) in pairwise(conv):
            # the router sent the turn where the previous one's pages are
            assert cached >= before - 2 * PAGE, conv
    assert len([v for v in ep_queried.values() if v > 0]) == 2  # conversations spread over both
    assert d_pages.get("cache", 0) > 0  # later turns' D found earlier pages: not pulled
    assert d_pages["pulled"] > 0
    assert 'outcome="followed"' in routing
