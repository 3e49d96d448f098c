"""The stage-level scheduler on its own: pure Python, real classes, crafted requests."""

from __future__ import annotations

import pytest

from epd_engine.config import Role, Stage
from epd_engine.request import RequestStatus
from tests.engine.scheduler.factories import IMAGE_TOKENS, make_request, make_scheduler, run_step


def test_text_request_runs_prefill_then_decodes_to_max_tokens() -> None:
    s = make_scheduler()
    r = make_request(num_prompt_tokens=10, max_tokens=3)
    s.add(r)
    out, events = run_step(s)
    assert [t.stage for t in out.prefills] == [Stage.PREFILL]
    assert out.prefills[0].num_tokens == 10 and out.prefills[0].sample
    assert r.output_token_ids == [7] and r.next_stage is Stage.DECODE
    run_step(s)
    _, events = run_step(s)
    assert r.output_token_ids == [7, 7, 7]
    assert events[-1].finish_reason == "length"
    assert r.status is RequestStatus.FINISHED_LENGTH
    assert s.kv is not None and s.kv.pool.num_free == s.kv.pool.num_blocks


def test_decodes_come_first_then_chunked_prefill_within_token_budget() -> None:
    s = make_scheduler(token_budget=8)
    first = make_request(num_prompt_tokens=6, max_tokens=10)
    s.add(first)
    run_step(s)  # first prefills completely (6 <= 8)
    second = make_request(num_prompt_tokens=20, max_tokens=2)
    s.add(second)
    out, _ = run_step(s)
    assert [t.request_id for t in out.decodes] == [first.request_id]
    assert [(t.request_id, t.num_tokens, t.sample) for t in out.prefills] == [
        (second.request_id, 7, False)
    ]
    out, _ = run_step(s)
    assert out.prefills[0].start_position == 7 and out.prefills[0].num_tokens == 7
    out, _ = run_step(s)
    assert out.prefills[0].num_tokens == 6 and out.prefills[0].sample
    assert second.output_token_ids == [7]


def test_image_request_encodes_before_prefill_and_slices_embeddings() -> None:
    s = make_scheduler()
    r = make_request(num_prompt_tokens=5, image_hashes=("a", "b"))
    s.add(r)
    out, _ = run_step(s)
    assert [(t.image_index, t.content_hash) for t in out.encodes] == [(0, "a"), (1, "b")]
    assert not out.prefills  # embeddings are written this iteration; prefill reads them next
    out, _ = run_step(s)
    (task,) = out.prefills
    assert [(p.src_start, p.dst_start, p.num_tokens) for p in task.image_slices] == [
        (0, 1, IMAGE_TOKENS),
        (0, 1 + IMAGE_TOKENS, IMAGE_TOKENS),
    ]


def test_image_budget_spreads_encodes_over_iterations() -> None:
    s = make_scheduler(image_budget=1)
    r = make_request(image_hashes=("a", "b", "c"))
    s.add(r)
    counts = [len(run_step(s)[0].encodes) for _ in range(3)]
    assert counts == [1, 1, 1]
    assert r.num_encoded_images == 3


def test_repeated_image_hits_encoder_cache_and_skips_encode() -> None:
    s = make_scheduler()
    first = make_request(image_hashes=("same",), max_tokens=1)
    s.add(first)
    while not first.status.finished:
        run_step(s)
    second = make_request(image_hashes=("same",), max_tokens=1)
    s.add(second)
    out, _ = run_step(s)
    assert not out.encodes and len(out.prefills) == 1
    assert s.images is not None and s.images.num_hits == 1


def test_chunk_boundary_inside_an_image_splits_its_embedding_rows() -> None:
    s = make_scheduler(token_budget=3)
    r = make_request(num_prompt_tokens=2, image_hashes=("x",))  # image at positions 1..4
    s.add(r)
    run_step(s)  # encode
    first, _ = run_step(s)
    second, _ = run_step(s)
    assert [(p.src_start, p.dst_start, p.num_tokens) for p in first.prefills[0].image_slices] == [
        (0, 1, 2)
    ]
    assert [(p.src_start, p.dst_start, p.num_tokens) for p in second.prefills[0].image_slices] == [
        (2, 0, 2)
    ]


def test_out_of_pages_preempts_newest_and_recomputes_it_later() -> None:
    s = make_scheduler(num_kv_blocks=6, block_size=4, token_budget=64)
    old = make_request(num_prompt_tokens=8, max_tokens=12)
    new = make_request(num_prompt_tokens=8, max_tokens=12)
    s.add(old)
    s.add(new)
    preempted: list[str] = []
    for _ in range(40):
        if old.status.finished and new.status.finished:
            break
        out, _ = run_step(s)
        preempted += out.preempted_ids
    assert new.request_id in preempted and old.request_id not in preempted
    assert new.num_preemptions >= 1
    assert old.output_token_ids == [7] * 12 and new.output_token_ids == [7] * 12
    assert s.kv is not None and s.kv.pool.num_free == 6


def test_eos_finishes_unless_ignore_eos() -> None:
    s = make_scheduler()
    r = make_request(max_tokens=5, eos=frozenset({7}))
    s.add(r)
    _, events = run_step(s, token=7)
    assert events[0].finish_reason == "stop"


def test_encode_only_role_parks_request_for_migration_with_pages_held() -> None:
    s = make_scheduler(role=Role.E)
    r = make_request(image_hashes=("a",))
    s.add(r)
    out, _ = run_step(s)
    assert len(out.encodes) == 1 and not out.prefills
    assert r.status is RequestStatus.MIGRATING and r.request_id in s.migrating
    assert s.images is not None and s.images.pool.num_used == 1
    s.release_migrated(r.request_id)
    assert s.images.pool.num_used == 0 or s.images.pool.contains("a")  # cached, evictable
    assert s.images.pool.num_free == s.images.pool.num_blocks


def test_prompt_over_context_window_is_rejected_at_add() -> None:
    s = make_scheduler(max_model_len=16)
    with pytest.raises(ValueError, match="context window"):
        s.add(make_request(num_prompt_tokens=20))


def test_abort_frees_pages() -> None:
    s = make_scheduler()
    r = make_request(num_prompt_tokens=10, max_tokens=50)
    s.add(r)
    run_step(s)
    s.abort(r.request_id)
    assert r.status is RequestStatus.FINISHED_ABORTED
    assert s.kv is not None and s.kv.pool.num_used == 0
    assert not s.has_work()


def test_decode_only_instance_out_of_pages_evicts_instead_of_hanging() -> None:
    from epd_engine.request import CacheKind, PullSpec

    s = make_scheduler(role=Role.D, num_kv_blocks=4, block_size=4)
    requests = []
    for _ in range(2):  # two migrated-in requests: 4 prompt tokens + 1 output = 2 pages each
        r = make_request(num_prompt_tokens=4, max_tokens=20)
        r.num_computed_tokens = 4
        r.output_token_ids = [7]
        r.pull = PullSpec(CacheKind.KV, "http://source", "p-0")
        s.add(r)
        requests.append(r)
    out, _ = run_step(s)
    assert len(out.pulls) == 2
    for r in requests:
        s.pull_done(r.request_id)
    evicted: list[str] = []
    for _ in range(10):
        out, _ = run_step(s)
        evicted += out.evicted_ids
    assert evicted == [requests[1].request_id]
    assert requests[1].status is RequestStatus.FINISHED_ERROR
    assert len(requests[0].output_token_ids) > 5


def test_request_whose_pull_is_in_flight_is_never_preempted_for_pages() -> None:
    """Defect: out of pages, a decode preempted the newest running request even while a
    transfer was still writing into that request's pages; they went to another request and
    the request was pulled a second time. Now the decode waits until the pull lands."""
    from epd_engine.request import CacheKind, PullSpec

    s = make_scheduler(role=Role.D, num_kv_blocks=4, block_size=4)
    old, new = (make_request(num_prompt_tokens=4, max_tokens=20) for _ in range(2))
    for r in (old, new):  # migrated in: 4 prompt tokens + 1 output = 2 pages each
        r.num_computed_tokens = 4
        r.output_token_ids = [7]
        r.pull = PullSpec(CacheKind.KV, "http://source", "p-0")
    s.add(old)
    run_step(s)
    s.pull_done(old.request_id)
    s.add(new)
    out, _ = run_step(s)
    assert [p.request_id for p in out.pulls] == [new.request_id]
    for _ in range(6):  # old grows into a third page while new's pull is still in flight
        out, _ = run_step(s)
        assert not out.evicted_ids and not out.preempted_ids
        assert new.pulling and new.status is RequestStatus.RUNNING
    assert old.num_computed_tokens == 8  # its 2 pages are full: it waits, whole
    s.pull_done(new.request_id)
    out, _ = run_step(s)  # landed: now new is the newest victim, as before
    assert out.evicted_ids == [new.request_id]
    assert old.num_computed_tokens == 9


def test_preempted_request_on_a_role_without_encode_recomputes_from_its_pulled_images() -> None:
    """Defect: preempting a PD request reset its encoded-image count and freed the pulled
    embeddings, so it looked unencoded, migrated back to the encode pool and arrived there
    with a KV pull the encoder could not take. Now it keeps its images and recomputes here."""
    from epd_engine.request import CacheKind, PullSpec

    s = make_scheduler(role=Role.PD, num_kv_blocks=6, block_size=4)
    old, new = (make_request(num_prompt_tokens=4, image_hashes=(h,), max_tokens=12) for h in "ab")
    for r in (old, new):  # the encoder ran: the PD instance pulls the embeddings
        r.num_encoded_images = 1
        r.pull = PullSpec(CacheKind.IMAGE, "http://e", "e-0")
        s.add(r)
    out, _ = run_step(s)
    for pull in out.pulls:
        s.pull_done(pull.request_id)
    preempted: list[str] = []
    for _ in range(40):
        out, _ = run_step(s)
        preempted += out.preempted_ids
        assert not out.encodes and new.status is not RequestStatus.MIGRATING
        if old.status.finished and new.status.finished:
            break
    assert new.request_id in preempted
    assert old.output_token_ids == [7] * 12 and new.output_token_ids == [7] * 12
    assert s.images is not None and not s.images.slots(new.request_id)


def test_kv_pull_into_a_role_with_an_image_cache_completes() -> None:
    """ED+P: the ED instance pulls KV for an image request it holds no image pages for."""
    from epd_engine.request import CacheKind, PullSpec

    s = make_scheduler(role=Role.ED)
    r = make_request(num_prompt_tokens=4, image_hashes=("a",), max_tokens=3)
    r.num_encoded_images = 1
    r.num_computed_tokens = r.num_prompt_tokens
    r.output_token_ids = [7]
    r.pull = PullSpec(CacheKind.KV, "http://p", "p-0")
    s.add(r)
    out, _ = run_step(s)
    assert [p.kind for p in out.pulls] == [CacheKind.KV]
    s.pull_done(r.request_id)
    assert not r.pulling
    run_step(s)
    run_step(s)
    assert r.output_token_ids == [7, 7, 7] and r.status is RequestStatus.FINISHED_LENGTH


def test_image_pull_publishes_the_pulled_image_for_later_hits() -> None:
    from epd_engine.request import CacheKind, PullSpec

    s = make_scheduler(role=Role.P)
    r = make_request(image_hashes=("pulled",), max_tokens=1)
    r.num_encoded_images = 1
    r.pull = PullSpec(CacheKind.IMAGE, "http://e", "e-0")
    s.add(r)
    out, _ = run_step(s)
    assert list(out.pulls[0].image_blocks) == [0]
    s.pull_done(r.request_id)
    assert s.images is not None and s.images.pool.contains("pulled")


def test_request_returning_before_its_parked_copy_is_released_gets_clean_pages() -> None:
    """ED+P on one ED instance: encoded here, parked; its KV comes back here for decode
    before the P instance's release of the parked image pages has arrived."""
    from epd_engine.request import CacheKind, PullSpec

    s = make_scheduler(role=Role.ED)
    r = make_request(num_prompt_tokens=4, image_hashes=("a",), max_tokens=2)
    s.add(r)
    run_step(s)
    assert r.request_id in s.migrating
    back = make_request(num_prompt_tokens=4, image_hashes=("a",), max_tokens=2)
    back.request_id = r.request_id
    back.num_encoded_images = 1
    back.num_computed_tokens = back.num_prompt_tokens
    back.output_token_ids = [7]
    back.pull = PullSpec(CacheKind.KV, "http://p", "p-0")
    s.add(back)
    assert r.request_id not in s.migrating
    run_step(s)
    s.pull_done(back.request_id)
    s.release_migrated(back.request_id)  # the late release must not touch the new copy
    run_step(s)
    assert back.output_token_ids == [7, 7] and back.status is RequestStatus.FINISHED_LENGTH
    assert s.kv is not None and s.kv.pool.num_used == 0
