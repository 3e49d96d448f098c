"""Fire-and-forget coroutines of one instance's migrations, cancelled together on close."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine


class Background:
    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[None]] = set()

    def spawn(self, coro: Coroutine[object, object, None]) -> None:
        """Event loop: run ``coro``; its task is kept until it ends (or ``close``)."""
        task = asyncio.ensure_future(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
