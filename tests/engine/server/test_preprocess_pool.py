"""Preprocessing in worker processes (``--preprocess-workers``): the same prompts as in the
instance's own process, the same client errors, and a live instance serving with it."""

from __future__ import annotations

import asyncio
import pickle
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

from epd_engine.config import EngineConfig
from epd_engine.contracts.errors import ClientError, ServiceUnavailable
from epd_engine.inputs.images import ImageLimits, load_image
from epd_engine.inputs.preprocess_pool import PreprocessPool
from epd_engine.inputs.processor import InputProcessor
from epd_engine.model.registry import load_model_config
from tests.engine.server.images import image_message, png_bytes
from tests.processes import free_port, running

LIMITS = ImageLimits(max_bytes=300_000, max_pixels=250_000, max_request_pixels=400_000)
MESSAGES = [
    {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is it?"}]}
]


@pytest.fixture(scope="module")
def pool(tiny_model_dir: Path) -> Iterator[PreprocessPool]:
    workers = PreprocessPool(tiny_model_dir, load_model_config(tiny_model_dir), workers=1)
    workers.warm_up()
    yield workers
    workers.close()


def test_a_worker_prepares_the_prompt_the_instance_would(
    pool: PreprocessPool, tiny_model_dir: Path
) -> None:
    blob = png_bytes(3)
    here = InputProcessor(tiny_model_dir, load_model_config(tiny_model_dir))
    expected = here.prepare(MESSAGES, [load_image(blob, LIMITS)])
    got = asyncio.run(pool.prepare(MESSAGES, [blob], LIMITS))
    assert got.token_ids == expected.token_ids
    assert got.images == expected.images  # content hash, offsets, token counts, sizes
    assert len(got.pixel_values) == 1
    assert torch.equal(got.pixel_values[0], expected.pixel_values[0])


def test_a_bad_image_is_the_clients_error_with_its_param(pool: PreprocessPool) -> None:
    truncated = png_bytes(4)[:300]  # a valid header, then nothing to decode
    with pytest.raises(ClientError) as raised:
        asyncio.run(pool.prepare(MESSAGES, [truncated], LIMITS))
    assert raised.value.param == "image_url" and "cannot decode image" in raised.value.message


def test_client_errors_cross_processes_whole() -> None:
    """Pickled as ``Exception`` does, the param and code were lost on the way back."""
    for error in (ClientError("bad", "messages", "x"), ServiceUnavailable("busy", None, "y")):
        back = pickle.loads(pickle.dumps(error))
        assert type(back) is type(error)
        assert (back.message, back.param, back.code) == (error.message, error.param, error.code)


def test_a_negative_worker_count_is_refused(tiny_model_dir: Path) -> None:
    with pytest.raises(ValueError, match="preprocess_workers"):
        EngineConfig(model_dir=tiny_model_dir, preprocess_workers=-1)
    with pytest.raises(ValueError, match="at least 1"):
        PreprocessPool(tiny_model_dir, load_model_config(tiny_model_dir), workers=0)


@pytest.mark.slow
def test_an_instance_with_workers_answers_as_one_without(
    instance_url: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A live ``epdctl serve --preprocess-workers 1`` gives the greedy text of the instance
    that preprocesses in its own process (``instance_url``), through the openai client."""
    port = free_port()
    args = [
        "serve", "--model", str(tiny_model_dir), "--served-model-name", "tiny-llava",
        "--port", str(port), "--token-budget", "256", "--image-budget", "4",
        "--num-kv-blocks", "128", "--num-image-blocks", "8", "--max-model-len", "512",
        "--preprocess-workers", "1",
    ]  # fmt: skip
    request = dict(
        model="tiny-llava",
        messages=[image_message("What is in the picture?", 5)],
        max_tokens=8,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    url = f"http://127.0.0.1:{port}"
    with running(args, f"{url}/health/ready", tmp_path / "serve.log"):
        pooled = openai.OpenAI(base_url=f"{url}/v1", api_key="-", max_retries=0)
        got = pooled.chat.completions.create(**request)  # type: ignore[call-overload]
    plain = openai.OpenAI(base_url=f"{instance_url}/v1", api_key="-", max_retries=0)
    expected = plain.chat.completions.create(**request)  # type: ignore[call-overload]
    assert got.choices[0].message.content == expected.choices[0].message.content
    assert got.usage.prompt_tokens == expected.usage.prompt_tokens
