"""Tokenizer, chat template and processor files of a made-up Qwen2-VL checkpoint.

A byte-level BPE is trained offline on the built-in corpus (as for LLaVA), then Qwen2's
special tokens are appended. The files are what ``Qwen/Qwen2-VL-7B-Instruct`` ships, so
``transformers.AutoProcessor`` builds a ``Qwen2VLProcessor`` that resizes each image by
``smart_resize`` and expands ``<|image_pad|>`` into that image's token count.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers

from epd_engine.model.gemma3_preset import Gemma3Preset
from epd_engine.model.make_tokenizer import corpus_lines, pad_vocab
from epd_engine.model.qwen2_vl_preset import IMAGE_MEAN, IMAGE_STD, SPECIAL_TOKENS, Qwen2VLPreset
from epd_engine.model.qwen3_vl_preset import Qwen3VLPreset

# Qwen2-VL-7B-Instruct's chat template (images and videos; default system prompt).
CHAT_TEMPLATE = (
    "{% set image_count = namespace(value=0) %}{% set video_count = namespace(value=0) %}"
    "{% for message in messages %}{% if loop.first and message['role'] != 'system' %}"
    "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}<|im_end|>\n"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' or 'image' in content or 'image_url' in content %}"
    "{% set image_count.value = image_count.value + 1 %}"
    "{% if add_vision_id %}Picture {{ image_count.value }}: {% endif %}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'video' or 'video' in content %}"
    "{% set video_count.value = video_count.value + 1 %}"
    "{% if add_vision_id %}Video {{ video_count.value }}: {% endif %}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{% elif 'text' in content %}{{ content['text'] }}{% endif %}{% endfor %}<|im_end|>\n"
    "{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(
    preset: Qwen2VLPreset | Qwen3VLPreset | Gemma3Preset, specials: Sequence[str] = SPECIAL_TOKENS
) -> Tokenizer:
    """Byte-level BPE of ``base_vocab_size`` tokens, then the family's special tokens."""
    base_vocab = preset.base_vocab_size
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=base_vocab,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    lines = corpus_lines(num_synthetic_words=min(base_vocab, 40_000) * 4)
    tokenizer.train_from_iterator(lines, trainer)
    tokenizer = pad_vocab(tokenizer, base_vocab)
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in specials]
    )
    for token in specials:
        if tokenizer.token_to_id(token) != preset.token_id(token):
            raise AssertionError(f"{token} got id {tokenizer.token_to_id(token)}")
    return tokenizer


def write_qwen2_vl_files(preset: Qwen2VLPreset, out_dir: Path) -> None:
    """tokenizer.json and the side files AutoTokenizer / AutoProcessor read."""
    tokenizer = build_tokenizer(preset)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    added = {
        str(preset.token_id(tok)): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for tok in SPECIAL_TOKENS
    }
    specials = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    write_json(
        out_dir / "tokenizer_config.json",
        {
            "tokenizer_class": "Qwen2Tokenizer",
            "bos_token": None,
            "unk_token": None,
            **specials,
            "additional_special_tokens": list(SPECIAL_TOKENS[1:]),
            "added_tokens_decoder": added,
            "model_max_length": preset.text_config["max_position_embeddings"],
            "padding_side": "left",
            "split_special_tokens": False,
            "clean_up_tokenization_spaces": False,
            "errors": "replace",
            "chat_template": CHAT_TEMPLATE,
            "processor_class": preset.processor_class,
        },
    )
    write_json(out_dir / "special_tokens_map.json", specials)
    write_json(out_dir / "chat_template.json", {"chat_template": CHAT_TEMPLATE})
    vc = preset.vision_config
    write_json(
        out_dir / "preprocessor_config.json",
        {
            "image_processor_type": "Qwen2VLImageProcessor",
            "processor_class": preset.processor_class,
            "min_pixels": preset.min_pixels,
            "max_pixels": preset.max_pixels,
            "size": {"shortest_edge": preset.min_pixels, "longest_edge": preset.max_pixels},
            "patch_size": vc["patch_size"],
            "temporal_patch_size": vc["temporal_patch_size"],
            "merge_size": vc["spatial_merge_size"],
            "image_mean": IMAGE_MEAN,
            "image_std": IMAGE_STD,
            "do_resize": True,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "do_convert_rgb": True,
            "resample": 3,  # bicubic
        },
    )
    write_json(
        out_dir / "generation_config.json",
        {
            "bos_token_id": preset.token_id("<|endoftext|>"),
            "eos_token_id": [preset.token_id("<|im_end|>"), preset.token_id("<|endoftext|>")],
            "pad_token_id": preset.token_id("<|endoftext|>"),
        },
    )


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
