"""transformers' ``Gemma3Processor`` on the slow (PIL) image processor, pan-and-scan refused.

Every image is resized to one square and becomes ``image_seq_length`` tokens; pan-and-scan
would add crops (more images, more tokens) that the engine's fixed per-image token rule
does not count, so a checkpoint or a call asking for it is an error, not a wrong count.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer
from transformers.models.gemma3.image_processing_gemma3 import Gemma3ImageProcessor
from transformers.models.gemma3.processing_gemma3 import Gemma3Processor

from epd_engine.model.model_config import ModelFormatError, read_json

PAN_AND_SCAN_UNSUPPORTED = "Gemma 3 pan-and-scan crops are not supported"


class Gemma3ProcessorNoCrops(Gemma3Processor):
    def __call__(self, images: Any = None, text: Any = None, **kwargs: Any) -> Any:  # type: ignore[override]
        if kwargs.get("do_pan_and_scan"):
            raise ValueError(PAN_AND_SCAN_UNSUPPORTED)
        return super().__call__(images=images, text=text, **kwargs)


def load_gemma3_processor(model_dir: Path) -> Gemma3ProcessorNoCrops:
    path = Path(model_dir) / "preprocessor_config.json"
    pre = read_json(path)
    if pre.get("do_pan_and_scan"):
        raise ModelFormatError(f"{path}: do_pan_and_scan is set; {PAN_AND_SCAN_UNSUPPORTED}")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    image_processor = Gemma3ImageProcessor.from_pretrained(str(model_dir))
    processor_config = Path(model_dir) / "processor_config.json"
    seq = read_json(processor_config) if processor_config.is_file() else {}
    return Gemma3ProcessorNoCrops(
        image_processor,
        tokenizer,
        chat_template=tokenizer.chat_template,
        image_seq_length=int(seq.get("image_seq_length", pre.get("image_seq_length", 256))),
    )
