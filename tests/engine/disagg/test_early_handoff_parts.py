"""The early hand-off's two halves on their own: the source's ``PrefillWatch`` (versions,
long-poll) and the target's ``pull_groups`` (which group to pull when, and when to stop).

The progress answers are scripted, as a source would send them; the pulls are recorded
(the real transfers and the real source are exercised in tests/engine/disagg)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from epd_engine.disagg.early_handoff import PrefillWatch, SourceEnded, layer_groups, pull_groups
from epd_engine.request import CacheKind, PullSpec
from epd_engine.scheduler.output import PullTask
from epd_engine.transfer.backend import PageTransfer, TransferError
from epd_engine.transfer.messages import PrefillDone, PrefillProgress

BLOCK = 4
TOKENS = 10  # three pages
SOURCE_PAGES = [7, 8, 9]
TASK = PullTask(
    "r1",
    CacheKind.KV,
    PullSpec(CacheKind.KV, "http://source", "source", early=True),
    kv_blocks=[1, 2, 3, 4],  # one more page than the prompt needs (the next token's)
    num_kv_tokens=TOKENS,
)
DONE = PrefillDone(num_computed_tokens=TOKENS, output_token_ids=[42], emitted_text="hi")


def progress(version: int, written: list[int], done: PrefillDone | None = None) -> PrefillProgress:
    return PrefillProgress(version=version, written=written, pages=SOURCE_PAGES, done=done)


async def run(
    answers: list[PrefillProgress], groups: list[tuple[int, int]], task: PullTask = TASK
) -> tuple[list[tuple[int, list[PageTransfer]]], tuple[PrefillDone, float, int]]:
    """Pulls (with how many polls had been answered at each) and pull_groups' result."""
    script = iter(answers)
    polls = 0
    pulls: list[tuple[int, list[PageTransfer]]] = []

    async def poll(version: int) -> PrefillProgress:
        nonlocal polls
        polls += 1
        return next(script)

    async def pull(transfer: PageTransfer) -> None:
        pulls.append((polls, [transfer]))

    result = await pull_groups(task, groups, BLOCK, poll, pull)
    return pulls, result


def test_each_group_is_pulled_once_all_its_layers_hold_the_prompt() -> None:
    groups = layer_groups(4, 2)
    assert groups == [(0, 2), (2, 4)]
    answers = [
        progress(1, [TOKENS, 0, 0, 0]),  # layer 0 written: group 0 still incomplete
        progress(2, [TOKENS, TOKENS, 0, 0]),  # group 0 complete: pull it now
        progress(3, [TOKENS] * 4),  # group 1 complete, but prefill not ended yet
        progress(4, [TOKENS] * 4, DONE),
    ]
    pulls, (done, _, overlapped) = asyncio.run(run(answers, groups))
    assert [(n, t[0].layer_start, t[0].layer_stop) for n, t in pulls] == [(2, 0, 2), (3, 2, 4)]
    for _, (transfer,) in pulls:
        assert transfer.src_pages == tuple(SOURCE_PAGES)
        assert transfer.dst_pages == (1, 2, 3)  # only the pages the prompt's tokens fill
    assert done == DONE
    assert overlapped == 2


def test_pages_the_target_holds_already_are_not_pulled() -> None:
    """Its prefix cache had the first page (a previous turn): only the rest moves; with
    every page held nothing moves, and the hand-off still completes."""
    answers = [progress(1, [TOKENS, TOKENS], DONE)]
    one_held = replace(TASK, num_held_kv_pages=1)
    pulls, (done, _, _) = asyncio.run(run(answers, layer_groups(2, 1), one_held))
    assert [(t[0].src_pages, t[0].dst_pages) for _, t in pulls] == [((8, 9), (2, 3))] * 2
    all_held = replace(TASK, num_held_kv_pages=3)
    pulls, (done, _, _) = asyncio.run(run(answers, layer_groups(2, 1), all_held))
    assert pulls == [] and done == DONE


def test_a_chunk_that_does_not_finish_the_prompt_pulls_nothing() -> None:
    """Chunked prefill: layers that hold only the first chunk are not complete yet."""
    answers = [
        progress(1, [4, 4]),  # the first chunk passed every layer
        progress(2, [TOKENS, TOKENS], DONE),
    ]
    pulls, (_, _, overlapped) = asyncio.run(run(answers, layer_groups(2, 1)))
    assert [n for n, _ in pulls] == [2, 2]
    assert overlapped == 0


def test_prefill_that_ended_at_the_source_raises_source_ended() -> None:
    ended = PrefillProgress(version=2, written=[TOKENS, 0], pages=SOURCE_PAGES, ended=True)
    with pytest.raises(SourceEnded):
        asyncio.run(run([progress(1, [0, 0]), ended], layer_groups(2, 1)))


def test_a_source_that_computed_other_tokens_is_refused() -> None:
    wrong = PrefillDone(num_computed_tokens=TOKENS + 1, output_token_ids=[1], emitted_text="")
    with pytest.raises(TransferError, match="computed 11 tokens"):
        asyncio.run(run([progress(1, [TOKENS, TOKENS], wrong)], layer_groups(2, 1)))


def test_a_source_with_other_layers_is_refused() -> None:
    with pytest.raises(TransferError, match="3 layers"):
        asyncio.run(run([progress(1, [0, 0, 0])], layer_groups(2, 1)))


def test_a_poll_waits_for_a_newer_version_and_returns_at_once_when_there_is_one() -> None:
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        watch = PrefillWatch("r1", 2, loop)
        first = await watch.newer_than(-1)  # anything is newer than "nothing seen"
        assert first.version == 0
        waiting = asyncio.ensure_future(watch.newer_than(first.version, wait_s=5))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        watch.written[0] = TOKENS
        watch.changed()
        answer = await asyncio.wait_for(waiting, 1)
        assert answer.version == 1 and answer.written == [TOKENS, 0]
        unchanged = await watch.newer_than(answer.version, wait_s=0.05)  # times out
        assert unchanged.version == 1

    asyncio.run(scenario())


async def test_a_gpu_layer_is_published_only_once_its_kernels_are_done() -> None:
    """The defect: on a GPU ``layer_written`` runs when a layer's kernels are *queued*, and the
    source published the layer then, so a target could copy pages still being written. Now
    the layer is published after its CUDA event completes. (A CUDA event cannot exist here:
    a stand-in whose ``synchronize`` blocks until the test releases it.)"""
    import threading

    from epd_engine.disagg.early_handoff import publish_layer_when_done

    class HeldEvent:
        def __init__(self) -> None:
            self.released = threading.Event()

        def synchronize(self) -> None:
            assert self.released.wait(5)

    watch = PrefillWatch("r1", 2, asyncio.get_running_loop())
    event = HeldEvent()
    publishing = asyncio.ensure_future(publish_layer_when_done(event, 1, [(watch, 64)]))
    await asyncio.sleep(0.05)
    assert watch.answer().written == [0, 0] and watch.answer().version == 0  # still running
    event.released.set()
    await asyncio.wait_for(publishing, 5)
    progress = watch.answer()
    assert progress.written == [0, 64] and progress.version == 1
