"""A small mixed workload: text-only, images, a shared image, streaming and not, concurrent."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import openai

from tests.engine.server.images import image_message


@dataclass(frozen=True)
class Case:
    name: str
    messages: list[dict[str, object]]
    stream: bool
    max_tokens: int = 10


CASES = [
    Case("text", [{"role": "user", "content": "Tell me about cats."}], stream=False),
    Case("text-stream", [{"role": "user", "content": "Write a poem."}], stream=True),
    Case("image", [image_message("What is in the image?", 1)], stream=False),
    Case("shared-image", [image_message("Describe the colours.", 1)], stream=True),
    Case("two-images", [image_message("Compare them.", 2, 3)], stream=False, max_tokens=12),
    Case("image-stream", [image_message("Caption this.", 4)], stream=True),
]


async def run_case(client: openai.AsyncOpenAI, case: Case) -> str:
    kwargs = dict(
        model="tiny-llava",
        messages=case.messages,
        max_tokens=case.max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    if not case.stream:
        response = await client.chat.completions.create(**kwargs)  # type: ignore[call-overload]
        assert response.usage.completion_tokens == case.max_tokens
        return str(response.choices[0].message.content)
    stream = await client.chat.completions.create(stream=True, **kwargs)  # type: ignore[call-overload]
    parts = [c.choices[0].delta.content or "" async for c in stream if c.choices]
    return "".join(parts)


async def run_all(base_url: str) -> dict[str, str]:
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    texts = await asyncio.gather(*(run_case(client, case) for case in CASES))
    return {case.name: text for case, text in zip(CASES, texts, strict=True)}
