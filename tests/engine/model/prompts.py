"""Prompt factories for model tests: real PIL images and chat-templated processor inputs."""

from __future__ import annotations

from typing import Any

from PIL import Image, ImageDraw


def make_images() -> list[Image.Image]:
    """Three images of different content and sizes (resize + crop paths differ)."""
    gradient = Image.linear_gradient("L").resize((90, 60)).convert("RGB")
    checker = Image.new("RGB", (64, 64), "white")
    draw = ImageDraw.Draw(checker)
    for row in range(8):
        for col in range(8):
            if (row + col) % 2:
                draw.rectangle([col * 8, row * 8, col * 8 + 7, row * 8 + 7], fill=(20, 40, 200))
    circle = Image.new("RGB", (70, 100), (240, 240, 200))
    ImageDraw.Draw(circle).ellipse([10, 20, 60, 80], fill=(220, 30, 30))
    return [gradient, checker, circle]


def build_prompt(processor: Any, text: str, images: list[Image.Image]) -> dict[str, Any]:
    """Chat template + AutoProcessor, as a client request would be turned into tokens."""
    content = [{"type": "image"} for _ in images] + [{"type": "text", "text": text}]
    prompt = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True
    )
    return processor(images=images or None, text=prompt, return_tensors="pt")
