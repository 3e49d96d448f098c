"""Tokenizer and processor files for a made-up checkpoint, built offline.

A byte-level BPE is trained in-process on a built-in corpus (nothing is downloaded), then
``<image>`` and ``<pad>`` are appended so ``<image>`` gets ``image_token_index``, as in
``llava-hf/llava-1.5-7b-hf``. The processor files make ``transformers.AutoProcessor``
expand each ``<image>`` into ``num_image_tokens`` placeholders.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from epd_engine.model.presets import CLIP_MEAN, CLIP_STD, LlavaPreset

UNK, BOS, EOS, IMAGE, PAD = "<unk>", "<s>", "</s>", "<image>", "<pad>"

# LLaVA-1.5 conversation format; image parts render as "<image>\n" before the message text.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}{% else %}"
    "{% for part in message['content'] | selectattr('type', 'equalto', 'image') %}"
    "{{ '<image>\n' }}{% endfor %}"
    "{% for part in message['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ part['text'] + ' ' }}{% endfor %}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)

_CORPUS = """\
USER: <image>
What is in the picture? ASSISTANT: A photo. USER: Thanks! ASSISTANT: You are welcome.
A chat between a curious human and an artificial intelligence assistant. The assistant gives
helpful, detailed, and polite answers to the human's questions. What is shown in this image?
The image shows a red car parked next to a green tree on a sunny street. Describe the picture
in detail. There are two cats sleeping on a blue sofa near the window, and a dog is watching
them. How many people are in the photo? Three people are standing in front of a large
building, smiling at the camera. What color is the sky? The sky is clear and bright blue with a
few white clouds. Compare the two images. The first image is darker than the second one, which
has more colors and a mountain in the background. Write a short story about the scene. Once
upon a time, in a small village by the sea, a fisherman found a bottle with a message inside.
Please answer the question with a single word. Yes. No. Maybe. The quick brown fox jumps over
the lazy dog. 0 1 2 3 4 5 6 7 8 9 10 100 1000 2024 3.14 {"key": "value"} (a, b) [x] <tag>
"""


def corpus_lines(num_synthetic_words: int, seed: int = 0) -> list[str]:
    """The built-in text plus pseudo-words, so BPE finds enough merges for a large vocab."""
    rng = random.Random(seed)
    syllables = [c + v for c in "bcdfghjklmnprstvwz" for v in "aeiou"] + ["th", "ch", "sh", "ng"]
    words = [
        "".join(rng.choice(syllables) for _ in range(rng.randint(1, 4)))
        for _ in range(num_synthetic_words)
    ]
    lines = _CORPUS.splitlines()
    lines += [" ".join(words[i : i + 12]) for i in range(0, len(words), 12)]
    return lines


def build_tokenizer(preset: LlavaPreset) -> Tokenizer:
    """Byte-level BPE: <unk>=0, <s>=1, </s>=2, trained tokens, then <image>, <pad>."""
    base_vocab = preset.base_vocab_size
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=base_vocab,
        special_tokens=[UNK, BOS, EOS],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(corpus_lines(num_synthetic_words=base_vocab * 4), trainer)
    tokenizer = pad_vocab(tokenizer, base_vocab)
    tokenizer.add_special_tokens(
        [AddedToken(token, special=True, normalized=False) for token in (IMAGE, PAD)]
    )
    bos_id = tokenizer.token_to_id(BOS)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    if tokenizer.token_to_id(IMAGE) != preset.image_token_index:
        raise AssertionError(f"{IMAGE} got id {tokenizer.token_to_id(IMAGE)}")
    return tokenizer


def pad_vocab(tokenizer: Tokenizer, size: int) -> Tokenizer:
    """Fill a short trained vocab with never-produced filler tokens up to exactly ``size``."""
    state = json.loads(tokenizer.to_str())
    vocab: dict[str, int] = state["model"]["vocab"]
    filler = 0
    while len(vocab) < size:
        token = f"Ġ<fill{filler}>"
        filler += 1
        if token not in vocab:
            vocab[token] = len(vocab)
    return Tokenizer.from_str(json.dumps(state))


def write_tokenizer_files(preset: LlavaPreset, out_dir: Path) -> None:
    """tokenizer.json + the HF side files that AutoTokenizer / AutoProcessor read."""
    tokenizer = build_tokenizer(preset)
    tokenizer.save(str(out_dir / "tokenizer.json"))
    max_positions = preset.text_config["max_position_embeddings"]
    added = {
        str(tokenizer.token_to_id(tok)): {
            "content": tok,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for tok in (UNK, BOS, EOS, IMAGE, PAD)
    }
    specials = {"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": PAD}
    _write_json(
        out_dir / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            **specials,
            "added_tokens_decoder": added,
            "model_max_length": max_positions,
            "model_input_names": ["input_ids", "attention_mask"],
            "padding_side": "left",
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
            "processor_class": "LlavaProcessor",
        },
    )
    _write_json(out_dir / "special_tokens_map.json", specials)
    _write_json(out_dir / "chat_template.json", {"chat_template": CHAT_TEMPLATE})
    size = preset.vision_config["image_size"]
    _write_json(
        out_dir / "preprocessor_config.json",
        {
            "image_processor_type": "CLIPImageProcessor",
            "processor_class": "LlavaProcessor",
            "do_resize": True,
            "size": {"shortest_edge": size},
            "resample": 3,  # bicubic
            "do_center_crop": True,
            "crop_size": {"height": size, "width": size},
            "do_rescale": True,
            "rescale_factor": 1 / 255,
            "do_normalize": True,
            "image_mean": CLIP_MEAN,
            "image_std": CLIP_STD,
            "do_convert_rgb": True,
        },
    )
    _write_json(
        out_dir / "processor_config.json",
        {
            "processor_class": "LlavaProcessor",
            "patch_size": preset.vision_config["patch_size"],
            "vision_feature_select_strategy": "default",
            # (S/p)^2 patches + CLS, minus CLS for "default" = (S/p)^2 placeholders per image.
            "num_additional_image_tokens": 1,
            "image_token": IMAGE,
        },
    )
    _write_json(
        out_dir / "generation_config.json",
        {
            "bos_token_id": tokenizer.token_to_id(BOS),
            "eos_token_id": tokenizer.token_to_id(EOS),
            "pad_token_id": preset.pad_token_id,
        },
    )


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, ensure_ascii=False) + "\n")
