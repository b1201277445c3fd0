"""asyncio helpers that servers and trainers share."""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine
from typing import Any


class Overlapping:
    """Tasks started on a schedule whose runs may outlast it (a DHT store or lookup that a frozen peer's DHT node
    holds for seconds): the next starts without waiting for the last, with at most `limit` running at once."""

    def __init__(self, limit: int):
        self.limit = limit
        self._tasks: set[asyncio.Task] = set()  # referenced until done (the loop keeps only weak references)

    def start(self, job: Callable[[], Coroutine[Any, Any, Any]]) -> bool:
        """Run `job()` in a task of its own, unless `limit` are still running (then False, and nothing is made)."""
        self._tasks = {task for task in self._tasks if not task.done()}
        if len(self._tasks) >= self.limit:
            return False
        self._tasks.add(asyncio.create_task(job()))
        return True

    async def close(self) -> None:
        """Cancel the tasks still running and wait for them to end."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        self._tasks.clear()


def cancelled_here() -> bool:
    """In an `except asyncio.CancelledError`: whether the current task itself is being cancelled (its caller went
    away, the process stops). False when only something it awaited was: grpc.aio raises the cancellation of a call
    whose channel was closed in the call's caller, as if that caller had been cancelled."""
    task = asyncio.current_task()
    return task is None or task.cancelling() > 0
