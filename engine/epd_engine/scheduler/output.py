"""What the scheduler hands the runner: plain dataclasses, no tensors."""

from __future__ import annotations

from dataclasses import dataclass, field

from epd_engine.config import Stage
from epd_engine.request import CacheKind, PullSpec


@dataclass(frozen=True)
class EncodeTask:
    """Encode one image and write its embeddings into ``blocks`` of the image cache."""

    request_id: str
    image_index: int
    content_hash: str
    num_tokens: int
    blocks: list[int]


@dataclass(frozen=True)
class ImageSlice:
    """Rows of an image's cached embeddings that replace placeholder tokens in a chunk."""

    blocks: list[int]  # the image's pages in the image cache
    src_start: int  # first embedding row within the image
    dst_start: int  # first row within this task's tokens
    num_tokens: int


@dataclass(frozen=True)
class TokenTask:
    """Run ``token_ids`` through the language model at positions ``start_position...``."""

    request_id: str
    stage: Stage
    token_ids: list[int]
    start_position: int
    block_table: list[int]
    sample: bool  # the chunk reaches the end of the sequence: sample the next token
    image_slices: list[ImageSlice] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)


@dataclass(frozen=True)
class PullTask:
    """Pages this instance allocated for a migrated-in request; fill them from ``source``.

    ``image_blocks`` maps an image index to its pages (images already cached here by hash
    are left out); ``kv_blocks`` are the pages for the first ``num_kv_tokens`` tokens, of
    which the first ``num_held_kv_pages`` came from this instance's prefix cache: they are
    not pulled.
    """

    request_id: str
    kind: CacheKind
    source: PullSpec
    image_blocks: dict[int, list[int]] = field(default_factory=dict)
    kv_blocks: list[int] = field(default_factory=list)
    num_kv_tokens: int = 0
    num_held_kv_pages: int = 0


@dataclass
class SchedulerOutput:
    encodes: list[EncodeTask] = field(default_factory=list)
    prefills: list[TokenTask] = field(default_factory=list)
    decodes: list[TokenTask] = field(default_factory=list)
    preempted_ids: list[str] = field(default_factory=list)  # will be recomputed here
    evicted_ids: list[str] = field(default_factory=list)  # cannot continue here
    pulls: list[PullTask] = field(default_factory=list)

    @property
    def token_tasks(self) -> list[TokenTask]:
        return self.decodes + self.prefills

    @property
    def num_batched_tokens(self) -> int:
        return sum(t.num_tokens for t in self.token_tasks)

    @property
    def num_images(self) -> int:
        return len(self.encodes)

    @property
    def is_empty(self) -> bool:
        return not (self.encodes or self.prefills or self.decodes or self.pulls)
