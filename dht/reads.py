"""DHT reads that a remote peer's message can trigger, bounded: at most one read per interval, shared by every caller
that arrives while it runs. A flood of messages naming unknown peers costs the DHT one read per interval."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable


def _retrieve(task: asyncio.Future) -> None:
    if not task.cancelled():
        task.exception()


class ThrottledRead:
    """Event loop. `await read()` runs `fetch` unless a run is under way (then it waits for that one) or one started
    less than `interval` seconds ago (then it returns at once); it waits `timeout` seconds at most, and never raises
    (a failed read leaves what the caller knew). It returns whether that read completed: False if it failed or is
    still running (a DHT node that does not answer), so the caller can tell "not listed" from "could not look"."""

    def __init__(self, fetch: Callable[[], Awaitable[None]], interval: float, timeout: float):
        self.fetch, self.interval, self.timeout = fetch, interval, timeout
        self._task: asyncio.Future | None = None
        self._started = 0.0
        self.read_at = float("-inf")  # when the last read that completed began (monotonic)

    async def __call__(self) -> bool:
        if self._task is None or (self._task.done() and time.monotonic() - self._started > self.interval):
            self._started = time.monotonic()
            self._task = asyncio.ensure_future(self._fetch(self._started))
            self._task.add_done_callback(_retrieve)  # a read that fails after every caller gave up is not an error
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self._task), self.timeout)
        return self._task.done() and not self._task.cancelled() and self._task.exception() is None

    async def since(self, started: float, timeout: float) -> None:
        """Wait up to `timeout` seconds for a read that began at monotonic time `started` or later to complete (a call
        within `interval` of the last read returns that read's result, which may predate what the caller needs)."""
        deadline = time.monotonic() + timeout
        while self.read_at < started and (left := deadline - time.monotonic()) > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self(), left)
            if self.read_at < started:  # throttled (an older read's result), or it failed: read again shortly
                await asyncio.sleep(min(self.interval / 2, max(deadline - time.monotonic(), 0)))

    async def _fetch(self, started: float) -> None:
        await self.fetch()
        self.read_at = max(self.read_at, started)
