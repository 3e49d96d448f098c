"""The prefix cache in the scheduler and the KV page pool: real classes, crafted requests."""

from __future__ import annotations

import itertools
import random

from epd_engine.cache.kv_cache import KVCacheManager
from epd_engine.cache.prefix_hash import PageHasher
from epd_engine.config import Role
from epd_engine.request import PENDING_TOKEN, CacheKind, ImageRef, PullSpec, Request
from epd_engine.sampling import SamplingParams
from epd_engine.scheduler import Scheduler
from epd_engine.transfer.plan import transfers_for
from tests.engine.scheduler.factories import IMAGE_TOKENS, make_scheduler, run_step

_ids = itertools.count()
BLOCK = 4


def _request(
    prompt: list[int], images: list[ImageRef] | None = None, max_tokens: int = 2
) -> Request:
    return Request(
        request_id=f"p{next(_ids)}",
        prompt_token_ids=list(prompt),
        sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
        images=images or [],
    )


def _scheduler(num_kv_blocks: int = 64, role: Role = Role.EPD) -> Scheduler:
    return make_scheduler(
        role=role, num_kv_blocks=num_kv_blocks, block_size=BLOCK, prefix_salt="model-a"
    )


def _run_to_end(s: Scheduler, request: Request) -> None:
    s.add(request)
    while not request.status.finished:
        run_step(s)


def _first_prefill(s: Scheduler, request: Request) -> tuple[int, int]:
    """Add ``request`` and run until its first prefill chunk: (start, tokens)."""
    s.add(request)
    while True:
        out, _ = run_step(s)
        for task in out.prefills:
            if task.request_id == request.request_id:
                return task.start_position, task.num_tokens


def _assert_no_leak(s: Scheduler) -> None:
    assert s.kv is not None
    pool = s.kv.pool
    assert pool.num_free == pool.num_blocks, "a page is still referenced"
    assert all(count == 0 for count in pool._ref_counts)


def test_a_repeated_prompt_prefills_only_after_its_cached_pages() -> None:
    s = _scheduler()
    prompt = list(range(1, 15))  # 14 tokens: 3 full pages of 4
    first = _request(prompt)
    _run_to_end(s, first)
    second = _request(prompt)
    assert _first_prefill(s, second) == (12, 2)
    assert second.num_cached_tokens == 12 and second.num_prefix_hit_tokens == 12
    while not second.status.finished:
        run_step(s)
    assert second.output_token_ids == first.output_token_ids
    _assert_no_leak(s)


def test_a_prompt_of_whole_pages_still_computes_its_last_page() -> None:
    """The first output token needs logits: at least one prompt token is prefilled, and the
    page it is written to is the request's own, never a shared one."""
    s = _scheduler()
    prompt = list(range(1, 9))  # exactly 2 pages
    _run_to_end(s, _request(prompt))
    second = _request(prompt)
    assert _first_prefill(s, second) == (4, 4)
    assert s.kv is not None
    table = s.kv.block_table(second.request_id)
    assert s.kv.pool._ref_counts[table[1]] == 1  # a page of its own for page 1


def test_concurrent_requests_share_pages_by_reference() -> None:
    s = _scheduler()
    prompt = list(range(1, 15))
    first = _request(prompt, max_tokens=8)
    s.add(first)
    run_step(s)  # prefilled: its 3 full pages are registered
    second = _request(prompt, max_tokens=8)
    assert _first_prefill(s, second)[0] == 12
    assert s.kv is not None
    shared = s.kv.block_table(first.request_id)[:3]
    assert s.kv.block_table(second.request_id)[:3] == shared
    assert [s.kv.pool._ref_counts[b] for b in shared] == [2, 2, 2]
    while not (first.status.finished and second.status.finished):
        run_step(s)
    _assert_no_leak(s)


def test_a_changed_system_prompt_misses_even_where_later_pages_match() -> None:
    s = _scheduler()
    _run_to_end(s, _request([1, 2, 3, 4, *range(10, 22)]))
    changed = _request([1, 2, 3, 5, *range(10, 22)])
    assert _first_prefill(s, changed) == (0, 16)
    assert changed.num_cached_tokens == 0


def test_two_images_of_the_same_size_never_share_pages() -> None:
    """vLLM #21175 / #20261: placeholders are one token id repeated, so two different images
    with the same token count give the same ids; the image hash tells their pages apart."""
    s = _scheduler()
    prompt = [1, 2] + [9] * IMAGE_TOKENS + list(range(20, 30))  # image at tokens 2..5
    _run_to_end(s, _request(prompt, [ImageRef("cat", 2, IMAGE_TOKENS)]))
    dog = _request(prompt, [ImageRef("dog", 2, IMAGE_TOKENS)])
    start, _ = _first_prefill(s, dog)
    assert start == 0  # page 0 already holds the image's first rows
    cat_again = _request(prompt, [ImageRef("cat", 2, IMAGE_TOKENS)])
    assert _first_prefill(s, cat_again)[0] == 12


def test_the_same_image_at_another_offset_has_other_keys() -> None:
    """Same token ids, same image, different rows of it in each page: no shared key."""
    hasher = PageHasher(BLOCK, "model-a")
    tokens = [9] * 12
    early, late = [ImageRef("cat", 0, 8)], [ImageRef("cat", 4, 8)]
    keys_early: list[str] = []
    keys_late: list[str] = []
    hasher.extend(keys_early, lambda a, b: tokens[a:b], early, 12)
    hasher.extend(keys_late, lambda a, b: tokens[a:b], late, 12)
    assert not set(keys_early) & set(keys_late)


def test_keys_depend_on_the_model_salt_and_wait_for_pending_tokens() -> None:
    tokens = list(range(8))
    keys_a: list[str] = []
    keys_b: list[str] = []
    PageHasher(BLOCK, "model-a").extend(keys_a, lambda a, b: tokens[a:b], [], 8)
    PageHasher(BLOCK, "model-b").extend(keys_b, lambda a, b: tokens[a:b], [], 8)
    assert len(keys_a) == 2 and not set(keys_a) & set(keys_b)
    pending = [*range(7), PENDING_TOKEN]
    keys: list[str] = []
    PageHasher(BLOCK, "model-a").extend(keys, lambda a, b: pending[a:b], [], 8)
    assert keys == keys_a[:1]  # the page with a token still being drawn has no key yet


def test_off_without_a_salt() -> None:
    s = make_scheduler(block_size=BLOCK)
    prompt = list(range(1, 15))
    _run_to_end(s, _request(prompt))
    assert _first_prefill(s, _request(prompt)) == (0, 14)


def test_free_cached_pages_are_evicted_least_recently_used_under_pressure() -> None:
    s = _scheduler(num_kv_blocks=8)
    old = list(range(100, 114))  # 14 tokens + 2 outputs: 4 pages, 3 cached after
    recent = list(range(200, 214))
    _run_to_end(s, _request(old))
    _run_to_end(s, _request(recent))
    assert s.kv is not None and s.kv.num_cached_blocks == 6  # 3 + 3 full pages kept
    _run_to_end(s, _request(list(range(300, 318))))  # 20 tokens: 5 pages, evicts 3
    assert _first_prefill(s, _request(recent))[0] == 12  # the recent prefix survived
    assert _first_prefill(s, _request(old))[0] < 12  # the older one was evicted first
    while s.has_work():
        run_step(s)
    _assert_no_leak(s)


def test_preempting_a_request_that_shares_pages_leaves_them_to_the_other() -> None:
    s = _scheduler(num_kv_blocks=9)
    prompt = list(range(1, 15))
    first = _request(prompt, max_tokens=12)
    s.add(first)
    run_step(s)
    second = _request(prompt, max_tokens=12)
    s.add(second)
    preempted = 0
    while not (first.status.finished and second.status.finished):
        out, _ = run_step(s)
        preempted += len(out.preempted_ids)
    assert preempted >= 1
    assert first.output_token_ids == second.output_token_ids
    _assert_no_leak(s)


def test_a_migration_target_pulls_only_the_pages_it_lacks() -> None:
    d = _scheduler(role=Role.D)
    prompt = list(range(1, 15))
    held = _request(prompt)
    held.num_computed_tokens = 14
    held.output_token_ids = [7]
    held.pull = PullSpec(CacheKind.KV, "http://p", "p-0", kv_pages=(40, 41, 42, 43))
    d.add(held)
    out, _ = run_step(d)
    (task,) = out.pulls
    assert task.num_held_kv_pages == 0
    assert len(transfers_for(task, 2, 2, BLOCK)[0].dst_pages) == 4
    d.pull_done(held.request_id)
    while not held.status.finished:
        run_step(d)
    turn2 = _request([*prompt, 7, 50, 51, 52, 53])
    turn2.num_computed_tokens = 19
    turn2.output_token_ids = [8]
    turn2.pull = PullSpec(CacheKind.KV, "http://p", "p-0", kv_pages=(60, 61, 62, 63, 64))
    d.add(turn2)
    out, _ = run_step(d)
    (task,) = out.pulls
    assert task.num_held_kv_pages == 3  # tokens 0..11 are here from turn 1
    (transfer,) = transfers_for(task, 2, 2, BLOCK)
    assert transfer.src_pages == (63, 64) and len(transfer.dst_pages) == 2
    d.pull_done(turn2.request_id)
    while not turn2.status.finished:
        run_step(d)
    _assert_no_leak(d)


def test_no_page_leaks_through_random_traffic() -> None:
    rng = random.Random(0)
    s = _scheduler(num_kv_blocks=24)
    stems = [list(range(k * 100, k * 100 + 9)) for k in range(4)]
    for _ in range(60):
        if rng.random() < 0.5 or not s.has_work():
            tail = [rng.randrange(1000, 2000) for _ in range(rng.randint(1, 9))]
            s.add(_request(rng.choice(stems) + tail, max_tokens=rng.randint(1, 6)))
        run_step(s)
        if rng.random() < 0.05 and s.running:
            s.abort(rng.choice(s.running).request_id)
    while s.has_work():
        run_step(s)
    _assert_no_leak(s)
    assert s.kv is not None and s.kv.num_hit_tokens > 0


def test_image_hits_beyond_the_prefix_count_as_cached_tokens() -> None:
    s = _scheduler()
    prompt = list(range(1, 13)) + [9] * IMAGE_TOKENS + [30, 31]  # image at 12..15
    image = [ImageRef("cat", 12, IMAGE_TOKENS)]
    _run_to_end(s, _request(prompt, image))
    other_text = _request([50, *prompt[1:]], image)  # misses the KV, hits the image
    _first_prefill(s, other_text)
    assert other_text.num_cached_tokens == IMAGE_TOKENS
    same = _request(prompt, image)
    start, _ = _first_prefill(s, same)
    assert start == 16 and same.num_cached_tokens == 16


def test_kv_cache_manager_registers_only_written_pages() -> None:
    kv = KVCacheManager(8, BLOCK, "model-a")
    assert kv.grow("a", 10)
    kv.register("a", ["k0", "k1"], 0)
    assert kv.num_cached_blocks == 2
    kv.release("a")
    assert kv.match_prefix("b", ["k0", "k1", "k2"]) == 2


def test_pages_a_windowed_pull_left_out_for_sliding_layers_are_never_published() -> None:
    """A KV pull leaves the pages behind the sliding window out for the sliding layers
    (Gemma 3): those pages are not whole, so a later request must not find them cached
    (it would read the sliding layers' stale contents as its own prefix)."""
    from epd_engine.cache.image_cache import ImageCacheManager
    from epd_engine.scheduler.scheduler import SchedulerLimits
    from tests.engine.scheduler.factories import IMAGE_TOKENS

    limits = SchedulerLimits(64, 4 * IMAGE_TOKENS, 16, 512, sliding_window=6)
    kv = KVCacheManager(64, BLOCK, "model-a")
    d = Scheduler(Role.D, limits, kv, ImageCacheManager(8, IMAGE_TOKENS))
    prompt = list(range(1, 15))  # 14 tokens: the next one sees 9..14, pages 2 and 3
    held = _request(prompt)
    held.num_computed_tokens = 14
    held.output_token_ids = [7]
    held.pull = PullSpec(CacheKind.KV, "http://p", "p-0", kv_pages=(40, 41, 42, 43))
    d.add(held)
    out, _ = run_step(d)
    (task,) = out.pulls
    assert [t.src_pages for t in transfers_for(task, 2, 2, BLOCK, (6, None))] == [
        (42, 43),
        (40, 41, 42, 43),
    ]
    d.pull_done(held.request_id)
    while not held.status.finished:
        run_step(d)
    turn2 = _request([*prompt, 7, 50, 51, 52, 53])
    turn2.num_computed_tokens = 19
    turn2.output_token_ids = [8]
    turn2.pull = PullSpec(CacheKind.KV, "http://p", "p-0", kv_pages=(60, 61, 62, 63, 64))
    d.add(turn2)
    out, _ = run_step(d)
    (task,) = out.pulls
    assert task.num_held_kv_pages == 0  # without the window: 3 (tokens 0..11 from turn 1)
