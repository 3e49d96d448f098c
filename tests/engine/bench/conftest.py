from __future__ import annotations

from collections.abc import Iterator

import pytest

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
