"""Runs of image placeholder tokens in a prompt: the spans Gemma 3 attends over both ways."""

from __future__ import annotations

from collections.abc import Sequence


def image_spans(token_ids: Sequence[int], image_token: int) -> list[tuple[int, int]]:
    """``[start, end)`` of every maximal run of ``image_token`` (one image each, as
    transformers groups them: consecutive image tokens are one image)."""
    spans: list[tuple[int, int]] = []
    start = None
    for position, token in enumerate(token_ids):
        if token == image_token and start is None:
            start = position
        elif token != image_token and start is not None:
            spans.append((start, position))
            start = None
    if start is not None:
        spans.append((start, len(token_ids)))
    return spans
