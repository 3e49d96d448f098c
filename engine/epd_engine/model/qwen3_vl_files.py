"""Tokenizer, chat template and processor files of a made-up Qwen3-VL checkpoint.

The byte-level BPE is Qwen2-VL's (``qwen2_vl_files.build_tokenizer``) with Qwen3's special
tokens; the side files are the ones ``Qwen/Qwen3-VL-8B-Instruct`` ships: its chat template
(no default system prompt), ``preprocessor_config.json`` with the bounds under ``size``
(16-px patches, mean and std 0.5) and ``video_preprocessor_config.json``.
"""

from __future__ import annotations

from pathlib import Path

from epd_engine.model.qwen2_vl_files import build_tokenizer, write_json
from epd_engine.model.qwen3_vl_preset import IMAGE_MEAN, IMAGE_STD, SPECIAL_TOKENS, Qwen3VLPreset

# Qwen3-VL-8B-Instruct's chat template, without its tool-calling branches (the engine's chat
# API sends no tools): a system message only when given, images and videos in user turns.
CHAT_TEMPLATE = (
    "{%- if messages[0].role == 'system' %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].content is string %}{{- messages[0].content }}"
    "{%- else %}{%- for content in messages[0].content %}"
    "{%- if 'text' in content %}{{- content.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- set image_count = namespace(value=0) %}{%- set video_count = namespace(value=0) %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'user' %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for content in message.content %}"
    "{%- if content.type == 'image' or 'image' in content or 'image_url' in content %}"
    "{%- set image_count.value = image_count.value + 1 %}"
    "{%- if add_vision_id %}Picture {{ image_count.value }}: {% endif -%}"
    "<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif content.type == 'video' or 'video' in content %}"
    "{%- set video_count.value = video_count.value + 1 %}"
    "{%- if add_vision_id %}Video {{ video_count.value }}: {% endif -%}"
    "<|vision_start|><|video_pad|><|vision_end|>"
    "{%- elif 'text' in content %}{{- content.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role + '\\n' }}"
    "{%- if message.content is string %}{{- message.content }}"
    "{%- else %}{%- for item in message.content %}"
    "{%- if 'text' in item %}{{- item.text }}{%- endif %}{%- endfor %}{%- endif %}"
    "{{- '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def write_qwen3_vl_files(preset: Qwen3VLPreset, out_dir: Path) -> None:
    """tokenizer.json and the side files AutoTokenizer and our processor read."""
    tokenizer = build_tokenizer(preset, SPECIAL_TOKENS)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    added = {
        str(preset.token_id(token)): {
            "content": token,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for token in SPECIAL_TOKENS
    }
    specials = {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>"}
    write_json(
        out_dir / "tokenizer_config.json",
        {
            "tokenizer_class": "Qwen2Tokenizer",
            "bos_token": None,
            "unk_token": None,
            **specials,
            "additional_special_tokens": list(SPECIAL_TOKENS[1:14]),  # as Qwen2-VL's
            "added_tokens_decoder": added,
            "model_max_length": preset.text_config["max_position_embeddings"],
            "padding_side": "right",
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
    common = {
        "patch_size": vc["patch_size"],
        "temporal_patch_size": vc["temporal_patch_size"],
        "merge_size": vc["spatial_merge_size"],
        "image_mean": IMAGE_MEAN,
        "image_std": IMAGE_STD,
        "processor_class": preset.processor_class,
    }
    write_json(
        out_dir / "preprocessor_config.json",
        {
            "size": {"shortest_edge": preset.min_pixels, "longest_edge": preset.max_pixels},
            **common,
            "image_processor_type": "Qwen2VLImageProcessorFast",
        },
    )
    write_json(
        out_dir / "video_preprocessor_config.json",
        {
            "size": {"shortest_edge": 4096, "longest_edge": 25165824},
            **common,
            "video_processor_type": "Qwen3VLVideoProcessor",
        },
    )
    eos = [preset.token_id("<|im_end|>"), preset.token_id("<|endoftext|>")]
    write_json(
        out_dir / "generation_config.json",
        {
            "bos_token_id": preset.token_id("<|endoftext|>"),
            "eos_token_id": eos,
            "pad_token_id": preset.token_id("<|endoftext|>"),
        },
    )
