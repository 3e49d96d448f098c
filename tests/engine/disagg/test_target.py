"""The target side of a migration, step by step: an offer is queued, the scheduler admits it
with pages, the backend fills them in layer groups, the request runs here and the source is
released -- or, when the backend fails, the request is recomputed or re-routed, never lost.

Real: the tiny model's engine and its thread, the migration (its target side wired to the
engine through ``AsyncEngineHooks``), the source's release
endpoint (a plain HTTP server on loopback). Fakes: the transfer backend (it records or
fails transfers: the point is the state machine around it; real backends are tested in
tests/engine/transfer) and the router link (it records what would go to the router).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import httpx
import pytest

from epd_engine.config import EngineConfig, Role
from epd_engine.contracts.routing_policy import InstanceLoad
from epd_engine.disagg.hooks import AsyncEngineHooks
from epd_engine.disagg.migration import Migration
from epd_engine.engine.async_engine import AsyncEngine
from epd_engine.engine.llm_engine import LLMEngine
from epd_engine.request import CacheKind
from epd_engine.transfer.backend import Exports, PageTransfer, Peer, TransferError
from epd_engine.transfer.messages import MigrationOffer, Routing, SamplingInfo

NUM_KV_BLOCKS = 32


@dataclass
class FakeBackend:
    fail_with: str | None = None
    transfers: list[PageTransfer] = field(default_factory=list)
    name: str = "fake"

    def describe(self) -> dict[str, Any]:
        return {"fake": {}}

    async def pull(self, peer: Peer, transfer: PageTransfer) -> None:
        if self.fail_with:
            raise TransferError(self.fail_with)
        self.transfers.append(transfer)

    async def control(self, op: str, body: dict[str, Any]) -> dict[str, Any]:
        raise TransferError("no control")

    def forget(self, instance_id: str) -> None: ...

    async def close(self) -> None: ...


@dataclass
class RecordingLink:
    identity: InstanceLoad
    instances: list[InstanceLoad] = field(default_factory=list)
    heartbeat_s: float = 0.05
    raw: list[dict[str, Any]] = field(default_factory=list)
    retries: list[str] = field(default_factory=list)

    def send(self, output: object, routing: Routing) -> None: ...

    def send_raw(self, event: dict[str, Any]) -> None:
        self.raw.append(event)

    async def retry(self, routing: Routing, reason: str) -> None:
        self.retries.append(reason)


@pytest.fixture(scope="module")
def source_url() -> Iterator[tuple[str, list[str]]]:
    """The migration source's release endpoint: records each release it gets."""
    released: list[str] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            released.append(self.path)
            self.send_response(200)
            self.end_headers()
            self.wfile.write(b"{}")

        def log_message(self, *args: object) -> None: ...

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", released
    server.shutdown()


@dataclass
class Target:
    engine: AsyncEngine
    migration: Migration
    backend: FakeBackend
    link: RecordingLink


@pytest.fixture
async def make_target(tiny_model_dir: Path) -> AsyncIterator[Any]:
    started: list[Target] = []

    async def make(role: Role, backend: FakeBackend) -> Target:
        config = EngineConfig(
            model_dir=tiny_model_dir, role=role, token_budget=64, image_budget=1,
            num_kv_blocks=NUM_KV_BLOCKS, num_image_blocks=2,
        )  # fmt: skip
        engine = AsyncEngine(LLMEngine(config), lambda ids: "".join(map(str, ids)))
        me = InstanceLoad(instance_id="d-0", url="http://d-0", role=role, pool="d")
        link = RecordingLink(me)
        http = httpx.AsyncClient()
        hooks = AsyncEngineHooks(engine)
        migration = Migration(hooks, link, backend, Exports(), http, "t", 1)  # type: ignore[arg-type]
        engine.start()
        target = Target(engine, migration, backend, link)
        started.append(target)
        return target

    yield make
    for target in started:
        await target.migration.close()
        await target.migration.target.http.aclose()
        target.engine.stop()


def kv_offer(
    source: str, num_tokens: int = 20, request_id: str = "r-0", kv_pages: tuple[int, ...] = (5, 6)
) -> MigrationOffer:
    return MigrationOffer(
        request_id=request_id,
        kind=CacheKind.KV,
        source_url=source,
        source_instance="p-0",
        prompt_token_ids=list(range(1, num_tokens + 1)),
        images=[],
        sampling=SamplingInfo(max_tokens=3, temperature=0.0, top_p=1.0, ignore_eos=True),
        eos_token_ids=[],
        output_token_ids=[7],
        num_computed_tokens=num_tokens,
        kv_pages=list(kv_pages),  # 20 tokens in pages of 16
        transfer={"fake": {}},
        routing=Routing(router_request_id="req", attempt=0),
    )


async def until(condition: Any, timeout_s: float = 20) -> None:
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.01)


async def test_pull_fills_pages_layer_group_by_group_then_runs_and_releases(
    make_target: Any, source_url: tuple[str, list[str]]
) -> None:
    url, released = source_url
    target: Target = await make_target(Role.D, FakeBackend())
    await target.migration.target.accept(kv_offer(url))
    await until(lambda: "/internal/migrations/r-0/release" in released)
    transfers = target.backend.transfers
    assert [(t.layer_start, t.layer_stop) for t in transfers] == [(0, 1), (1, 2)]  # 2 layers
    assert all(t.src_pages == (5, 6) and len(t.dst_pages) == 2 for t in transfers)
    assert [e["migration"]["kind"] for e in target.link.raw] == ["kv"]
    scheduler = target.engine.engine.scheduler
    await until(lambda: not scheduler.requests)  # decoded its 2 remaining tokens and finished
    assert scheduler.kv is not None and scheduler.kv.pool.num_free == NUM_KV_BLOCKS


async def test_a_failed_pull_on_a_decode_only_instance_is_rerouted_and_frees_its_pages(
    make_target: Any, source_url: tuple[str, list[str]]
) -> None:
    url, released = source_url
    before = len(released)
    target: Target = await make_target(Role.D, FakeBackend(fail_with="source gone"))
    await target.migration.target.accept(kv_offer(url))
    await until(lambda: bool(target.link.retries))
    assert "source gone" in target.link.retries[0]
    scheduler = target.engine.engine.scheduler
    await until(lambda: not scheduler.requests)
    assert scheduler.kv is not None and scheduler.kv.pool.num_free == NUM_KV_BLOCKS
    await until(lambda: len(released) == before + 1)  # a live source frees its copy at once


async def test_a_failed_pull_where_prefill_runs_recomputes_here(
    make_target: Any, source_url: tuple[str, list[str]]
) -> None:
    url, released = source_url
    before = len(released)
    target: Target = await make_target(Role.PD, FakeBackend(fail_with="timed out"))
    await target.migration.target.accept(kv_offer(url))
    scheduler = target.engine.engine.scheduler
    await until(lambda: not scheduler.requests)  # recomputed the prompt, decoded, finished
    assert target.link.retries == []
    assert len(released) == before + 1
    assert scheduler.kv is not None and scheduler.kv.pool.num_free == NUM_KV_BLOCKS


async def test_a_later_turn_pulls_only_the_pages_this_instance_does_not_hold(
    make_target: Any, source_url: tuple[str, list[str]]
) -> None:
    """The prefix cache on a decode instance: turn 1 (36 tokens) leaves its two full pages
    cached here; turn 2 resends them and 14 tokens more: only its last two pages move."""
    url, released = source_url
    target: Target = await make_target(Role.D, FakeBackend())
    scheduler = target.engine.engine.scheduler
    await target.migration.target.accept(kv_offer(url, 36, "turn-1", (10, 11, 12)))
    await until(lambda: "/internal/migrations/turn-1/release" in released)
    await until(lambda: not scheduler.requests)
    assert {t.src_pages for t in target.backend.transfers} == {(10, 11, 12)}
    target.backend.transfers.clear()

    await target.migration.target.accept(kv_offer(url, 50, "turn-2", (20, 21, 22, 23)))
    await until(lambda: "/internal/migrations/turn-2/release" in released)
    await until(lambda: not scheduler.requests)
    transfers = target.backend.transfers
    assert [(t.src_pages, len(t.dst_pages)) for t in transfers] == [((22, 23), 2)] * 2
    assert scheduler.kv is not None and scheduler.kv.pool.num_free == NUM_KV_BLOCKS
