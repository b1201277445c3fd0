"""What a server does with the rest of a request it refused while its caller is still sending."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterable, Callable

import grpc


class Drains:
    """Reads and drops what refused callers still send, so that each gets the refusal's reason instead of gRPC's
    "Internal error from Core" for a write that raced the abort: a stream ended unread while its caller still sends
    is reported so. At most `at_once` streams are read at a time: reading one holds its next message (up to a chunk)
    in memory, so a flood of refusals holds at most `at_once` chunks. A refused stream waits for a free slot (its
    caller, held back by flow control, sends nothing meanwhile), within the same `seconds` it may take in all: under
    a flood every caller hears why it was refused (`python -m tests.benchmarks.bench_flood`: 50 concurrent 2 MiB
    calls ended INTERNAL 6, 34 and 29 times in 3 rounds when the streams beyond `at_once` were ended unread; 0 times
    with 16 draining and 48 waiting). A waiting stream holds what gRPC buffered of it, so at most `waiting` wait;
    beyond that, and for a stream that finds no slot in time, the stream is ended unread."""

    def __init__(self, at_once: int, waiting: int | None = None):
        self.at_once, self.running, self.waiting = at_once, 0, 0
        self.max_waiting = 3 * at_once if waiting is None else waiting
        self._slots = asyncio.Semaphore(at_once)

    async def drain(
        self,
        messages: AsyncIterable[bytes],
        max_bytes: int,
        seconds: float,
        on_bytes: Callable[[int], None] | None = None,
    ) -> None:
        """Read and drop up to `max_bytes` of `messages` for at most `seconds`, waiting for a slot within them."""
        if seconds <= 0 or self.running + self.waiting >= self.at_once + self.max_waiting:
            return
        loop = asyncio.get_running_loop()
        give_up = loop.time() + seconds
        self.waiting += 1
        try:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for may cancel an acquire that just succeeded, and the
            # slot would be lost for good
            async with asyncio.timeout(seconds):
                await self._slots.acquire()
        except TimeoutError:
            return
        finally:
            self.waiting -= 1
        self.running += 1
        try:
            with contextlib.suppress(TimeoutError, grpc.RpcError):
                await asyncio.wait_for(self._drop(messages, max_bytes, on_bytes), max(give_up - loop.time(), 0.0))
        finally:
            self.running -= 1
            self._slots.release()

    @staticmethod
    async def _drop(messages: AsyncIterable[bytes], left: int, on_bytes: Callable[[int], None] | None) -> None:
        async for message in messages:
            left -= len(message)
            if on_bytes is not None:
                on_bytes(len(message))
            if left < 0:
                return
