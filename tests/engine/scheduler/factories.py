"""Factories for scheduler tests: requests and schedulers with small, explicit limits."""

from __future__ import annotations

import itertools

from epd_engine.cache.image_cache import ImageCacheManager
from epd_engine.cache.kv_cache import KVCacheManager
from epd_engine.config import Role
from epd_engine.request import ImageRef, Request
from epd_engine.sampling import SamplingParams
from epd_engine.scheduler import RequestEvent, Scheduler, SchedulerLimits
from epd_engine.scheduler.output import SchedulerOutput

_ids = itertools.count()
IMAGE_TOKENS = 4


def make_request(
    num_prompt_tokens: int = 10,
    image_hashes: tuple[str, ...] = (),
    max_tokens: int = 4,
    eos: frozenset[int] = frozenset(),
    image_tokens: tuple[int, ...] | None = None,  # each image's tokens; default IMAGE_TOKENS
) -> Request:
    sizes = image_tokens or (IMAGE_TOKENS,) * len(image_hashes)
    if len(sizes) != len(image_hashes):
        raise ValueError(f"{len(sizes)} image sizes for {len(image_hashes)} images")
    offsets = list(itertools.accumulate(sizes, initial=1))
    images = [
        ImageRef(h, offset=offset, num_tokens=n)
        for h, offset, n in zip(image_hashes, offsets, sizes, strict=False)
    ]
    prompt = list(range(100, 100 + num_prompt_tokens + sum(sizes)))
    return Request(
        request_id=f"r{next(_ids)}",
        prompt_token_ids=prompt,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        images=images,
        eos_token_ids=eos,
    )


def make_scheduler(
    role: Role = Role.EPD,
    token_budget: int = 64,
    image_budget: int = 4,  # images of IMAGE_TOKENS each
    num_kv_blocks: int = 64,
    block_size: int = 4,
    num_image_blocks: int = 8,
    max_num_running: int = 16,
    max_model_len: int = 512,
    image_token_budget: int | None = None,  # instead of image_budget
    prefix_salt: str | None = None,  # a prefix cache (off unless given)
) -> Scheduler:
    kv = KVCacheManager(num_kv_blocks, block_size, prefix_salt) if role.needs_language else None
    images = ImageCacheManager(num_image_blocks, IMAGE_TOKENS)
    image_tokens = image_token_budget or image_budget * IMAGE_TOKENS
    limits = SchedulerLimits(token_budget, image_tokens, max_num_running, max_model_len)
    return Scheduler(role, limits, kv, images)


def run_step(scheduler: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list[RequestEvent]]:
    """One iteration where every sampling task yields ``token``."""
    out = scheduler.schedule()
    sampled = {t.request_id: token for t in out.token_tasks if t.sample}
    return out, scheduler.update(out, sampled)
