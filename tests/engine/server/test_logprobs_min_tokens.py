"""``logprobs`` / ``top_logprobs`` and ``min_tokens`` through a live server and the real
``openai`` client, non-streaming and streaming."""

from __future__ import annotations

import math

import openai
import pytest

pytestmark = pytest.mark.slow

MODEL = "tiny-llava"
MESSAGES = [{"role": "user", "content": "Describe the picture."}]


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def greedy(**kwargs):
    return dict(
        model=MODEL,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
        **kwargs,
    )


def test_logprobs_with_top_alternatives_non_streaming_and_streaming(instance_url: str) -> None:
    c = client(instance_url)
    full = c.chat.completions.create(**greedy(logprobs=True, top_logprobs=3))
    logprobs = full.choices[0].logprobs
    assert logprobs is not None and logprobs.content is not None
    assert len(logprobs.content) == 6  # one entry per generated token
    for entry in logprobs.content:
        assert entry.logprob <= 0.0
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        # greedy: the chosen token is the most likely one
        assert entry.top_logprobs[0].token == entry.token
        assert math.isclose(entry.top_logprobs[0].logprob, entry.logprob, abs_tol=1e-5)
        assert entry.bytes == list(entry.token.encode())

    streamed = []
    for chunk in c.chat.completions.create(stream=True, **greedy(logprobs=True, top_logprobs=3)):
        if chunk.choices and chunk.choices[0].logprobs and chunk.choices[0].logprobs.content:
            streamed += chunk.choices[0].logprobs.content
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [
        (e.token, round(e.logprob, 4)) for e in logprobs.content
    ]


def test_no_logprobs_unless_asked(instance_url: str) -> None:
    response = client(instance_url).chat.completions.create(**greedy())
    assert response.choices[0].logprobs is None


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"top_logprobs": 2}, "top_logprobs"),  # needs logprobs: true
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"min_tokens": 7}, "min_tokens"),  # more than max_tokens
    ],
)
def test_bad_logprob_and_min_tokens_settings_are_a_400_naming_them(
    instance_url: str, extra: dict, needle: str
) -> None:
    with pytest.raises(openai.BadRequestError, match=needle):
        client(instance_url).chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=6, extra_body=extra
        )


def test_min_tokens_keeps_a_stop_string_from_ending_the_output_early(instance_url: str) -> None:
    c = client(instance_url)
    request = dict(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    text = c.chat.completions.create(**request, extra_body={"ignore_eos": True})
    content = text.choices[0].message.content
    assert content and len(content) > 2
    stop = content[1:3]  # occurs within the first few tokens
    early = c.chat.completions.create(**request, stop=[stop], extra_body={"ignore_eos": True})
    assert early.choices[0].finish_reason == "stop"
    late = c.chat.completions.create(
        **request, stop=[stop], extra_body={"ignore_eos": True, "min_tokens": 8}
    )
    assert late.usage is not None and late.usage.completion_tokens == 8
    assert late.choices[0].finish_reason == "length"
