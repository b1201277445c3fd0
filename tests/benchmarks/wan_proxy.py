"""User-space WAN emulation (tc netem is not available): an asyncio TCP proxy that delays every byte by RTT/2 in each
direction and paces each direction through a token bucket.

Each route (listen port -> upstream address) is one emulated link: its two directions each have their own token bucket
(rate, burst), shared by all connections of the route. A chunk read at time t leaves the bucket at the time its tokens
are available (t if the bucket holds enough, else t + debt/rate) and is written out RTT/2 later; chunks stay in
order. New connections also wait one RTT (the TCP handshake). What it does not emulate: packet loss, jitter, and TCP's
own window and slow start on a long path (the sockets on both sides are loopback sockets); each direction buffers at
most `max_queue_bytes` (then the sender is back-pressured by loopback TCP).

Settings can change while it runs (`set`); bytes already queued keep the timing they were given.

    python -m tests.benchmarks.wan_proxy --route 9000=127.0.0.1:9001 --rtt-ms 100 --rate-mbit 100
    python -m tests.benchmarks.wan_proxy --selftest      # measures RTT and rate through the proxy
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import threading
import time
from dataclasses import dataclass

CHUNK = 64 << 10


@dataclass
class Shaping:
    rtt_ms: float = 0.0
    rate_mbit: float = 0.0  # per direction; 0: unlimited
    burst_bytes: int = 64 << 10
    max_queue_bytes: int = 32 << 20

    @property
    def one_way_s(self) -> float:
        return self.rtt_ms / 2000.0

    @property
    def rate_bytes(self) -> float:
        return self.rate_mbit * 1e6 / 8


class TokenBucket:
    def __init__(self, shaping: Shaping):
        self.shaping = shaping
        self.tokens = float(shaping.burst_bytes)
        self.last = time.monotonic()

    def departure(self, n: int, now: float) -> float:
        """When `n` bytes read at `now` leave the bucket. Tokens may go negative: a debt that later chunks queue behind."""
        rate = self.shaping.rate_bytes
        if rate <= 0:
            self.tokens, self.last = float(self.shaping.burst_bytes), now
            return now
        self.tokens = min(float(self.shaping.burst_bytes), self.tokens + (now - self.last) * rate)
        self.last = now
        self.tokens -= n
        return now if self.tokens >= 0 else now + (-self.tokens) / rate


async def _pump(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, bucket: TokenBucket, shaping: Shaping, counters: dict
) -> None:
    queue: asyncio.Queue[tuple[float, bytes] | None] = asyncio.Queue()
    room = asyncio.Condition()
    queued = 0

    async def deliver() -> None:
        nonlocal queued
        while (item := await queue.get()) is not None:
            at, data = item
            if (wait := at - time.monotonic()) > 0:
                await asyncio.sleep(wait)
            writer.write(data)
            await writer.drain()
            counters["bytes"] += len(data)
            async with room:
                queued -= len(data)
                room.notify_all()
        if writer.can_write_eof():
            with contextlib.suppress(OSError):
                writer.write_eof()

    def has_room() -> bool:
        return queued < shaping.max_queue_bytes or delivery.done()

    delivery = asyncio.create_task(deliver())
    try:
        while data := await reader.read(CHUNK):
            async with room:
                await room.wait_for(has_room)
                if delivery.done():
                    break
                queued += len(data)
            now = time.monotonic()
            queue.put_nowait((bucket.departure(len(data), now) + shaping.one_way_s, data))
    except (ConnectionError, OSError):
        pass
    finally:
        queue.put_nowait(None)
        with contextlib.suppress(ConnectionError, OSError):
            await delivery


class WanProxy:
    """Routes {listen_port: (host, port)} on 127.0.0.1, all shaped alike. Runs on the caller's event loop."""

    def __init__(self, routes: dict[int, tuple[str, int]], shaping: Shaping | None = None, host: str = "127.0.0.1"):
        self.routes, self.host = routes, host
        self.shaping = shaping or Shaping()
        self.buckets = {port: (TokenBucket(self.shaping), TokenBucket(self.shaping)) for port in routes}
        self.counters = {port: {"up": {"bytes": 0}, "down": {"bytes": 0}} for port in routes}
        self.servers: list[asyncio.base_events.Server] = []
        self.connections: set[asyncio.Task] = set()

    def set(self, rtt_ms: float, rate_mbit: float) -> None:
        self.shaping.rtt_ms, self.shaping.rate_mbit = rtt_ms, rate_mbit

    async def start(self) -> None:
        for port in self.routes:
            server = await asyncio.start_server(lambda r, w, port=port: self._accept(port, r, w), self.host, port)
            self.servers.append(server)

    async def stop(self) -> None:
        for server in self.servers:
            server.close()
        for task in list(self.connections):
            task.cancel()
        await asyncio.gather(*self.connections, return_exceptions=True)
        for server in self.servers:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 2)

    async def _accept(self, port: int, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        self.connections.add(task)
        upstream_w = None
        try:
            await asyncio.sleep(self.shaping.rtt_ms / 1000.0)  # the handshake crosses the link once each way
            upstream_r, upstream_w = await asyncio.open_connection(*self.routes[port])
            up, down = self.buckets[port]
            await asyncio.gather(
                _pump(client_r, upstream_w, up, self.shaping, self.counters[port]["up"]),
                _pump(upstream_r, client_w, down, self.shaping, self.counters[port]["down"]),
            )
        except (ConnectionError, OSError, asyncio.CancelledError):
            pass  # a closed connection, or the proxy stopping: this task is its connection's own, nobody awaits it
        finally:
            for w in (client_w, upstream_w):
                if w is not None:
                    w.close()
            self.connections.discard(task)


class ProxyThread:
    """A WanProxy on its own event loop in a daemon thread, driven from synchronous code. Use as a context manager."""

    def __init__(self, routes: dict[int, tuple[str, int]], shaping: Shaping | None = None):
        self.proxy = WanProxy(routes, shaping)
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="wan-proxy", daemon=True)

    def __enter__(self) -> ProxyThread:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.proxy.start(), self.loop).result(10)
        return self

    def __exit__(self, *exc) -> None:
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self.proxy.stop(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()

    def set(self, rtt_ms: float, rate_mbit: float) -> None:
        self.loop.call_soon_threadsafe(self.proxy.set, rtt_ms, rate_mbit)


# ------------------------------------------------------------------------------------------------------- self-test
async def _echo(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    with contextlib.suppress(ConnectionError, OSError):
        while data := await reader.read(CHUNK):
            writer.write(data)
            await writer.drain()
    writer.close()


async def _sink(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    total = 0
    with contextlib.suppress(ConnectionError, OSError):
        while data := await reader.read(CHUNK):
            total += len(data)
    writer.write(total.to_bytes(8, "big"))
    await writer.drain()
    writer.close()


async def measure(rtt_ms: float, rate_mbit: float, n_bytes: int = 16 << 20, pings: int = 10) -> dict:
    """RTT of a 1-byte ping-pong and the rate of a one-way bulk transfer, both through the proxy."""
    from tests.benchmarks.common import free_port  # lazily: keeps this module free of torch for `--route` use

    echo = await asyncio.start_server(_echo, "127.0.0.1", 0)
    sink = await asyncio.start_server(_sink, "127.0.0.1", 0)
    routes = {free_port(): ("127.0.0.1", s.sockets[0].getsockname()[1]) for s in (echo, sink)}
    (echo_port, sink_port) = routes
    proxy = WanProxy(routes, Shaping(rtt_ms=rtt_ms, rate_mbit=rate_mbit))
    await proxy.start()
    try:
        r, w = await asyncio.open_connection("127.0.0.1", echo_port)
        times = []
        for _ in range(pings):
            start = time.monotonic()
            w.write(b"x")
            await w.drain()
            await r.readexactly(1)
            times.append(time.monotonic() - start)
        w.close()
        r, w = await asyncio.open_connection("127.0.0.1", sink_port)
        w.write(b"\0")  # open the connection (its handshake delay) before the clock starts
        await w.drain()
        await asyncio.sleep(rtt_ms / 1000 + 0.05)
        start = time.monotonic()
        w.write(bytes(n_bytes))
        await w.drain()
        w.write_eof()
        got = int.from_bytes(await r.readexactly(8), "big")
        seconds = time.monotonic() - start - rtt_ms / 1000  # the last byte's one-way delay, and the count's
        w.close()
        assert got == n_bytes + 1, got
        times.sort()
        return {
            "rtt_ms_set": rtt_ms,
            "rate_mbit_set": rate_mbit,
            "rtt_ms_measured": times[len(times) // 2] * 1e3,
            "rate_mbit_measured": n_bytes * 8 / seconds / 1e6,
        }
    finally:
        await proxy.stop()
        echo.close()
        sink.close()


async def selftest(settings: list[tuple[float, float]]) -> list[dict]:
    return [await measure(rtt, rate) for rtt, rate in settings]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--route", action="append", default=[], help="LISTEN_PORT=HOST:PORT (repeatable)")
    p.add_argument("--rtt-ms", type=float, default=0.0)
    p.add_argument("--rate-mbit", type=float, default=0.0, help="per direction and route; 0: unlimited")
    p.add_argument("--selftest", action="store_true", help="measure RTT and rate through the proxy, then exit")
    args = p.parse_args(argv)
    if args.selftest:
        for r in asyncio.run(selftest([(0, 0), (10, 0), (100, 100), (200, 500)])):
            print(r)
        return
    if not args.route:
        p.error("give at least one --route, or --selftest")
    routes = {}
    for spec in args.route:
        listen, upstream = spec.split("=")
        host, port = upstream.rsplit(":", 1)
        routes[int(listen)] = (host, int(port))

    async def run() -> None:
        proxy = WanProxy(routes, Shaping(rtt_ms=args.rtt_ms, rate_mbit=args.rate_mbit))
        await proxy.start()
        print(f"proxying {routes} with RTT {args.rtt_ms} ms, {args.rate_mbit or 'unlimited'} Mb/s", file=sys.stderr)
        try:
            await asyncio.Event().wait()
        finally:
            await proxy.stop()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(run())


if __name__ == "__main__":
    main()
