"""Heterogeneous routing: does the trainer's IWRR give each server of a stage work in proportion to its speed, and does
the stage then deliver the sum of its servers' capacities?

A live 2-stage swarm (`LocalSwarm`): stage 0 has 2 fast servers; stage 1 (the last: loss and backward) has 3 servers
slowed 1x, 2x and 4x (`--slowdown`), times a common `--base-slowdown` so that stage 1 is the bottleneck and its three
servers together need well under the machine's 2 cores. A server's `--slowdown` N makes each backward last N x the
fastest it has done that work, sleeping the rest (server/compute.py, `Timing.timed`): its speed does not move
with CPU contention as long as contention keeps its real compute under N x uncontended, which a base of 1 would not
(the 1x server would compute all the time and fight the others for the CPU). Each round:

1. Capacity alone: this process drives each stage-1 server by itself (Backward calls with the trainer's codec, enough
   concurrency to keep its queue non-empty) for a few seconds: samples/s.
2. The swarm: one trainer with `--in-flight` microbatches; after a warm-up (its router learns the servers' speeds),
   each server's share of microbatches over a window comes from the Info RPC's `samples_processed`, and the stage's
   throughput from the sum of those counters over the window's wall time.

Shares are compared with the capacity shares alone, with the capacity shares in the swarm (each server's own EMA of
samples/s, slowdown included, which also moves with CPU contention), and with the nominal 4/7, 2/7, 1/7; the stage's
throughput with both sums. A poller samples each server's queue (Info) during the window: "busy" 1.0 means the
server never ran dry, so a shortfall against capacities alone is the servers being slower in the swarm (CPU shared
with stage 0, the trainer and anything else on the machine), not routing. The servers' all-reduce is kept out of the window (`--samples-per-step` larger than the
run), so that the number is about routing.

    python -m tests.benchmarks.bench_routing [--quick] [--base-slowdown K] [--in-flight N]
"""

from __future__ import annotations

import asyncio
import os
import shlex
import time

import torch

from swarm.compression import CompressionPolicy
from swarm.config import model_config
from swarm.protocol.tensors import WireStats
from tests.benchmarks import common, swarmrun
from trainer.client import StageClient

FACTORS = (1, 2, 4)
TARGET_THROUGHPUT = 0.95
TARGET_SHARE = 0.05  # absolute


async def capacities(
    addresses: dict[str, str],
    stage: int,
    d_model: int,
    seq: int,
    batch: int,
    codec: str,
    seconds: float,
    concurrency: int = 2,
) -> dict[str, float]:
    """Samples/s each server sustains alone on last-stage Backward calls (after a warm-up of all of them), one server
    at a time, `concurrency` calls in flight so that its queue never runs dry."""
    client = StageClient(CompressionPolicy.for_wire(codec), WireStats(), max_tensor_bytes=1 << 30)
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "inputs": torch.randn(batch, seq, d_model, generator=gen),
        "labels": torch.randint(0, 256, (batch, seq), generator=gen),
    }
    shape = (batch, seq, d_model)

    async def call(address: str) -> None:
        await client.call(address, "Backward", stage, "capacity", tensors, shape, 60)

    async def warm_up(address: str) -> None:
        for _ in range(3):  # the first calls import codecs and allocate
            await call(address)

    async def alone(address: str) -> float:
        done, start = 0, time.monotonic()

        async def loop() -> None:
            nonlocal done
            while time.monotonic() - start < seconds:
                await call(address)
                done += batch

        await asyncio.gather(*(loop() for _ in range(concurrency)))
        return done / (time.monotonic() - start)

    try:
        await asyncio.gather(*(warm_up(a) for a in addresses.values()))
        return {name: await alone(address) for name, address in addresses.items()}
    finally:
        await client.close()


def main(argv: list[str] | None = None) -> dict:
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="local_debug")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument(
        "--base-slowdown",
        type=float,
        default=4.0,
        help="every stage-1 server is this much slower, times " "its own 1/2/4 (default 4)",
    )
    p.add_argument("--in-flight", type=int, default=16)
    p.add_argument("--codec", default="blockwise8")
    p.add_argument("--window", type=float, default=None, help="seconds measured per swarm run")
    p.add_argument("--server-args", default="", help="extra flags for every server, e.g. '--solo'")
    args = p.parse_args(argv)
    common.exit_on_sigterm()
    repeats = args.repeats or (1 if args.quick else 3)
    window = args.window or (10.0 if args.quick else 25.0)
    cap_seconds = 3.0 if args.quick else 6.0
    cfg = model_config(args.preset, n_stages=2)
    model_flags = ["--preset", args.preset, "--n-stages", "2"]
    extra = ["--samples-per-step", str(10**9), *shlex.split(args.server_args)]
    names = [f"server-s1-x{f}" for f in FACTORS]
    rounds = []
    swarm = swarmrun.new_swarm(args.out, "routing")
    with swarm:
        swarm.start_dht()
        corpus = swarmrun.small_corpus(swarm.log_dir / "corpus.txt")
        addresses = {}
        for r in range(2):
            port = common.free_port()
            swarm.start_server(f"server-s0-r{r}", 0, swarmrun.server_args(port, "routing", [*model_flags, *extra]))
            addresses[f"server-s0-r{r}"] = f"127.0.0.1:{port}"
        for name, f in zip(names, FACTORS, strict=True):
            port = common.free_port()
            swarm.start_server(
                name,
                1,
                swarmrun.server_args(
                    port, "routing", [*model_flags, *extra, "--slowdown", str(f * args.base_slowdown)]
                ),
            )
            addresses[name] = f"127.0.0.1:{port}"
        swarmrun.wait_ready(swarm, addresses)
        common.log("servers ready")

        for r in range(repeats):
            common.log(f"round {r}: capacity of each stage-1 server alone")
            capacity = asyncio.run(
                capacities(
                    {n: addresses[n] for n in names},
                    1,
                    cfg.d_model,
                    cfg.max_seq_len,
                    args.batch_size,
                    args.codec,
                    cap_seconds,
                )
            )
            common.log(f"round {r}: capacities {({n: round(c, 2) for n, c in capacity.items()})}")
            counters: dict[str, dict] = {}

            poller = swarmrun.BusyPoller({n: addresses[n] for n in names})

            def read(tag: str, counters: dict = counters, poller=poller) -> None:
                infos = {n: swarmrun.info(addresses[n]) for n in names}
                counters[tag] = {"t": time.monotonic(), **{n: i.samples_processed for n, i in infos.items()}}
                counters[f"{tag}_cpu"] = (*common.machine_cpu_seconds(), swarmrun.cpu_seconds(swarm))
                counters[f"{tag}_ema"] = {n: i.throughput for n, i in infos.items()}
                if tag == "start":
                    poller.start()
                else:
                    counters["busy"] = poller.stop()

            common.log(f"round {r}: swarm, trainer in-flight {args.in_flight}")
            trainer = swarmrun.measure_trainer(
                swarm,
                f"trainer-{r}",
                [
                    "--swarm-name",
                    "routing",
                    *model_flags,
                    "--batch-size",
                    str(args.batch_size),
                    "--in-flight",
                    str(args.in_flight),
                    "--codec",
                    args.codec,
                    "--data",
                    corpus,
                ],
                window=window,
                warmup_steps=3 * args.in_flight,
                between=read,
            )
            seconds = counters["end"]["t"] - counters["start"]["t"]
            busy, total, ours = (b - a for a, b in zip(counters["start_cpu"], counters["end_cpu"], strict=True))
            done = {n: counters["end"][n] - counters["start"][n] for n in names}
            total = sum(done.values())
            rounds.append(
                {
                    "capacity_alone": capacity,
                    "samples_in_window": done,
                    "window_s": seconds,
                    "stage_throughput": total / seconds,
                    "capacity_sum": sum(capacity.values()),
                    "throughput_vs_capacity": total / seconds / sum(capacity.values()),
                    "share": {n: done[n] / total for n in names},
                    "capacity_share": {n: capacity[n] / sum(capacity.values()) for n in names},
                    "capacity_share_in_swarm": {
                        n: v / sum(counters["end_ema"].values()) for n, v in counters["end_ema"].items()
                    },
                    "busy_fraction": counters["busy"],
                    "trainer": trainer,
                    "capacity_in_swarm": counters["end_ema"],  # the servers' own EMA of samples/s (slowdown included)
                    "throughput_vs_capacity_in_swarm": total / seconds / sum(counters["end_ema"].values()),
                    # over the window, in cores: the whole machine's CPU use, and this benchmark's swarm's (the rest is
                    # other processes on the machine, competing with the swarm)
                    "machine_cores_busy": busy / seconds,
                    "swarm_cores_busy": ours / seconds,
                    "cores": os.cpu_count(),
                    "load_average_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
                }
            )
            common.log(
                f"round {r}: shares {({n: round(v, 3) for n, v in rounds[-1]['share'].items()})}, busy "
                f"{({n: round(v, 2) for n, v in counters['busy'].items()})}, cores busy: machine "
                f"{busy / seconds:.2f} of {os.cpu_count()}, this swarm {ours / seconds:.2f}"
            )

    nominal = {n: (1 / f) / sum(1 / g for g in FACTORS) for n, f in zip(names, FACTORS, strict=True)}
    rows, report = [], {"servers": {}}
    for n, f in zip(names, FACTORS, strict=True):
        share = common.summary([x["share"][n] for x in rounds])
        cap_share = common.summary([x["capacity_share"][n] for x in rounds])
        err = common.summary([x["share"][n] - x["capacity_share"][n] for x in rounds])
        cap = common.summary([x["capacity_alone"][n] for x in rounds])
        busy = common.summary([x["busy_fraction"][n] for x in rounds])
        cap_share_in = common.summary([x["capacity_share_in_swarm"][n] for x in rounds])
        report["servers"][n] = {
            "slowdown": f * args.base_slowdown,
            "share": share,
            "capacity_share": cap_share,
            "share_minus_capacity_share": err,
            "capacity_alone": cap,
            "nominal_share": nominal[n],
            "busy_fraction": busy,
            "capacity_share_in_swarm": cap_share_in,
        }
        rows.append(
            [
                common.fmt(err, 2, 100),
                n,
                f"{f * args.base_slowdown:g}x",
                common.fmt(share, 3, 100),
                common.fmt(cap_share, 3, 100),
                common.fmt(cap_share_in, 3, 100),
                f"{nominal[n] * 100:.1f}",
                common.fmt(cap),
                common.fmt(busy, 2),
            ]
        )
    common.table(
        f"stage 1 servers' share of microbatches, {window:.0f}s windows, median [min-max] of {repeats} round(s)",
        [
            "share-capacity alone (pp)",
            "server",
            "slowdown",
            "share %",
            "capacity share alone %",
            "capacity share in swarm %",
            "nominal %",
            "alone samples/s",
            "busy",
        ],
        rows,
    )
    thr = common.summary([x["throughput_vs_capacity"] for x in rounds])
    report["throughput_vs_capacity_sum"] = thr
    thr_in = common.summary([x["throughput_vs_capacity_in_swarm"] for x in rounds])
    report["throughput_vs_capacity_in_swarm"] = thr_in
    report["capacity_in_swarm_sum"] = common.summary([sum(x["capacity_in_swarm"].values()) for x in rounds])
    report["stage_throughput"] = common.summary([x["stage_throughput"] for x in rounds])
    report["capacity_sum"] = common.summary([x["capacity_sum"] for x in rounds])
    report["machine_cores_busy"] = common.summary([x["machine_cores_busy"] for x in rounds])
    report["swarm_cores_busy"] = common.summary([x["swarm_cores_busy"] for x in rounds])
    common.table(
        "stage 1 throughput against the sum of its servers' capacities, alone (driven by this process before "
        "the run) and in the swarm (each server's own EMA of samples/s at the window's end); cores busy in "
        f"the window, of {os.cpu_count()}: the whole machine's and this swarm's",
        [
            "throughput/sum alone",
            "throughput/sum in swarm",
            "stage samples/s",
            "sum alone",
            "sum in swarm",
            "machine cores busy",
            "swarm cores busy",
        ],
        [
            [
                common.fmt(thr),
                common.fmt(thr_in),
                common.fmt(report["stage_throughput"]),
                common.fmt(report["capacity_sum"]),
                common.fmt(report["capacity_in_swarm_sum"]),
                common.fmt(report["machine_cores_busy"], 2),
                common.fmt(report["swarm_cores_busy"], 2),
            ]
        ],
    )
    worst = max(abs(x["share"][n] - x["capacity_share"][n]) for x in rounds for n in names)
    worst_in = max(abs(x["share"][n] - x["capacity_share_in_swarm"][n]) for x in rounds for n in names)
    print(
        f"throughput {thr['median']:.3f} of the sum of capacities alone, {thr_in['median']:.3f} of the sum in the swarm"
        f" (target {TARGET_THROUGHPUT}); worst share error {worst * 100:.1f} pp against capacities alone, "
        f"{worst_in * 100:.1f} pp against capacities in the swarm (target {TARGET_SHARE * 100:.0f})"
    )
    result = {
        "benchmark": "routing",
        "hardware": common.hardware(),
        "model": model_flags,
        "batch_size": args.batch_size,
        "base_slowdown": args.base_slowdown,
        "factors": FACTORS,
        "in_flight": args.in_flight,
        "codec": args.codec,
        "window_s": window,
        "repeats": repeats,
        "server_args": extra,
        "rounds": rounds,
        **report,
        "targets": {"throughput": TARGET_THROUGHPUT, "share_abs": TARGET_SHARE},
        "load_average_1m_at_end": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
    }
    common.write_json(args.out, "routing", result)
    return result


if __name__ == "__main__":
    main()
