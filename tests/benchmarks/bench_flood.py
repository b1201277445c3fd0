"""Flood one real stage server (its own process, with its DHT node and averagers) with bursts of concurrent large
requests, round after round: how far its memory (RSS) grows, whether it keeps growing from round to round, and whether
every request is answered (served or refused) within its deadline. Before the rounds, one valid Forward is sent alone
(twice): the peak it reaches is what serving one full-batch request costs (its computation's working memory); the
table gives each round's peak against it too, the flood's own cost.

Each round sends `--concurrency` calls at once, in equal parts: valid Forwards of `--mb` MiB of hidden states; Backwards
of twice that carrying no admission from stage 0 (read whole, then refused); and calls that send a header declaring
`--mb` MiB, one chunk of it, and then nothing until their deadline (a slow or hostile caller holding buffers).

    python -m tests.benchmarks.bench_flood              # 4 rounds of 48 calls of 8 MiB
    python -m tests.benchmarks.bench_flood --rounds 2 --concurrency 24
"""

from __future__ import annotations

import asyncio
import collections
import os
import threading
import time

import grpc
import torch

from swarm.compression import get_codec
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.frames import encode_frame, iter_frames
from swarm.protocol.rpc import CHUNK_BYTES, PROTOCOL_VERSION, SERVICE, aio_channel
from swarm.protocol.tensors import encode_tensor
from tests.benchmarks import common
from tests.benchmarks.swarmrun import new_swarm, wait_ready

D_MODEL, SEQ = 128, 128  # local_debug


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


class RssSampler:
    """The peak RSS of a process between start and stop, sampled every 50 ms on a thread."""

    def __init__(self, pid: int):
        self.pid, self.peak = pid, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.peak = max(self.peak, rss_mb(self.pid))

    def __enter__(self) -> RssSampler:
        self.peak = rss_mb(self.pid)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join(2)


def calls(batch: int, seed: int) -> dict[str, list[bytes]]:
    """One request of each kind, as serialized frames."""
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(batch, SEQ, D_MODEL, generator=gen)
    none = get_codec("none")

    def meta() -> pb.CallMeta:
        return pb.CallMeta(protocol_version=PROTOCOL_VERSION, microbatch_id=f"flood-{seed}", stage=1)

    forward = list(iter_frames(meta(), [encode_tensor("inputs", hidden, none)]))
    grads = torch.randn(batch, SEQ, D_MODEL, generator=gen)
    backward = list(
        iter_frames(meta(), [encode_tensor("inputs", hidden, none), encode_tensor("grad_outputs", grads, none)])
    )
    header = encode_tensor("inputs", hidden, none).header
    stalled = [encode_frame(meta(), header, bytes(CHUNK_BYTES))]  # then nothing: the rest never comes
    return {"forward": forward, "backward-unsigned": backward, "stalled": stalled}


async def one_call(channel: grpc.aio.Channel, method: str, frames: list[bytes], stall: bool, deadline: float):
    """-> (status name, seconds until the server answered)."""
    rpc = channel.stream_stream(f"/{SERVICE}/{method}")

    async def requests():
        for frame in frames:
            yield frame
        if stall:
            await asyncio.sleep(deadline + 5)

    started = time.monotonic()
    try:
        async for _ in rpc(requests(), timeout=deadline):
            pass
        return "OK", time.monotonic() - started
    except grpc.aio.AioRpcError as e:
        return e.code().name, time.monotonic() - started


async def flood(address: str, kinds: dict[str, list[bytes]], concurrency: int, deadline: float) -> list:
    async with aio_channel(address) as channel:
        jobs = []
        for i in range(concurrency):
            kind = list(kinds)[i % len(kinds)]
            method = "Forward" if kind != "backward-unsigned" else "Backward"
            jobs.append(one_call(channel, method, kinds[kind], kind == "stalled", deadline))
        results = await asyncio.gather(*jobs)
    return [(list(kinds)[i % len(kinds)], *r) for i, r in enumerate(results)]


def main() -> None:
    p = common.parser(__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=None, help="flood rounds (default: 4; --quick: 2)")
    p.add_argument("--concurrency", type=int, default=None, help="calls sent at once per round (default 48; quick 24)")
    p.add_argument("--mb", type=int, default=8, help="MiB of hidden states per Forward")
    p.add_argument("--deadline", type=float, default=30.0, help="each call's deadline, seconds")
    p.add_argument("--settle", type=float, default=5.0, help="seconds between rounds before RSS is read")
    p.add_argument(
        "--forward-chunk-samples", type=int, default=-1, help="the server's (-1: its default; 0: whole Forwards)"
    )
    args = p.parse_args()
    args.rounds = args.rounds or (2 if args.quick else 4)
    args.concurrency = args.concurrency or (24 if args.quick else 48)
    common.exit_on_sigterm()
    batch = max(1, (args.mb << 20) // (SEQ * D_MODEL * 4))
    kinds = calls(batch, seed=0)
    port = common.free_port()
    address = f"127.0.0.1:{port}"
    with new_swarm(args.out, "flood") as swarm:
        swarm.start_dht()
        flags = ["--port", str(port), "--max-batch-size", str(batch), "--no-check-reachability", "--no-rebalance"]
        flags += ["--forward-chunk-samples", str(args.forward_chunk_samples)]
        server = swarm.start_server("server1", 1, flags)
        wait_ready(swarm, {"server1": address})
        pid = server.proc.pid
        start = rss_mb(pid)
        common.log(f"server pid {pid}: RSS {start:.0f} MB at rest; {args.rounds} rounds of {args.concurrency} calls")
        # what serving one valid request at the stage's full batch costs by itself: its computation's working memory,
        # which glibc keeps for the next one (the flood's own cost is what comes on top)
        alone = []
        for _ in range(2):
            with RssSampler(pid) as sampler:
                asyncio.run(flood(address, {"forward": kinds["forward"]}, 1, args.deadline))
            alone.append(sampler.peak)
        alone_peak = max(alone)
        common.log(f"one valid Forward alone: peak RSS {alone_peak:.0f} MB ({alone_peak - start:+.0f} MB above rest)")
        rows, afters = [], []
        for r in range(args.rounds):
            with RssSampler(pid) as sampler:
                t0 = time.monotonic()
                results = asyncio.run(flood(address, kinds, args.concurrency, args.deadline))
                took = time.monotonic() - t0
            time.sleep(args.settle)
            after = rss_mb(pid)
            afters.append(after)
            statuses = collections.Counter(status for _, status, _ in results)
            late = sum(seconds > args.deadline + 1 for _, _, seconds in results)
            slowest = max(seconds for _, _, seconds in results)
            rows.append(
                [
                    r + 1,
                    f"{took:.1f}",
                    " ".join(f"{k}:{v}" for k, v in sorted(statuses.items())),
                    f"{slowest:.1f}",
                    late,
                    f"{sampler.peak:.0f}",
                    f"{sampler.peak - alone_peak:+.0f}",
                    f"{after:.0f}",
                    f"{after - start:+.0f}",
                ]
            )
            common.log(f"round {r + 1}: {rows[-1]}")
            by_kind = collections.defaultdict(collections.Counter)
            for kind, status, _ in results:
                by_kind[kind][status] += 1
            common.log("  by kind: " + "; ".join(f"{k} {dict(v)}" for k, v in by_kind.items()))
        common.table(
            f"flood: {args.concurrency} concurrent calls per round, {args.mb} MiB each, deadline {args.deadline:.0f}s, "
            f"--forward-chunk-samples {args.forward_chunk_samples} "
            f"(RSS at rest {start:.0f} MB; one valid Forward alone peaks at {alone_peak:.0f} MB)",
            [
                "round",
                "s",
                "statuses",
                "slowest s",
                "past deadline",
                "peak RSS MB",
                "vs one alone",
                "RSS after MB",
                "vs rest",
            ],
            rows,
        )
        steps = [b - a for a, b in zip(afters, afters[1:], strict=False)]
        print(f"growth of RSS after each round vs the one before: {', '.join(f'{s:+.0f}' for s in steps)} MB")
        common.write_json(
            args.out,
            "flood",
            {
                "hardware": common.hardware(),
                "rest_mb": start,
                "alone_peak_mb": alone_peak,
                "rows": rows,
                "pid": os.getpid(),
            },
        )


if __name__ == "__main__":
    main()
