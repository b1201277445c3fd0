"""Give the memory that bursts of requests leave behind back to the operating system.

A server holds ~400k long-lived Python objects (torch, hivemind, gRPC, the model). Python's collector scans the oldest
generation only once the objects that survived into it grew by a quarter of those: cyclic garbage that lives a few
seconds (a refused call's exception, its traceback and frames, tied into a cycle by gRPC's handler) piles up for long,
and a full collection then takes ~200 ms. `settle` moves what exists once the server serves to the collector's
permanent generation (`gc.freeze`, as Python's documentation suggests for servers), so later garbage is found soon and
cheaply.

glibc's malloc keeps freed memory in its arenas (one per thread that allocates: gRPC's, the compute thread, the codec
pool) and returns little of it. Measured with `python -m tests.benchmarks.bench_flood` (a real server flooded with 48
concurrent 8 MiB requests per round, 2-core VM): RSS rose 500-830 MB above rest and kept rising from round to round,
though nothing held the memory: `malloc_trim(0)` after a round brought an in-process server back to within ~100 MB
of rest, round after round. So a server trims once enough request bytes have passed through it since the last trim.
"""

from __future__ import annotations

import asyncio
import ctypes
import ctypes.util
import gc
import logging
from collections.abc import Callable

logger = logging.getLogger(__name__)
TRIM_AFTER_BYTES = 256 << 20  # request bytes received since the last trim that call for another
QUIET_TRIM_BYTES = 32 << 20  # ... or that do once no more arrive
CHECK_PERIOD_S = 1.0


def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's malloc_trim, or None where there is none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):
        return None
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def settle() -> None:
    """Once the server serves: what exists now lives as long as the process; the collector stops scanning it."""
    gc.collect()
    gc.freeze()


async def trim_forever(arrived: Callable[[], int], stop: asyncio.Event) -> None:
    """Every CHECK_PERIOD_S, trim the heap (on a worker thread) once TRIM_AFTER_BYTES of requests (`arrived()`, a
    running count of request bytes) came in since the last trim, or once requests stop coming after at least
    QUIET_TRIM_BYTES did: what a burst leaves behind is given back when it ends."""
    trim = _malloc_trim()
    if trim is None:
        logger.debug("no malloc_trim on this system: freed heap memory stays with the process")
        return
    trimmed_at = before = arrived()
    while True:
        try:
            await asyncio.wait_for(stop.wait(), CHECK_PERIOD_S)
            return
        except TimeoutError:
            pass
        now = arrived()
        since = now - trimmed_at
        if since >= TRIM_AFTER_BYTES or (since >= QUIET_TRIM_BYTES and now == before):
            trimmed_at = now
            await asyncio.to_thread(trim, 0)
        before = now
