"""The tiny Gemma 3 tokenizer gives the same ids however transformers reads it.

transformers 4 loads ``tokenizer.json`` as it is; transformers 5's ``GemmaTokenizer`` builds
its own pipeline from the file's vocabulary and merges (BPE with byte fallback, ``<unk>``,
spaces as "▁"). The byte-level tokenizer this checkpoint had before failed there at the
first encode ("Unk token `<unk>` not found in the vocabulary", transformers 5.17 on a GPU
machine). The second reading is rebuilt here as transformers 5.17 does it
(``models/gemma/tokenization_gemma.py``), since the lock pins transformers 4.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer, models

from epd_engine.model.gemma3_tokenizer import with_gemma_pipeline

TEXTS = [
    "hello there, world!",
    "café ☃ naïve — 日本語",
    "<start_of_turn>user\nHi.<end_of_turn>\n<start_of_turn>model\n",
    "  two  spaces\tand a tab",
]


def as_transformers_5_builds_it(tokenizer_json: Path) -> Tokenizer:
    model = json.loads(tokenizer_json.read_text())["model"]
    merges = [tuple(m) for m in model["merges"]]
    bpe = models.BPE(model["vocab"], merges, unk_token="<unk>", fuse_unk=True, byte_fallback=True)
    return with_gemma_pipeline(Tokenizer(bpe))


def test_both_readings_give_the_same_ids_and_text(tiny_gemma3_dir: Path) -> None:
    as_saved = Tokenizer.from_file(str(tiny_gemma3_dir / "tokenizer.json"))
    rebuilt = as_transformers_5_builds_it(tiny_gemma3_dir / "tokenizer.json")
    for special in ("<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"):
        rebuilt.add_special_tokens([special])
    for text in TEXTS:
        ids = as_saved.encode(text, add_special_tokens=False).ids
        assert rebuilt.encode(text, add_special_tokens=False).ids == ids, text
        assert as_saved.decode(ids, skip_special_tokens=False) == text


def test_unknown_characters_fall_back_to_bytes_not_unk(tiny_gemma3_dir: Path) -> None:
    tokenizer = Tokenizer.from_file(str(tiny_gemma3_dir / "tokenizer.json"))
    tokens = tokenizer.encode("☃", add_special_tokens=False).tokens
    assert tokens == ["<0xE2>", "<0x98>", "<0x83>"]
