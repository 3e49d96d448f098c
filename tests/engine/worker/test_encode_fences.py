"""The dual-stream schedule as bookkeeping: a reader waits on exactly the encodes that wrote
the pages it reads, the latest write of a page wins, and a step's end waits on all of them.
(The CUDA events themselves are exercised by the gpu tests; here fences are plain objects.)"""

from __future__ import annotations

import torch

from epd_engine.worker.encode_stream import EncodeFences, EncodeStream


class Fence:
    def __init__(self, name: str) -> None:
        self.name = name


def names(fences: list[Fence]) -> list[str]:
    return [f.name for f in fences]


def test_reader_waits_only_for_the_encodes_of_its_pages() -> None:
    fences: EncodeFences[Fence] = EncodeFences()
    a, b = Fence("a"), Fence("b")
    fences.record([0, 1], a)
    fences.record([5], b)
    assert names(fences.fences_for([1])) == ["a"]
    assert names(fences.fences_for([0, 1, 5])) == ["a", "b"]  # each fence once
    assert fences.fences_for([2, 3]) == []  # pages no pending encode wrote


def test_a_page_rewritten_waits_for_the_later_encode() -> None:
    fences: EncodeFences[Fence] = EncodeFences()
    fences.record([3], Fence("old"))
    fences.record([3], Fence("new"))
    assert names(fences.fences_for([3])) == ["new"]


def test_drain_returns_each_outstanding_fence_once_and_forgets() -> None:
    fences: EncodeFences[Fence] = EncodeFences()
    fences.record([0, 1], Fence("a"))
    fences.record([2], Fence("b"))
    assert names(fences.drain()) == ["a", "b"]
    assert fences.drain() == [] and fences.fences_for([0]) == []


def test_off_cuda_the_stream_is_a_no_op() -> None:
    stream = EncodeStream(torch.device("cpu"), enabled=True)
    assert not stream.enabled
    stream.step_starts()
    with stream.encoding():
        stream.wrote([0])
    stream.before_read([0])
    stream.finish()
    assert stream.fences.drain() == []
