"""What peer tools read off a response, through the router of a disaggregated system (E+P+D:
the first token is sampled on P, the rest on D) with the real ``openai`` client, against one
standalone EPD instance: ``logprobs``/``top_logprobs``, ``usage.prompt_tokens_details.
cached_tokens`` and multi-turn conversations."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import openai
import pytest

from epd_engine.config import Method
from tests.engine.disagg.systems import local_system, plan_for
from tests.engine.server.images import data_url, image_message
from tests.processes import free_port, running

pytestmark = pytest.mark.slow
IMAGE_TOKENS = 16  # the tiny checkpoint's image_seq_length


@dataclass
class Servers:
    router: openai.OpenAI  # E+P+D behind its router
    instance: openai.OpenAI  # one EPD instance, no router


def _client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="k", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def servers(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    port = free_port()
    run_dir = tmp_path_factory.mktemp("surface")
    args = [
        "serve", "--model", str(tiny_model_dir), "--served-model-name", "tiny-llava",
        "--port", str(port), "--token-budget", "256", "--image-budget", "4",
        "--num-kv-blocks", "256", "--num-image-blocks", "16",
    ]  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    plan = plan_for(Method.E_P_D, {})
    with (
        running(args, f"{url}/health/ready", run_dir / "serve.log"),
        local_system(tiny_model_dir, run_dir, plan) as system,
    ):
        yield Servers(_client(system.spec.router_url), _client(url))


def _greedy(messages: list[Any], **kwargs: Any) -> dict[str, Any]:
    return dict(model="tiny-llava", messages=messages, max_tokens=5, temperature=0,
                extra_body={"ignore_eos": True}, **kwargs)  # fmt: skip


def _entries(content: list[Any]) -> list[tuple[str, float, list[tuple[str, float]]]]:
    return [
        (e.token, round(e.logprob, 3), [(t.token, round(t.logprob, 3)) for t in e.top_logprobs])
        for e in content
    ]


def test_logprobs_through_the_router_match_a_single_instance(servers: Servers) -> None:
    """The defect: the router dropped them (``logprobs: null``) for every method."""
    kwargs = _greedy([image_message("Describe the picture.", 41)], logprobs=True, top_logprobs=2)
    expected = servers.instance.chat.completions.create(**kwargs).choices[0].logprobs
    assert expected is not None and expected.content is not None
    full = servers.router.chat.completions.create(**kwargs).choices[0]
    assert full.logprobs is not None and full.logprobs.content is not None
    assert _entries(full.logprobs.content) == _entries(expected.content)
    assert all(e.bytes == list(e.token.encode()) for e in full.logprobs.content)

    streamed: list[Any] = []
    for chunk in servers.router.chat.completions.create(stream=True, **kwargs):
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            streamed += chunk.choices[0].logprobs.content
    assert _entries(streamed) == _entries(expected.content)

    plain = servers.router.chat.completions.create(**_greedy([image_message("Hi.", 41)]))
    assert plain.choices[0].logprobs is None  # none unless asked


def _cached(usage: Any) -> int:
    assert usage is not None and usage.prompt_tokens_details is not None
    return int(usage.prompt_tokens_details.cached_tokens)


def _after(text: str, *seeds: int) -> list[dict[str, Any]]:
    """Images after a text of their own (a system message: the template puts a user turn's
    images before its text): prompts that differ in it share no KV page, so only the encoder
    cache can serve them."""
    return [{"role": "system", "content": text}, image_message("Describe it.", *seeds)]


@pytest.mark.parametrize("where", ["router", "instance"])
def test_cached_tokens_count_images_found_in_the_encoder_cache(
    servers: Servers, where: str
) -> None:
    """A repeated image's embeddings come from the encoder cache: its tokens are cached
    prompt tokens; a new image's and the text's are not."""
    client: openai.OpenAI = getattr(servers, where)
    seed = 100 if where == "router" else 200  # a picture neither server has seen
    first = client.chat.completions.create(**_greedy(_after("What is it?", seed)))
    assert _cached(first.usage) == 0
    again = client.chat.completions.create(**_greedy(_after("And now?", seed)))
    assert _cached(again.usage) == IMAGE_TOKENS
    two = client.chat.completions.create(**_greedy(_after("Both?", seed, seed + 1)))
    assert _cached(two.usage) == IMAGE_TOKENS  # one of the two was seen before
    text = client.chat.completions.create(**_greedy([{"role": "user", "content": "Hello."}]))
    assert _cached(text.usage) == 0

    stream = client.chat.completions.create(
        stream=True,
        stream_options={"include_usage": True},
        **_greedy(_after("Once more.", seed)),
    )
    usage = [chunk.usage for chunk in stream if chunk.usage is not None]
    assert len(usage) == 1 and _cached(usage[0]) == IMAGE_TOKENS
    assert usage[0].prompt_tokens > IMAGE_TOKENS


@pytest.mark.parametrize("where", ["router", "instance"])
def test_cached_tokens_count_the_previous_turn_found_in_the_prefix_cache(
    servers: Servers, where: str
) -> None:
    """A conversation's second turn resends the first: the KV pages of the first turn's
    prompt are found again (all but its last, partial pages) and counted as cached."""
    client: openai.OpenAI = getattr(servers, where)
    seed = 400 if where == "router" else 500
    turn1: list[Any] = [
        {"role": "system", "content": "You answer briefly and precisely, in one sentence."},
        image_message("What is in the picture?", seed),
    ]
    first = client.chat.completions.create(**_greedy(turn1))
    assert first.usage is not None and _cached(first.usage) == 0
    answer = first.choices[0].message.content or ""
    turn2 = [*turn1, {"role": "assistant", "content": answer}, {"role": "user", "content": "Why?"}]
    second = client.chat.completions.create(**_greedy(turn2))
    assert second.usage is not None
    page = 16  # the KV page size (the default)
    assert first.usage.prompt_tokens - 2 * page <= _cached(second.usage)
    assert _cached(second.usage) < second.usage.prompt_tokens


def test_multi_turn_conversation_matches_a_single_instance(servers: Servers) -> None:
    """A conversation (system prompt, an image in the first turn, the assistant's answer, a
    follow-up) is one prompt with every turn in it, served alike by both."""
    conversation: list[Any] = [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": data_url(300)}},
            {"type": "text", "text": "What is in the picture?"},
        ]},
        {"role": "assistant", "content": "Coloured noise."},
        {"role": "user", "content": "Which colour is most common?"},
    ]  # fmt: skip
    last_turn = [{"role": "user", "content": "Which colour is most common?"}]
    expected = servers.instance.chat.completions.create(**_greedy(conversation))
    served = servers.router.chat.completions.create(**_greedy(conversation))
    assert served.choices[0].message.content == expected.choices[0].message.content
    assert served.usage is not None and expected.usage is not None
    assert served.usage.prompt_tokens == expected.usage.prompt_tokens
    alone = servers.router.chat.completions.create(**_greedy(last_turn))
    assert alone.usage is not None
    assert served.usage.prompt_tokens > alone.usage.prompt_tokens + IMAGE_TOKENS


def _completion_logprobs(client: openai.OpenAI, stream: bool) -> tuple[list[Any], ...]:
    kwargs: dict[str, Any] = dict(
        model="tiny-llava", prompt="Once upon a time", max_tokens=5, temperature=0, logprobs=2
    )
    kwargs["extra_body"] = {"ignore_eos": True}
    if not stream:
        lp = client.completions.create(**kwargs).choices[0].logprobs
        assert lp is not None
        return lp.tokens or [], lp.token_logprobs or [], lp.top_logprobs or [], lp.text_offset or []
    parts: tuple[list[Any], ...] = ([], [], [], [])
    for chunk in client.completions.create(stream=True, **kwargs):
        lp = chunk.choices[0].logprobs if chunk.choices else None
        if lp is not None:
            for part, values in zip(parts, (lp.tokens, lp.token_logprobs, lp.top_logprobs,
                                            lp.text_offset), strict=True):  # fmt: skip
                part += values or []
    return parts


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "stream"])
def test_completions_logprobs_through_the_router_match_a_single_instance(
    servers: Servers, stream: bool
) -> None:
    """``/v1/completions`` with ``logprobs: 2`` (refused with a 400 before): per token its text,
    logprob, the top two alternatives plus the sampled one, and its offset in the text."""
    tokens, logprobs, tops, offsets = _completion_logprobs(servers.router, stream)
    expected = _completion_logprobs(servers.instance, False)
    assert tokens == expected[0] and len(tokens) == 5
    assert [round(v, 3) for v in logprobs] == [round(v, 3) for v in expected[1]]
    for token, value, top in zip(tokens, logprobs, tops, strict=True):
        # two alternatives and the sampled token (tokens of equal text share an entry)
        assert 1 <= len(top) <= 3 and top[token] == pytest.approx(value, abs=1e-5)
        assert max(top.values()) == pytest.approx(value, abs=1e-5)  # greedy: the likeliest
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    plain = servers.router.completions.create(model="tiny-llava", prompt="Hi", max_tokens=2)
    assert plain.choices[0].logprobs is None
