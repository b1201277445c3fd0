"""How often an all-reduce round fails among peers that all stay up, by how its streams end: R rounds of G averagers
in a fixed group (StrictAverager and the exact runner, each peer on its own DHT node and p2pd daemon), with each
sender's stream to a reducer ended as hivemind ends it (the reducer closes right after its last averaged part; the
sender reads on until then) against as ours does (the sender closes once every part came back; the reducer holds the
stream until then: server/collab/compat/download.py `reply_linger_s`). `--load N` runs N busy loops beside them (CI's
machines are busy). A round fails one-sidedly when some peers end it and others do not.

    python -m tests.benchmarks.bench_rounds [--quick] [--peers G] [--rounds R] [--numel N] [--load N]
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import subprocess
import sys
import threading
import time

import torch
from hivemind.averaging.allreduce import AllReduceRunner

from dht.forking import forking
from dht.node import start_dht
from server.collab.compat.averager import StrictAverager
from server.collab.compat.runner import REPLY_LINGER_S, ExactAllReduceRunner
from tests.benchmarks import common


class HivemindClose(ExactAllReduceRunner):
    """Our exact runner, but a sender reads each reducer's stream until the reducer closes it (hivemind's)."""

    async def _from_reducer(self, peer_id) -> None:
        await AllReduceRunner._communicate_with_peer(self, peer_id)


VARIANTS = {  # name -> (runner, how long a reducer holds a stream after its last part)
    "hivemind's: the reducer closes after its last part": (HivemindClose, 0.0),
    "ours: the sender closes once every part came back": (ExactAllReduceRunner, REPLY_LINGER_S),
}


def run_rounds(name: str, peers: int, rounds: int, numel: int, part_bytes: int, timeout: float) -> dict:
    """`rounds` rounds of a fresh fixed group of `peers` averagers: how many failed, one-sidedly, and how long each
    took (ms, rounds every peer ended)."""
    runner, linger = VARIANTS[name]
    gen = torch.Generator().manual_seed(0)
    prefix = f"bench_rounds_{time.monotonic_ns()}"
    dhts: list = []
    averagers: list[StrictAverager] = []
    try:  # everything started so far ends, also when a later start fails
        dhts.append(start_dht())
        for _ in range(peers):
            dhts.append(dht := start_dht([str(m) for m in dhts[0].get_visible_maddrs()]))
            averagers.append(
                StrictAverager(
                    averaged_tensors=[torch.randn(numel, generator=gen)],
                    dht=dht,
                    prefix=prefix,
                    start=False,
                    min_matchmaking_time=1.0,
                    request_timeout=0.5,
                    allreduce_timeout=timeout,
                    part_size_bytes=part_bytes,
                )
            )
            averagers[-1].runner_type, averagers[-1].reply_linger_s = runner, linger  # before the processes fork
        with forking():
            for averager in averagers:
                averager.run_in_background(await_ready=True)
        ids = [str(a.peer_id) for a in averagers]
        for averager in averagers:
            averager.fix_group([i for i in ids if i != str(averager.peer_id)], gather_timeout=timeout)
        failed = one_sided = 0
        took = []
        for r in range(rounds):
            ended = [False] * peers
            started = time.monotonic()
            threads = [threading.Thread(target=_step, args=(averagers[i], ended, i, timeout)) for i in range(peers)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(4 * timeout)
            if all(ended):
                took.append(1000 * (time.monotonic() - started))
            else:
                failed += 1
                one_sided += any(ended)
            if (r + 1) % max(1, rounds // 5) == 0:
                common.log(f"{name}: {r + 1}/{rounds} rounds, {failed} failed ({one_sided} one-sidedly)")
        return {"rounds": rounds, "failed": failed, "one_sided": one_sided, "round_ms": common.summary(took)}
    finally:
        for averager in averagers:
            averager.shutdown()
        for dht in reversed(dhts):
            dht.shutdown()


def _step(averager: StrictAverager, ended: list[bool], i: int, timeout: float) -> None:
    with contextlib.suppress(Exception):
        ended[i] = isinstance(averager.step(weight=1.0, timeout=2 * timeout, allow_retries=False), dict)


def main(argv: list[str] | None = None) -> dict:
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--peers", type=int, default=3)
    p.add_argument("--rounds", type=int, default=None, help="rounds per variant and repeat (default 400, quick 100)")
    p.add_argument("--numel", type=int, default=300_000, help="values each peer averages")
    p.add_argument("--part-bytes", type=int, default=1 << 18, help="hivemind's part_size_bytes (parts per reducer)")
    p.add_argument("--timeout", type=float, default=5.0, help="all-reduce and gather timeout, seconds")
    p.add_argument("--load", type=int, default=0, help="busy loops running beside the peers")
    args = p.parse_args(argv)
    common.exit_on_sigterm()
    # why a round failed, as each peer's process says it (they fork from here)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("server.collab.compat").setLevel(logging.INFO)
    repeats = args.repeats or (1 if args.quick else 2)
    rounds = args.rounds or (100 if args.quick else 400)
    common.log(
        f"bench_rounds: {args.peers} peers, {args.numel} values, parts of {args.part_bytes} B, {rounds} rounds x "
        f"{repeats} per variant, {args.load} busy loop(s)"
    )
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(args.load)]
    results: dict[str, list[dict]] = {name: [] for name in VARIANTS}
    try:
        names = list(VARIANTS)
        for r in range(repeats):
            for name in names[r % 2 :] + names[: r % 2]:
                results[name].append(run_rounds(name, args.peers, rounds, args.numel, args.part_bytes, args.timeout))
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    rows = []
    for name, runs in results.items():
        total = sum(run["rounds"] for run in runs)
        failed, one_sided = sum(run["failed"] for run in runs), sum(run["one_sided"] for run in runs)
        ms = statistics.median(run["round_ms"]["median"] for run in runs)
        rows.append([f"{failed}/{total}", f"{one_sided}", f"{1000 * failed / total:.1f}", f"{ms:.0f}", name])
    common.table(
        f"all-reduce rounds of {args.peers} peers in a fixed group ({args.numel} values, {args.load} busy loops)",
        ["failed", "one-sided", "per 1000", "round ms", "streams end"],
        rows,
    )
    result = {"benchmark": "rounds", "hardware": common.hardware(), **vars(args), "results": results}
    common.write_json(args.out, "rounds", result)
    return result


if __name__ == "__main__":
    main()
