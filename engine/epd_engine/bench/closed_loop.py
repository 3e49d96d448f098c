"""Closed-loop load: N clients, each sending its next request as soon as the last one ends.

The trace's arrival times are ignored; its requests are taken in arrival order. Without a
duration every request is sent once; with ``duration_s`` the trace is cycled until the
duration ends (repeats get ``#k`` request ids), in-flight requests then get ``grace_s`` to
finish and the rest are cancelled (recorded as errors). Warm-up requests go first and are not
measured (``DriverConfig.warmup_requests``).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Iterator, Sequence

from epd_engine.bench.driver import (
    DriverConfig,
    Messages,
    make_client,
    payloads_for,
    send_one,
    send_warm_up,
    warm_up,
    with_ids,
)
from epd_engine.contracts.trace import TraceRecord, sort_by_arrival
from epd_engine.slo.outcomes import RequestResult


def _requests(
    records: Sequence[TraceRecord], messages: Messages, cycle: bool
) -> Iterator[tuple[TraceRecord, int]]:
    """(record, payload index) in trace order; cycled with renamed repeats when asked."""
    for lap in itertools.count() if cycle else (0,):
        for i, record in enumerate(records):
            renamed = record if lap == 0 else record.model_copy(
                update={"request_id": f"{record.request_id}#{lap}"}
            )  # fmt: skip
            yield renamed, i


async def run_closed(
    records: Sequence[TraceRecord],
    config: DriverConfig,
    concurrency: int,
    messages: Messages | None = None,
) -> list[RequestResult]:
    """Results in completion order (send times are in ``arrival_s``)."""
    if concurrency < 1:
        raise ValueError(f"concurrency must be >= 1, got {concurrency}")
    records = with_ids(sort_by_arrival(records))
    if not records:
        return []
    if messages is None:
        messages = payloads_for(records, config)
    client = make_client(config)
    await warm_up(client)
    await send_warm_up(client, config, records, messages)
    queue = _requests(records, messages, cycle=config.duration_s is not None)
    slots = asyncio.Semaphore(concurrency)  # never contended: one request per worker
    results: list[RequestResult] = []
    t0 = time.perf_counter()
    stop_at = t0 + config.duration_s if config.duration_s is not None else float("inf")
    stopping = False  # a cancelled request returns its result; its worker must not go on

    async def worker() -> None:
        for record, i in queue:
            now = time.perf_counter()
            if stopping or now >= stop_at:
                return
            results.append(await send_one(client, config, record, messages[i], now, slots, t0))

    workers = [asyncio.create_task(worker()) for _ in range(concurrency)]
    timeout = None if config.duration_s is None else config.duration_s + config.grace_s
    if config.max_duration_s is not None:
        timeout = config.max_duration_s if timeout is None else min(timeout, config.max_duration_s)
    try:
        await asyncio.wait(workers, timeout=timeout)
    finally:
        stopping = True
        for task in workers:
            task.cancel()  # a cancelled request records itself as an error on the way out
        await asyncio.gather(*workers, return_exceptions=True)
        await client.close()
    return results


def closed_loop(
    records: Sequence[TraceRecord],
    config: DriverConfig,
    concurrency: int,
    messages: Messages | None = None,
) -> list[RequestResult]:
    """Blocking ``run_closed`` (own event loop), for the CLI."""
    return asyncio.run(run_closed(records, config, concurrency, messages))
