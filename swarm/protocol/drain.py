"""What a server does with the rest of a request it refused while its caller is still sending."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterable, Callable

import grpc


class Drains:
    """Reads and drops what refused callers still send, so that each gets the refusal's reason instead of gRPC's
    "Internal error from Core" for a write that raced the abort; at most `at_once` streams at a time. Reading a stream
    holds its next message (gRPC's receive buffers, then its bytes) in memory: at the heap's peak of a flood
    (`python -m tests.benchmarks.bench_flood` under memray) drains held 27 frames of 2 MiB at once, so beyond
    `at_once` a refused stream is ended unread."""

    def __init__(self, at_once: int):
        self.at_once, self.running = at_once, 0

    async def drain(
        self,
        messages: AsyncIterable[bytes],
        max_bytes: int,
        seconds: float,
        on_bytes: Callable[[int], None] | None = None,
    ) -> None:
        """Read and drop up to `max_bytes` of `messages` for at most `seconds`, if fewer than `at_once` drain now."""
        if self.running >= self.at_once or seconds <= 0:
            return
        self.running += 1
        try:
            with contextlib.suppress(TimeoutError, grpc.RpcError):
                await asyncio.wait_for(self._drop(messages, max_bytes, on_bytes), seconds)
        finally:
            self.running -= 1

    @staticmethod
    async def _drop(messages: AsyncIterable[bytes], left: int, on_bytes: Callable[[int], None] | None) -> None:
        async for message in messages:
            left -= len(message)
            if on_bytes is not None:
                on_bytes(len(message))
            if left < 0:
                return
