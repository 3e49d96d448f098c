"""Control messages of the four-step pull-based migration. Plain JSON, never pickle.

1. source -> target ``MigrationOffer``: the request's control data, the source's pages and
   how to reach its transfer backend (``transfer``); the target queues it;
2. when the target's scheduler has pages for it, the target pulls (``backend.pull``);
3. the backend copies the source's pages into the target's (``transfer/*.py``);
4. target -> source release: the source frees its pages.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field

from epd_engine.request import CacheKind
from epd_engine.sampling import SamplingParams


class ImageInfo(BaseModel):
    content_hash: str
    offset: int
    num_tokens: int
    width: int = 0
    height: int = 0


class SamplingInfo(BaseModel):
    """``SamplingParams`` on the wire (every field, so a migrated request samples the same)."""

    max_tokens: int
    temperature: float
    top_p: float
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: bool = False
    top_logprobs: int = 0

    @classmethod
    def of(cls, params: SamplingParams) -> SamplingInfo:
        return cls(**{**vars(params), "stop": list(params.stop)})

    def params(self) -> SamplingParams:
        return SamplingParams(**{**self.model_dump(), "stop": tuple(self.stop)})


class Routing(BaseModel):
    """How the request reaches its client: through the router that owns it."""

    router_request_id: str
    attempt: int = 0
    path: list[str] = Field(default_factory=list)  # pools visited so far


class MigrationOffer(BaseModel):
    request_id: str
    kind: CacheKind
    source_url: str
    source_instance: str
    prompt_token_ids: list[int]
    images: list[ImageInfo]
    sampling: SamplingInfo
    eos_token_ids: list[int]
    output_token_ids: list[int]
    num_computed_tokens: int  # tokens whose KV the source holds (kind=kv)
    image_pages: list[list[int]] = Field(default_factory=list)  # source pages per image
    kv_pages: list[int] = Field(default_factory=list)  # source pages of computed tokens
    transfer: dict[str, dict[str, Any]] = Field(default_factory=dict)  # backend -> connect info
    emitted_text: str = ""  # what the client has already received
    routing: Routing
