"""Stage all-reduce bytes as the kernel counts them: what the peers' libp2p daemons really send over TCP for rounds of
gradient averaging, against what the servers count (the codec's encoded sizes, `allreduce_bytes` in Info) and against
fp32, per all-reduce codec.

Two in-process peers of one stage (real DHT nodes, real hivemind averagers, the servers' own averaging code) average
seeded random gradients shaped like the stage's parameters for `--rounds` epochs, in a fixed group as servers do by
default (`--fixed-groups`), or found by hivemind's matchmaking (`--no-fixed-groups`). Before and after, `ss` reads the
bytes sent on every TCP socket of their p2pd processes (and the bootstrap node's): libp2p's framing, Noise encryption,
yamux, hivemind's protobuf messages and matchmaking's DHT traffic are all in that number; so is the DHT's background
traffic, which is measured over an idle window first and subtracted. Low-rank codecs run with no warm-up, so every
round is low-rank.

    python -m tests.benchmarks.bench_socket_bytes [--quick] [--d-model 512] [--rounds 8] [--codecs "none,acp rank 4"]
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import time
from pathlib import Path

import torch

from dht.reaper import descendants
from server.stage_server import StageServer
from swarm.config import model_config
from tests.benchmarks import common
from tests.peers import meet, stage_servers, start_server

CODECS = {  # name -> AveragingConfig fields
    "none": {"allreduce_codec": "none"},
    "fp16": {"allreduce_codec": "fp16"},
    "blockwise8": {"allreduce_codec": "blockwise8"},
    "acp rank 4": {"allreduce_codec": "acp", "allreduce_rank": 4},
    "acp rank 16": {"allreduce_codec": "acp", "allreduce_rank": 16},
    "powersgd rank 4": {"allreduce_codec": "powersgd", "allreduce_rank": 4},
}
QUICK = ("none", "blockwise8", "acp rank 4")
MATCHMADE = ("none", "acp rank 4")  # also measured with matchmaking (--no-fixed-groups)
_SOCKET = re.compile(r"users:\(\(\"p2pd\",pid=(\d+),fd=(\d+)\)\)")
_SENT = re.compile(r"bytes_sent:(\d+)")


def p2pd_pids() -> list[int]:
    """The p2pd daemons this process started (through its DHT nodes' children)."""

    def name(pid: int) -> str:
        try:
            return Path(f"/proc/{pid}/comm").read_text().strip()
        except OSError:  # it exited meanwhile
            return ""

    return [pid for pid in descendants(os.getpid()) if name(pid) == "p2pd"]


def tcp_sent(pids: list[int]) -> dict[tuple[int, int, str], int]:
    """(pid, fd, addresses) -> bytes sent, for every TCP socket of `pids` (`ss` reads the kernel's tcp_info)."""
    out = subprocess.run(["ss", "-tinpH"], capture_output=True, text=True, check=True).stdout
    found, wanted = {}, set(pids)
    lines = out.splitlines()
    for head, info in zip(lines, lines[1:], strict=False):
        socket, sent = _SOCKET.search(head), _SENT.search(info)
        if socket and sent and int(socket.group(1)) in wanted:
            found[(int(socket.group(1)), int(socket.group(2)), " ".join(head.split()[3:5]))] = int(sent.group(1))
    return found


def sent_between(before: dict, after: dict) -> tuple[int, int]:
    """(bytes sent between two readings, sockets that closed meanwhile: their last bytes are not counted)."""
    sent = sum(n - before.get(key, 0) for key, n in after.items())
    return sent, len(set(before) - set(after))


def gradients(server: StageServer, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(p.shape, generator=gen) * 1e-3 for p in server.worker.params]


async def one_codec(name: str, model, rounds: int, idle_s: float, fixed: bool) -> dict:
    async with stage_servers() as (peers, servers):
        pair = [await start_server(peers, model=model, stage=1, **settings(name)) for _ in range(2)]
        servers.extend(pair)
        await meet(*pair)
        pids = p2pd_pids()
        before = tcp_sent(pids)
        await asyncio.sleep(idle_s)
        idle, _ = sent_between(before, tcp_sent(pids))
        grads = [gradients(s, seed) for seed, s in enumerate(pair)]

        def average(i: int, e: int) -> bool:
            other = pair[1 - i].sdht.p2p_id  # with fixed groups: the group the stage's epoch code would pass
            group = {"group": lambda: [other], "group_size": 2} if fixed else {}
            return pair[i].collab.averaging.gradients.average(grads[i], 16, f"bench epoch {e}", e, **group) is not None

        async def epoch(e: int) -> bool:
            return all(await asyncio.gather(*(asyncio.to_thread(average, i, e) for i in range(2))))

        await epoch(0)  # connections opened, first factors drawn: not measured
        counted = [sum(s.collab.allreduce_bytes for s in pair), sum(s.collab.allreduce_fp32_bytes for s in pair)]
        before, started = tcp_sent(pids), time.monotonic()
        ok = [await epoch(e) for e in range(1, rounds + 1)]
        seconds = time.monotonic() - started
        wire, closed = sent_between(before, tcp_sent(pids))
        counted = [
            sum(s.collab.allreduce_bytes for s in pair) - counted[0],
            sum(s.collab.allreduce_fp32_bytes for s in pair) - counted[1],
        ]
    background = idle * seconds / idle_s
    return {
        "codec": name,
        "group": "fixed" if fixed else "matchmaking",
        "rounds_ok": sum(ok),
        "rounds": rounds,
        "seconds": seconds,
        # each server counts what it sends (averaging/butterfly_bytes): their sum is what all of them send
        "counted_sent": counted[0],
        "fp32_sent": counted[1],
        "wire_sent": wire - background,
        "background": background,
        "closed_sockets": closed,
        "parameters": sum(p.numel() for p in pair[0].worker.params),
    }


def settings(name: str) -> dict:
    return {**CODECS[name], "allreduce_warmup_epochs": 0, "averaging_timeout": 12.0, "matchmaking_time": 1.0}


def main(argv: list[str] | None = None) -> int:
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--d-model", type=int, default=512, help="model width (d_ff: 3x)")
    p.add_argument("--rounds", type=int, default=None, help="measured epochs per codec (default 8; --quick 4)")
    p.add_argument("--codecs", default=None, help=f"comma-separated, of {', '.join(CODECS)}")
    p.add_argument("--idle", type=float, default=5.0, help="seconds of DHT background traffic measured first")
    args = p.parse_args(argv)
    common.exit_on_sigterm()
    torch.set_num_threads(1)
    rounds = args.rounds or (4 if args.quick else 8)
    names = args.codecs.split(",") if args.codecs else list(QUICK if args.quick else CODECS)
    if unknown := set(names) - set(CODECS):
        p.error(f"unknown codecs {sorted(unknown)}; they are {', '.join(CODECS)}")
    model = model_config("local_debug", n_stages=3, d_model=args.d_model, d_ff=3 * args.d_model)
    runs = [(name, True) for name in names] + [(name, False) for name in names if name in MATCHMADE]
    results = []
    for name, fixed in runs:
        how = "a fixed group" if fixed else "matchmaking"
        common.log(f"{name}, {how}: two peers of stage 1 (d_model {args.d_model}), {rounds} rounds")
        results.append(r := asyncio.run(one_codec(name, model, rounds, args.idle, fixed)))
        common.log(
            f"{name}, {how}: {r['rounds_ok']}/{rounds} rounds, wire {r['wire_sent'] / 1e6:.2f} MB, counted "
            f"{r['counted_sent'] / 1e6:.2f} MB, fp32 {r['fp32_sent'] / 1e6:.2f} MB, background "
            f"{r['background'] / 1e3:.0f} kB"
        )
    common.table(
        f"Stage all-reduce, 2 peers, {rounds} rounds, {results[0]['parameters'] / 1e6:.2f}M parameters per stage: bytes "
        "sent by both peers' p2pd over TCP (DHT background subtracted) against the servers' count and fp32",
        [
            "codec",
            "group",
            "rounds ok",
            "wire MB/round",
            "counted MB/round",
            "wire / counted",
            "fp32 / wire",
            "s/round",
        ],
        [
            [
                r["codec"],
                r["group"],
                f"{r['rounds_ok']}/{r['rounds']}",
                f"{r['wire_sent'] / r['rounds'] / 1e6:.3f}",
                f"{r['counted_sent'] / r['rounds'] / 1e6:.3f}",
                f"{r['wire_sent'] / r['counted_sent']:.2f}" if r["counted_sent"] else "-",
                f"{r['fp32_sent'] / r['wire_sent']:.1f}x" if r["wire_sent"] > 0 else "-",
                f"{r['seconds'] / r['rounds']:.2f}",
            ]
            for r in results
        ],
    )
    if any(r["closed_sockets"] for r in results):
        print("some sockets closed during a measurement: their last bytes are missing from 'wire'")
    common.write_json(args.out, "socket_bytes", {"hardware": common.hardware(), "rounds": rounds, "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
