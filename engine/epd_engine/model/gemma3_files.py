"""Tokenizer, chat template and processor files of a made-up Gemma 3 checkpoint.

The tokenizer is Gemma's kind (``gemma3_tokenizer``: "▁" for spaces, byte fallback, a
``<bos>`` prepended on encode); the side files are
the ones ``google/gemma-3-4b-it`` ships: its chat template, a ``Gemma3ImageProcessor``
config (one square ``image_size``, mean and std 0.5, no pan-and-scan) and the processor's
``image_seq_length``.
"""

from __future__ import annotations

from pathlib import Path

from epd_engine.model.gemma3_preset import IMAGE_MEAN, IMAGE_STD, SPECIAL_TOKENS, Gemma3Preset
from epd_engine.model.gemma3_tokenizer import build_gemma3_tokenizer
from epd_engine.model.qwen2_vl_files import write_json

# gemma-3-4b-it's chat template: a system message becomes the first user turn's prefix,
# the assistant is "model", each image is one <start_of_image> (the processor expands it).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- if messages[0]['content'] is string -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- else -%}{%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}"
    "{%- endif -%}{%- set loop_messages = messages[1:] -%}"
    '{%- else -%}{%- set first_user_prefix = "" -%}{%- set loop_messages = messages -%}'
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "{%- if (message['role'] == 'assistant') -%}{%- set role = \"model\" -%}"
    "{%- else -%}{%- set role = message['role'] -%}{%- endif -%}"
    "{{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- elif message['content'] is iterable -%}{%- for item in message['content'] -%}"
    "{%- if item['type'] == 'image' -%}{{ '<start_of_image>' }}"
    "{%- elif item['type'] == 'text' -%}{{ item['text'] | trim }}{%- endif -%}"
    "{%- endfor -%}"
    "{%- else -%}{{ raise_exception('Invalid content type') }}{%- endif -%}"
    "{{ '<end_of_turn>\\n' }}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ '<start_of_turn>model\\n' }}{%- endif -%}"
)


def write_gemma3_files(preset: Gemma3Preset, out_dir: Path) -> None:
    """tokenizer.json and the side files AutoTokenizer and our processor read."""
    tokenizer = build_gemma3_tokenizer(preset)
    bos = preset.token_id("<bos>")
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
    specials = {"bos_token": "<bos>", "eos_token": "<eos>", "pad_token": "<pad>",
                "unk_token": "<unk>"}  # fmt: skip
    image_specials = {
        "boi_token": "<start_of_image>",
        "eoi_token": "<end_of_image>",
        "image_token": "<image_soft_token>",
    }
    write_json(
        out_dir / "tokenizer_config.json",
        {
            "tokenizer_class": "GemmaTokenizer",
            **specials,
            "add_bos_token": True,
            "add_eos_token": False,
            "extra_special_tokens": image_specials,
            "added_tokens_decoder": added,
            "model_max_length": preset.text_config["max_position_embeddings"],
            "padding_side": "left",
            "spaces_between_special_tokens": False,
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
            "processor_class": preset.processor_class,
        },
    )
    write_json(out_dir / "special_tokens_map.json", {**specials, **image_specials})
    write_json(out_dir / "chat_template.json", {"chat_template": CHAT_TEMPLATE})
    size = preset.vision_config["image_size"]
    write_json(
        out_dir / "preprocessor_config.json",
        {
            "image_processor_type": "Gemma3ImageProcessor",
            "processor_class": preset.processor_class,
            "size": {"height": size, "width": size},
            "image_seq_length": preset.mm_tokens_per_image,
            "image_mean": IMAGE_MEAN,
            "image_std": IMAGE_STD,
            "do_resize": True,
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "do_convert_rgb": None,
            "do_pan_and_scan": None,
            "resample": 2,  # bilinear
        },
    )
    write_json(
        out_dir / "processor_config.json",
        {"image_seq_length": preset.mm_tokens_per_image, "processor_class": preset.processor_class},
    )
    write_json(
        out_dir / "generation_config.json",
        {
            "bos_token_id": bos,
            "eos_token_id": [preset.token_id("<eos>"), preset.token_id("<end_of_turn>")],
            "pad_token_id": preset.token_id("<pad>"),
        },
    )
