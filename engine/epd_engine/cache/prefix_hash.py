"""Prefix-cache page identity: a hash chain over full KV pages (no torch).

A KV page's content is a function of every token before and in it, of the images whose
placeholder tokens it covers (placeholders are one token id repeated: two images with the
same token count have the same ids), and of the model. So page ``i``'s key hashes page
``i - 1``'s key, the page's token ids, each covered image's content hash, size and the rows
of it the page holds, and the chain starts from a per-model salt. Two prompts share page
``i`` exactly when their first ``(i + 1) * block_size`` tokens and images are the same.

Only full pages have a key: the last, partial page of a sequence is always its own.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Sequence

from epd_engine.request import PENDING_TOKEN, ImageRef

TokenSlice = Callable[[int, int], list[int]]  # tokens [start, stop) of a sequence


class PageHasher:
    """Keys of a sequence's full pages, as a chain from ``salt``."""

    def __init__(self, block_size: int, salt: str) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.block_size = block_size
        self.root = hashlib.sha256(f"epd-prefix-v1|{block_size}|{salt}".encode()).hexdigest()

    def extend(
        self,
        hashes: list[str],
        tokens: TokenSlice,
        images: Sequence[ImageRef],
        num_known_tokens: int,
    ) -> None:
        """Append the keys of the full pages among the first ``num_known_tokens`` tokens
        that ``hashes`` lacks. Stops at a page holding a token still being drawn (async
        scheduling's placeholder): its key is made once the token is known."""
        size = self.block_size
        for index in range(len(hashes), num_known_tokens // size):
            start = index * size
            page = tokens(start, start + size)
            if PENDING_TOKEN in page:
                return
            parent = hashes[-1] if hashes else self.root
            hashes.append(self.page_key(parent, page, _images_in(images, start, start + size)))

    @staticmethod
    def page_key(parent: str, token_ids: Sequence[int], images: Sequence[str]) -> str:
        digest = hashlib.sha256(parent.encode())
        digest.update(array("q", token_ids).tobytes())
        for image in images:
            digest.update(b"|img|")
            digest.update(image.encode())
        return digest.hexdigest()


def _images_in(images: Sequence[ImageRef], start: int, stop: int) -> list[str]:
    """What tells apart the images whose placeholder tokens fall in ``[start, stop)``: their
    content hash, size and the rows of each the page holds."""
    found = []
    for image in images:
        lo = max(start, image.offset)
        hi = min(stop, image.offset + image.num_tokens)
        if lo < hi:
            rows = f"{lo - image.offset}-{hi - image.offset}"
            found.append(f"{image.content_hash}:{image.width}x{image.height}:{rows}")
    return found
