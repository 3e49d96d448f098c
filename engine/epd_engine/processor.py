"""Chat messages -> prompt token ids, image placeholders and pixel tensors.

Uses the checkpoint's own processor (``transformers.AutoProcessor``: chat template,
tokenizer, CLIP image preprocessing) so prompts are exactly what the model was trained on.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from epd_engine.errors import ClientError
from epd_engine.images import LoadedImage
from epd_engine.model.model_config import LlavaModelConfig
from epd_engine.request import ImageRef


@dataclass
class PreparedPrompt:
    token_ids: list[int]
    images: list[ImageRef]
    pixel_values: list[torch.Tensor]  # one [3, H, W] per image


class InputProcessor:
    def __init__(self, model_dir: Path, model_config: LlavaModelConfig) -> None:
        from transformers import AutoProcessor

        self.model_config = model_config
        self.processor: Any = AutoProcessor.from_pretrained(str(model_dir))
        self.tokenizer: Any = self.processor.tokenizer

    def prepare(self, messages: list[dict[str, Any]], images: list[LoadedImage]) -> PreparedPrompt:
        """``messages`` in Hugging Face chat form (content parts ``text``/``image``)."""
        text = self.processor.apply_chat_template(messages, add_generation_prompt=True)
        try:
            encoded = self.processor(
                text=text,
                images=[i.image for i in images] or None,
                return_tensors="pt",
            )
        except ValueError as exc:  # the input's fault (a shape the processor cannot take)
            raise ClientError(f"cannot process the request's input: {exc}") from exc
        token_ids: list[int] = encoded["input_ids"][0].tolist()
        refs = self._image_refs(token_ids, images)
        pixels = list(encoded["pixel_values"]) if images else []
        return PreparedPrompt(token_ids, refs, pixels)

    def _image_refs(self, token_ids: list[int], images: list[LoadedImage]) -> list[ImageRef]:
        per_image = self.model_config.num_image_tokens
        positions = [i for i, t in enumerate(token_ids) if t == self.model_config.image_token_index]
        if len(positions) != per_image * len(images):
            raise ClientError(
                f"prompt has {len(positions)} image placeholder tokens for {len(images)} images "
                f"({per_image} each); do not put the image token in text",
                param="messages",
            )
        return [
            ImageRef(img.content_hash, positions[k * per_image], per_image, img.width, img.height)
            for k, img in enumerate(images)
        ]

    def decode(self, token_ids: list[int]) -> str:
        return str(self.tokenizer.decode(token_ids, skip_special_tokens=True))

    @property
    def eos_token_ids(self) -> frozenset[int]:
        eos = self.model_config.eos_token_id
        ids = set(eos) if isinstance(eos, list) else {eos}
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        return frozenset(ids)
