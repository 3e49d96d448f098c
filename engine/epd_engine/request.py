"""Request state: progress is counters, status is an ordered enum (no torch, no -1 sentinels).

A request is a sequence of stage tasks: encode its images, prefill its prompt (in chunks),
decode one token per step. ``num_encoded_images`` and ``num_computed_tokens`` say how far
each stage has come; the status only orders the coarse lifecycle.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from epd_engine.config import Stage
from epd_engine.sampling import SamplingParams

_ENCODE, _PREFILL, _DECODE = Stage.ENCODE, Stage.PREFILL, Stage.DECODE

# A token drawn by a step still in flight (async scheduling, ``engine_inflight.py``): the
# request's last output token until the host has read it back. Never a vocabulary id.
PENDING_TOKEN = -1


class RequestStatus(enum.IntEnum):
    """Ordered: a request only moves forward, except preemption back to WAITING."""

    WAITING = 0  # queued, holds no cache pages
    RUNNING = 1  # admitted: holds pages on this instance
    MIGRATING = 2  # local stages done, handed to another instance
    FINISHED_STOPPED = 10  # EOS or a stop string
    FINISHED_LENGTH = 11  # max_tokens or the context window
    FINISHED_ABORTED = 12  # client went away or was cancelled
    FINISHED_ERROR = 13

    @property
    def finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASON.get(self)


_FINISH_REASON = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(frozen=True)
class ImageRef:
    """One image of a prompt: its content hash and where its placeholder tokens sit."""

    content_hash: str
    offset: int  # index of its first placeholder token in the prompt
    num_tokens: int
    width: int = 0
    height: int = 0


class CacheKind(enum.StrEnum):
    """What a migration moves: image embeddings (E -> P) or KV pages (P -> D)."""

    IMAGE = "image"
    KV = "kv"


@dataclass(frozen=True)
class PullSpec:
    """Where a migrated-in request's cache lives until this instance pulls it: the source,
    how its transfer backends are reached (``descriptor``), and its pages (per image, in
    prompt order; KV pages in sequence order). ``early``: offered while the source is still
    prefilling; its pages and readiness come from progress polls."""

    kind: CacheKind
    source_url: str
    source_instance: str
    descriptor: dict[str, Any] = field(default_factory=dict)
    image_pages: tuple[tuple[int, ...], ...] = ()
    kv_pages: tuple[int, ...] = ()
    early: bool = False


# eq=False: a request is itself, not its fields. The scheduler finds it in its queues
# (``running.remove``) by identity; field-wise equality compared every request ahead of it
# field by field (4 % of a fleet-sized plan search).
@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    images: list[ImageRef] = field(default_factory=list)
    eos_token_ids: frozenset[int] = frozenset()
    arrival_s: float = field(default_factory=time.monotonic)

    status: RequestStatus = RequestStatus.WAITING
    num_encoded_images: int = 0
    num_computed_tokens: int = 0  # tokens whose K/V sit in this instance's cache
    # prompt tokens served from cache at first admission (image embeddings already encoded):
    # OpenAI's usage.prompt_tokens_details.cached_tokens
    num_cached_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    # prefix cache (cache/kv_cache.py): keys of the sequence's full pages, as far as known;
    # how many leading pages of its table are findable by key; and the tokens the cache
    # served at its latest admission here (prefill starts after them)
    page_keys: list[str] = field(default_factory=list)
    num_registered_pages: int = 0
    num_prefix_hit_tokens: int = 0
    pull: PullSpec | None = None  # set on a migration target until its pull completes
    pulling: bool = False  # pages allocated, bytes in flight: not schedulable yet

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens: the sequence the KV cache must eventually cover."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_images(self) -> int:
        return len(self.images)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def next_stage(self) -> Stage:
        # asked four times per request per step: written without the properties above
        # (at batch 128 their calls were 8 % of a CPU step's host time)
        if self.num_encoded_images < len(self.images):
            return _ENCODE
        computed = self.num_computed_tokens
        num_prompt = len(self.prompt_token_ids)
        if computed < num_prompt or num_prompt + len(self.output_token_ids) - computed > 1:
            return _PREFILL
        return _DECODE

    def token_id_at(self, position: int) -> int:
        if position < self.num_prompt_tokens:
            return self.prompt_token_ids[position]
        return self.output_token_ids[position - self.num_prompt_tokens]

    def token_ids_slice(self, start: int, stop: int) -> list[int]:
        """Tokens ``start:stop`` of prompt + output, copying only those (a decode asks for
        one token of a long sequence every step)."""
        prompt_len = self.num_prompt_tokens
        head = self.prompt_token_ids[start:stop] if start < prompt_len else []
        tail = self.output_token_ids[max(start - prompt_len, 0) : max(stop - prompt_len, 0)]
        return head + tail if head else tail
