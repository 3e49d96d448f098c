"""``usage.prompt_tokens_details.cached_tokens`` of a request that ends on its first token.

The defect: the engine read a request's cached tokens off the scheduler when it emitted an
output, but a request that ends on its first token (``max_tokens=1``, an immediate EOS) has
already left the scheduler by then, so its usage said 0 cached tokens although its prefill
started after the prefix pages it found. A live ``epdctl serve`` process, with and without
async scheduling (its tokens are resolved a step later, by another path), the real
``openai`` client."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from openai.types.chat import ChatCompletionUserMessageParam

from tests.processes import free_port, running

pytestmark = pytest.mark.slow
PAGE = 16  # the default KV page
PROMPT = "Please repeat after me, word for word, the following list of colours: " + ", ".join(
    ["red", "green", "blue", "yellow", "purple", "orange", "black", "white"] * 3
)


@pytest.fixture(scope="module", params=["sync", "async"])
def instance_url(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, request: pytest.FixtureRequest
) -> Iterator[str]:
    port = free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    args = [
        "serve", "--model", str(tiny_model_dir), "--served-model-name", "tiny-llava",
        "--port", str(port), "--num-kv-blocks", "128", "--num-image-blocks", "8",
    ]  # fmt: skip
    if request.param == "async":
        args.append("--async-scheduling")
    url = f"http://127.0.0.1:{port}"
    with running(args, f"{url}/health/ready", log):
        yield url


@pytest.mark.parametrize("stream", [False, True])
def test_a_request_ending_on_its_first_token_reports_its_prefix_hit(
    instance_url: str, stream: bool
) -> None:
    client = openai.OpenAI(base_url=f"{instance_url}/v1", api_key="-", max_retries=0)
    opening = f"{'Streamed' if stream else 'Whole'}. {PROMPT}"  # its own pages per case
    messages = [ChatCompletionUserMessageParam(role="user", content=opening)]
    first = client.chat.completions.create(
        model="tiny-llava",
        messages=messages,
        max_tokens=3,
        temperature=0,
    )
    assert first.usage is not None and first.usage.prompt_tokens >= 4 * PAGE
    if stream:
        chunks = client.chat.completions.create(
            model="tiny-llava", messages=messages, max_tokens=1, temperature=0,
            stream=True, stream_options={"include_usage": True},
        )  # fmt: skip
        usage = [chunk.usage for chunk in chunks if chunk.usage is not None][-1]
    else:
        again = client.chat.completions.create(
            model="tiny-llava",
            messages=messages,
            max_tokens=1,
            temperature=0,
        )
        assert again.choices[0].finish_reason == "length" and again.usage is not None
        usage = again.usage
    assert usage.completion_tokens == 1
    assert usage.prompt_tokens_details is not None
    # every full page of the prompt but the one holding its last token (prefill computes it)
    hit = (usage.prompt_tokens - 1) // PAGE * PAGE
    assert usage.prompt_tokens_details.cached_tokens == hit
