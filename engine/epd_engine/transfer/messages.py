"""Control messages of the four-step pull-based migration. Plain JSON, never pickle.

1. source -> target ``MigrationOffer``: the request's control data and page counts;
   the target queues it.
2. when the target schedules it, it allocates pages and pulls (``PagesQuery``);
3. the source answers with the page contents through the transfer backend;
4. target -> source release: the source frees its pages.
"""

from __future__ import annotations

from pydantic import BaseModel, Field

from epd_engine.request import CacheKind


class ImageInfo(BaseModel):
    content_hash: str
    offset: int
    num_tokens: int
    width: int = 0
    height: int = 0


class SamplingInfo(BaseModel):
    max_tokens: int
    temperature: float
    top_p: float
    seed: int | None = None
    stop: list[str] = Field(default_factory=list)
    ignore_eos: bool = False


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
    num_image_pages: int = 0
    num_kv_pages: int = 0
    emitted_text: str = ""  # what the client has already received
    routing: Routing


class PagesQuery(BaseModel):
    """Step 2: which pages to send. KV goes in layer groups so transfer can overlap compute."""

    kind: CacheKind
    image_indices: list[int] = Field(default_factory=list)
    layer_start: int = 0
    layer_stop: int = 0
