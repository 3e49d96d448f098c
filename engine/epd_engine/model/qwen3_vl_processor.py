"""transformers' ``Qwen3VLProcessor`` without its video half, on the slow image processor.

The release names ``Qwen2VLImageProcessorFast`` and a ``Qwen3VLVideoProcessor``; both need
torchvision, which the engine does not install. The slow ``Qwen2VLImageProcessor`` runs the
same rule (``smart_resize`` to multiples of ``patch * merge``, patch flattening) with PIL's
bicubic resize, but it ignores a ``size`` given without ``min_pixels`` / ``max_pixels`` (the
release's form) and falls back to Qwen2-VL's bounds: the bounds are passed explicitly.
Text and image tokens go through ``Qwen3VLProcessor.__call__`` itself; videos are refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from transformers import AutoTokenizer
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
from transformers.processing_utils import ProcessorMixin

from epd_engine.model.model_config import read_json


class Qwen3VLImageProcessorOnly(Qwen3VLProcessor):
    attributes: ClassVar[list[str]] = ["image_processor", "tokenizer"]  # type: ignore[misc]

    def __init__(self, image_processor: Any, tokenizer: Any, chat_template: str | None = None):
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)
        for name, default in (
            ("image_token", "<|image_pad|>"),
            ("video_token", "<|video_pad|>"),
            ("vision_start_token", "<|vision_start|>"),
            ("vision_end_token", "<|vision_end|>"),
        ):
            token = getattr(tokenizer, name, default)
            setattr(self, name, token)
            setattr(self, f"{name}_id", tokenizer.convert_tokens_to_ids(token))

    def __call__(  # type: ignore[override]
        self, images: Any = None, text: Any = None, videos: Any = None, **kwargs: Any
    ) -> Any:
        if videos is not None:
            raise ValueError("videos are not supported")
        return super().__call__(images=images, text=text, **kwargs)


def load_qwen3_vl_processor(model_dir: Path) -> Qwen3VLImageProcessorOnly:
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    pre = read_json(Path(model_dir) / "preprocessor_config.json")
    size = pre.get("size") or {}
    image_processor = Qwen2VLImageProcessor.from_pretrained(
        str(model_dir),
        min_pixels=int(pre.get("min_pixels") or size["shortest_edge"]),
        max_pixels=int(pre.get("max_pixels") or size["longest_edge"]),
    )
    return Qwen3VLImageProcessorOnly(image_processor, tokenizer, tokenizer.chat_template)
