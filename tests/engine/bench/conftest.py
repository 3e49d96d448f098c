from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from epd_engine.engine.gc_heap import freeze_startup_heap
from tests.engine.bench.fake_openai import FakeOpenAI, serve_fake_openai


@pytest.fixture(scope="session")
def _fake_server() -> Iterator[FakeOpenAI]:
    with serve_fake_openai() as state:
        yield state


@pytest.fixture
def fake_openai(_fake_server: FakeOpenAI) -> FakeOpenAI:
    """The fake OpenAI server (see fake_openai.py for why it is a fixture), reset per test."""
    _fake_server.reset()
    return _fake_server


@pytest.fixture
def frozen_heap() -> Iterator[None]:
    """Keep the collector's full passes off what the suite has imported, for tests that time
    latency in this process (a full pass over it is a stall of 100-200 ms on a small host)."""
    freeze_startup_heap()
    try:
        yield
    finally:
        gc.unfreeze()
