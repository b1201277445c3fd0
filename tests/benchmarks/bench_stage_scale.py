"""A stage of many peers: does a stage's throughput grow with its peers, and what does its control traffic cost?

A live 2-stage swarm (`LocalSwarm`, preset local_debug) per peer count N: N stage-0 servers each emulating a slow
device (`--slowdown`, 32 by default: each backward lasts 32 x its fastest, sleeping the rest, so that N of them share
the 2 cores), one full-speed stage-1 server, one trainer keeping 2N+2 microbatches in flight; `--samples-per-step 128
--lookahead-samples 64`, no rebalancing. A fresh swarm for every N, in the order given. After a warm-up, over one
window:

- samples/s (the trainer's own count), and against N x the samples/s of N = 1 (1.0: the stage scales linearly);
- Progress calls per stage-0 sample: the calls every stage-0 peer made to its stage peers (Info `progress_sent`)
  over the samples the stage served; and per peer, messages sent and taken per sample of its own;
- epoch ends in the window (the most any stage-0 peer finished) and the median time one took (Info `epoch_end_s`,
  from its start to the step, over the latest 32 ends of every stage-0 peer, warm-up included);
- the longest stall: the longest time stage 1's `samples_processed` did not move (polled every 0.25 s);
- "came back in" warnings in the stage-0 logs (an epoch waited out --admission-timeout for admitted samples);
- busy: the fraction of 0.2 s polls with work queued on a stage-0 server, averaged over them; the trainer's lost
  microbatches and retries; cores busy (the whole machine's).

    python -m tests.benchmarks.bench_stage_scale [--quick] [--peers 1,2,4,8,16] [--window 30] [--repeats 1]

`--repeats R` runs R rounds, each every peer count in the order given, and reports median [min-max] over them.

To compare two versions of the code, run it from each checkout in turn (one swarm at a time on a small machine).
"""

from __future__ import annotations

import os
import statistics
import threading
import time

import grpc

from swarm.protocol import wire_pb2 as pb
from swarm.protocol.rpc import StageStub, sync_channel
from tests.benchmarks import common, swarmrun

SWARM = "stage-scale"
STALL_POLL_S = 0.25


class StallWatch:
    """Polls one server's `samples_processed` in a thread: the longest time it did not move."""

    def __init__(self, address: str):
        self.address, self.longest = address, 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="stall-watch", daemon=True)

    def _run(self) -> None:
        with sync_channel(self.address) as channel:
            rpc = StageStub(channel).info
            last, since = None, time.monotonic()
            while not self._stop.wait(STALL_POLL_S):
                try:
                    n = rpc(pb.InfoRequest(), timeout=1.0).samples_processed
                except grpc.RpcError:
                    continue
                now = time.monotonic()
                if n != last:
                    last, since = n, now
                self.longest = max(self.longest, now - since)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> float:
        self._stop.set()
        self._thread.join(5)
        return self.longest


def run_one(args, n: int) -> dict:
    model = ["--preset", "local_debug", "--n-stages", "2"]
    epochs = ["--samples-per-step", str(args.samples_per_step), "--lookahead-samples", str(args.lookahead_samples)]
    in_flight = 2 * n + 2
    swarm = swarmrun.new_swarm(args.out, f"stage-scale-{n}")
    with swarm:
        swarm.start_dht()
        corpus = swarmrun.small_corpus(swarm.log_dir / "corpus.txt")
        stage0, addresses = [f"server-s0-r{r}" for r in range(n)], {}
        for name in stage0:
            port = common.free_port()
            flags = [*model, *epochs, "--slowdown", str(args.slowdown)]
            swarm.start_server(name, 0, swarmrun.server_args(port, SWARM, flags))
            addresses[name] = f"127.0.0.1:{port}"
        port = common.free_port()
        swarm.start_server("server-s1", 1, swarmrun.server_args(port, SWARM, [*model, *epochs]))
        addresses["server-s1"] = f"127.0.0.1:{port}"
        swarmrun.wait_ready(swarm, addresses, timeout=60 + 15 * n)
        common.log(f"N={n}: {n + 1} servers ready; trainer in-flight {in_flight}, warm-up {args.warmup:.0f}s")
        trainer = swarmrun.TrainerHandle(
            swarm,
            "trainer",
            ["--swarm-name", SWARM, *model, "--batch-size", "4", "--in-flight", str(in_flight), "--data", corpus],
        )
        counters: dict = {}
        busy = swarmrun.BusyPoller({name: addresses[name] for name in stage0})
        stalls = StallWatch(addresses["server-s1"])

        def read(tag: str) -> None:
            counters[tag] = {name: swarmrun.info(address, timeout=5.0) for name, address in addresses.items()}
            counters[f"{tag}_t"] = time.monotonic()
            counters[f"{tag}_cpu"] = common.machine_cpu_seconds()
            if tag == "start":
                busy.start()
                stalls.start()
            else:
                counters["busy"], counters["stall"] = busy.stop(), stalls.stop()

        try:
            trainer.snapshot(min_steps=1)  # the first microbatch went through both stages
            time.sleep(args.warmup)
            common.log(f"N={n}: measuring {args.window:.0f}s")
            window = trainer.window(args.window, lambda: read("start"), lambda: read("end"))
        finally:
            trainer.stop()
        came_back = sum(
            (swarm.log_dir / f"{name}.log").read_text(errors="replace").count("came back in") for name in stage0
        )

    start, end = counters["start"], counters["end"]
    seconds = counters["end_t"] - counters["start_t"]
    own = {name: end[name].samples_processed - start[name].samples_processed for name in stage0}
    sent = {name: end[name].progress_sent - start[name].progress_sent for name in stage0}
    taken = {name: end[name].progress_received - start[name].progress_received for name in stage0}
    served = sum(own.values())
    ends = max(end[name].epoch - start[name].epoch for name in stage0)
    # every end each peer kept (its latest 32, warm-up included: at one slow peer an epoch lasts a minute)
    durations = [d for name in stage0 for d in end[name].epoch_end_s]
    per_peer = [(sent[name] + taken[name]) / own[name] for name in stage0 if own[name]]
    cpu_busy = (counters["end_cpu"][0] - counters["start_cpu"][0]) / seconds
    result = {
        "peers": n,
        "in_flight": in_flight,
        "window_s": seconds,
        "samples_per_second": window["samples_per_second"],
        "stage0_samples": served,
        "progress_calls_per_sample": sum(sent.values()) / served if served else None,
        "progress_messages_per_own_sample": statistics.median(per_peer) if per_peer else None,
        "epoch_ends": ends,
        "epoch_end_s_median": statistics.median(durations) if durations else None,
        "longest_stall_s": counters["stall"],
        "came_back_warnings": came_back,
        "busy": statistics.mean(counters["busy"][name] for name in stage0),
        "lost_microbatches": window["lost_microbatches"],
        "retries": window["retries"],
        "machine_cores_busy": cpu_busy,
    }
    common.log(f"N={n}: {result}")
    return result


def main(argv: list[str] | None = None) -> dict:
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument(
        "--peers", default=None, help="stage-0 peer counts, comma-separated (default 1,2,4,8,16; quick 1,2,4)"
    )
    p.add_argument("--window", type=float, default=None, help="seconds measured per peer count (default 30; quick 15)")
    p.add_argument("--warmup", type=float, default=None, help="seconds after the first microbatch (default 20)")
    p.add_argument("--slowdown", type=float, default=32.0)
    p.add_argument("--samples-per-step", type=int, default=128)
    p.add_argument("--lookahead-samples", type=int, default=64)
    args = p.parse_args(argv)
    common.exit_on_sigterm()
    counts = [int(x) for x in (args.peers or ("1,2,4" if args.quick else "1,2,4,8,16")).split(",")]
    args.window = args.window or (15.0 if args.quick else 30.0)
    args.warmup = args.warmup if args.warmup is not None else (10.0 if args.quick else 20.0)
    args.repeats = args.repeats or 1
    runs: dict[int, list[dict]] = {n: [] for n in counts}
    for r in range(args.repeats):  # interleaved: every peer count once a round, so a drift in the machine hits all
        for n in counts:
            common.log(f"round {r + 1}/{args.repeats}")
            runs[n].append(run_one(args, n))
    one = [x["samples_per_second"] for x in runs.get(1, [])]

    def col(n: int, key: str, digits: int = 3) -> str:
        return common.fmt(common.summary([x[key] for x in runs[n] if x[key] is not None]), digits)

    def linear(n: int) -> str:
        if not one:
            return "-"
        return common.fmt(common.summary([x["samples_per_second"] / (n * statistics.median(one)) for x in runs[n]]))

    common.table(
        f"a stage of N slow peers (--slowdown {args.slowdown:g}), one trainer (in-flight 2N+2), "
        f"{args.window:.0f}s windows after {args.warmup:.0f}s of warm-up, {args.repeats} interleaved round(s), "
        f"median [min-max], on {os.cpu_count()} cores",
        [
            "N",
            "samples/s",
            "vs N x one peer",
            "Progress calls / stage sample",
            "msgs sent+taken / own sample (peer median)",
            "epoch ends",
            "epoch end median s",
            "longest stall s",
            "'came back in' warnings",
            "busy",
            "lost",
            "retries",
            "machine cores busy",
        ],
        [
            [
                n,
                col(n, "samples_per_second"),
                linear(n),
                col(n, "progress_calls_per_sample"),
                col(n, "progress_messages_per_own_sample"),
                col(n, "epoch_ends"),
                col(n, "epoch_end_s_median"),
                col(n, "longest_stall_s", 2),
                col(n, "came_back_warnings"),
                col(n, "busy", 2),
                col(n, "lost_microbatches"),
                col(n, "retries"),
                col(n, "machine_cores_busy", 2),
            ]
            for n in counts
        ],
    )
    results = [x for n in counts for x in runs[n]]
    report = {"hardware": common.hardware(), "args": vars(args), "results": results}
    common.write_json(args.out, "stage_scale", report)
    return report


if __name__ == "__main__":
    main()
