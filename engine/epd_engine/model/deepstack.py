"""DeepStack (Qwen3-VL): vision features from intermediate ViT blocks, added to the LM's
hidden states at the image tokens after its first layers.

The image cache stores them in the same row as the embedding
(``[embedding | level 0 | level 1 | ...]``, ``config.image_row_size`` values), so a page
holds everything the LM reads of its tokens and every transfer backend moves them with it.
When a step's prompt rows are gathered, the extra levels of the image rows it places become
``DeepStackRows``: the token rows they belong to and their features.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DeepStackRows:
    """The DeepStack features of a step's image tokens."""

    rows: torch.Tensor  # [N] int64: the image tokens' rows in the step's flat batch
    features: torch.Tensor  # [N, levels * H]: level after level, as the image cache holds them

    def add_level(self, hidden: torch.Tensor, level: int) -> torch.Tensor:
        """``hidden`` ``[T, H]`` with level ``level``'s features added at the image rows
        (transformers' ``_deepstack_process``: a plain add in the hidden dtype)."""
        width = hidden.shape[1]
        if (level + 1) * width > self.features.shape[1]:
            return hidden
        feature = self.features[:, level * width : (level + 1) * width].to(hidden.dtype)
        return hidden.index_add(0, self.rows, feature)  # [T, H]


def split_rows(image_rows: torch.Tensor, hidden_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """An image-cache slice ``[N, image_row_size]`` -> (embeddings ``[N, H]``, DeepStack
    features ``[N, levels * H]``, empty for a family without levels)."""
    return image_rows[:, :hidden_size], image_rows[:, hidden_size:]
