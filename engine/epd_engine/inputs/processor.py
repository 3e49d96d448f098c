"""Chat messages -> prompt token ids, image placeholders and pixel tensors.

Uses the checkpoint's own processor (the family's: chat template, tokenizer, image
preprocessing) so prompts are exactly what the model was trained on. Each image reports
its own token count: fixed for LLaVA, from the resized resolution for Qwen2-VL.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

import torch

from epd_engine.contracts.errors import ClientError
from epd_engine.inputs.images import LoadedImage
from epd_engine.model.image_bounds import lower_processor_max_pixels
from epd_engine.model.registry import ModelConfig, family_of
from epd_engine.request import ImageRef


@dataclass
class PreparedPrompt:
    token_ids: list[int]
    images: list[ImageRef]
    # One per image, as the family's ``encode_images`` takes it: LLaVA ``[3, S, S]``;
    # Qwen2-VL its patch grid ``[h, w, C*t*p*p]``.
    pixel_values: list[torch.Tensor]


class InputProcessor:
    def __init__(self, model_dir: Path, model_config: ModelConfig) -> None:
        family = family_of(Path(model_dir))
        self.model_config = model_config
        self.processor: Any = family.processor(Path(model_dir))
        max_pixels = getattr(model_config, "processor_max_pixels", None)
        if max_pixels is not None:  # the deployment's: resize further, as the token rule does
            lower_processor_max_pixels(self.processor, max_pixels)
        self.tokenizer: Any = self.processor.tokenizer
        self.image_tokens = family.image_tokens(Path(model_dir), model_config)
        self._decode = _backend_decode(self.tokenizer) or partial(
            self.tokenizer.decode, skip_special_tokens=True
        )

    def prepare(self, messages: list[dict[str, Any]], images: list[LoadedImage]) -> PreparedPrompt:
        """``messages`` in Hugging Face chat form (content parts ``text``/``image``)."""
        text = self.processor.apply_chat_template(messages, add_generation_prompt=True)
        # the chat template's per-image placeholder (Gemma 3: <start_of_image>, expanded by
        # the processor into the image tokens)
        image_token = getattr(self.processor, "boi_token", None) or getattr(
            self.processor, "image_token", None
        )
        if image_token and text.count(image_token) != len(images):
            # Before the processor: Qwen2-VL's would index past its last image (IndexError).
            raise ClientError(
                f"prompt has {text.count(image_token)} image placeholders for {len(images)} "
                f"images; do not put the image token {image_token!r} in text",
                param="messages",
            )
        try:
            encoded = self.processor(
                text=text,
                images=[i.image for i in images] or None,
                return_tensors="pt",
            )
        except ValueError as exc:  # the input's fault (a shape the processor cannot take)
            raise ClientError(f"cannot process the request's input: {exc}") from exc
        token_ids: list[int] = encoded["input_ids"][0].tolist()
        pixels, counts = self._per_image(encoded, images)
        refs = self._image_refs(token_ids, images, counts)
        return PreparedPrompt(token_ids, refs, pixels)

    def _per_image(
        self, encoded: Any, images: list[LoadedImage]
    ) -> tuple[list[torch.Tensor], list[int]]:
        """Each image's pixels and token count."""
        if not images:
            return [], []
        grids = encoded.get("image_grid_thw")
        if grids is None:  # one fixed-size tensor per image
            pixels = list(encoded["pixel_values"])
            return pixels, [self.image_tokens(i.width, i.height) for i in images]
        # Flattened patches of all images: cut per image into its [h, w, patch] grid.
        sizes = [int(t * h * w) for t, h, w in grids.tolist()]
        pixels = [
            patches.view(int(h), int(w), -1)
            for patches, (_, h, w) in zip(
                encoded["pixel_values"].split(sizes), grids.tolist(), strict=True
            )
        ]
        counts = [size // self.model_config.merge_unit for size in sizes]  # type: ignore[union-attr]
        for image, count in zip(images, counts, strict=True):
            if self.image_tokens(image.width, image.height) != count:  # the rule M-RoPE reuses
                raise AssertionError(f"{image.width}x{image.height}: processor gave {count} tokens")
        return pixels, counts

    def _image_refs(
        self, token_ids: list[int], images: list[LoadedImage], counts: list[int]
    ) -> list[ImageRef]:
        positions = [i for i, t in enumerate(token_ids) if t == self.model_config.image_token_index]
        if len(positions) != sum(counts):
            raise ClientError(
                f"prompt has {len(positions)} image placeholder tokens for {len(images)} images "
                f"({sum(counts)} in all); do not put the image token in text",
                param="messages",
            )
        refs = []
        first = 0
        for img, count in zip(images, counts, strict=True):
            refs.append(ImageRef(img.content_hash, positions[first], count, img.width, img.height))
            first += count
        return refs

    def decode(self, token_ids: list[int]) -> str:
        return str(self._decode(token_ids))

    @property
    def eos_token_ids(self) -> frozenset[int]:
        eos = self.model_config.eos_token_id
        ids = set(eos) if isinstance(eos, list) else {eos}
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return frozenset(ids)


def _backend_decode(tokenizer: Any) -> Callable[[list[int]], str] | None:
    """A fast tokenizer's own (Rust) decode, without transformers' wrapper around it: the
    same text when the tokenizer cleans up no spaces, at a third of the cost per call. The
    detokenizer decodes twice per token of every running request (on the event loop, where
    the engine thread waits for the GIL); None when the wrapper would change the text."""
    backend = getattr(tokenizer, "_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return None
    return partial(backend.decode, skip_special_tokens=True)
