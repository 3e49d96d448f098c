"""The engine's decode (the fast tokenizer's own, bypassing transformers' wrapper) gives
transformers' text for any ids: special, image and ordinary tokens, incomplete UTF-8."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import pytest

from epd_engine.inputs.processor import InputProcessor, _backend_decode
from epd_engine.model.registry import load_model_config


@pytest.fixture(params=["llava", "qwen2-vl"])
def processor(request: pytest.FixtureRequest, tiny_model_dir: Path) -> InputProcessor:
    model_dir = (
        tiny_model_dir if request.param == "llava" else request.getfixturevalue("tiny_qwen2_vl_dir")
    )
    return InputProcessor(model_dir, load_model_config(model_dir))


def test_decode_equals_transformers_on_random_ids(processor: InputProcessor) -> None:
    tokenizer = processor.tokenizer
    assert _backend_decode(tokenizer) is not None  # the fast path is the one under test
    rng = random.Random(0)
    vocab = len(tokenizer)
    special = sorted(tokenizer.all_special_ids)
    for length in (1, 2, 3, 7, 40):
        for _ in range(50):
            ids = [rng.choice(special) if rng.random() < 0.2 else rng.randrange(vocab)
                   for _ in range(length)]  # fmt: skip
            assert processor.decode(ids) == tokenizer.decode(ids, skip_special_tokens=True)


def test_a_tokenizer_that_cleans_up_spaces_keeps_transformers_decode(
    tiny_model_dir: Path, tmp_path: Path
) -> None:
    model_dir = tmp_path / "cleans-up"
    shutil.copytree(tiny_model_dir, model_dir)
    config_file = model_dir / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["clean_up_tokenization_spaces"] = True
    config_file.write_text(json.dumps(config))
    processor = InputProcessor(model_dir, load_model_config(model_dir))
    tokenizer = processor.tokenizer
    ids = tokenizer.encode("hello , world .", add_special_tokens=False)
    cleaned = tokenizer.decode(ids, skip_special_tokens=True)
    assert cleaned != tokenizer._tokenizer.decode(ids, skip_special_tokens=True)  # it matters
    assert processor.decode(ids) == cleaned
