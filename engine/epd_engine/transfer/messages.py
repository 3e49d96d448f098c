"""Control messages of the four-step pull-based migration. Plain JSON, never pickle.

1. source -> target ``MigrationOffer``: the request's control data, the source's pages and
   how to reach its transfer backend (``transfer``); the target queues it;
2. when the target's scheduler has pages for it, the target pulls (``backend.pull``);
3. the backend copies the source's pages into the target's (``transfer/*.py``);
4. target -> source release: the source frees its pages.

KV offered early (``MigrationOffer.early``) goes to the target when prefill *starts*; the
target pre-admits it and long-polls the source's ``PrefillProgress`` to pull each layer group
as soon as it is written; the answer that ends prefill carries ``PrefillDone``.
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
    # the client reads only the whole answer (not streaming): instances decode its text
    # once, at the end (Detokenizer's whole_text_only), where it has no stop strings
    whole_answer: bool = False
    # what the prompt starts with (router/affinity_key.py): sources place the request's
    # prefill and decode on the instance that key prefers (contracts/affinity.py)
    affinity_key: str | None = None


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
    # Offered when prefill started: ``num_computed_tokens`` is what prefill will compute,
    # ``kv_pages`` is empty and the pages, readiness and first token come by progress polls.
    early: bool = False


class PrefillDone(BaseModel):
    """What a target of an early offer needs once the source's prefill has ended."""

    num_computed_tokens: int
    output_token_ids: list[int]  # including the token prefill sampled
    emitted_text: str


class PrefillProgress(BaseModel):
    """The source's answer to a progress poll of an early offer."""

    version: int  # grows with every change; poll with the last one seen
    written: list[int]  # per layer: tokens whose KV that layer holds
    pages: list[int]  # the request's KV pages at the source, in sequence order
    done: PrefillDone | None = None
    ended: bool = False  # finished or aborted at the source: nothing will come
