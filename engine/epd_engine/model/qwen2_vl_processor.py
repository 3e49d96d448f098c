"""transformers' ``Qwen2VLProcessor`` without its video half.

``AutoProcessor`` builds a Qwen2-VL processor with a video processor, and that needs
torchvision, which the engine does not install. Images and text go through transformers'
own code either way (``Qwen2VLImageProcessor``: ``smart_resize``, patch flattening;
``Qwen2VLProcessor.__call__``: one ``<|image_pad|>`` per merged patch group); only videos
are refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, ClassVar

from transformers import AutoTokenizer, Qwen2VLProcessor
from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor
from transformers.processing_utils import ProcessorMixin


class Qwen2VLImageProcessorOnly(Qwen2VLProcessor):
    attributes: ClassVar[list[str]] = ["image_processor", "tokenizer"]  # type: ignore[misc]

    def __init__(self, image_processor: Any, tokenizer: Any, chat_template: str | None = None):
        self.image_token = getattr(tokenizer, "image_token", "<|image_pad|>")
        self.video_token = getattr(tokenizer, "video_token", "<|video_pad|>")
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)

    def __call__(  # type: ignore[override]
        self, images: Any = None, text: Any = None, videos: Any = None, **kwargs: Any
    ) -> Any:
        if videos is not None:
            raise ValueError("videos are not supported")
        return super().__call__(images=images, text=text, **kwargs)


def load_qwen2_vl_processor(model_dir: Path) -> Qwen2VLImageProcessorOnly:
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    image_processor = Qwen2VLImageProcessor.from_pretrained(str(model_dir))
    return Qwen2VLImageProcessorOnly(image_processor, tokenizer, tokenizer.chat_template)
