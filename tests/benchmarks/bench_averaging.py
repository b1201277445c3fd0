"""Stage averaging's cost: a local swarm's samples/s with 2 servers per stage (gradient all-reduce every epoch) against
1 server per stage (no all-reduce), and all-reduce rounds that begin once the stage's known peers have gathered
(`--early-rounds`) against rounds that wait out `--matchmaking-time` (`--no-early-rounds`) and fixed groups
(`--fixed-groups`, the default: the first attempt of a round skips matchmaking), fixed groups with delayed
parameter updates (`--delay-optimizer-step`: a stage serves the next epoch while its round runs), and parameter
averaging every epoch with and without the probe that skips it when the peers' parameters are equal.

Each variant is a fresh set of servers under its own swarm name on one DHT node, measured by one trainer over a
window of its own progress after a warm-up; variants run one at a time (idle servers are not free on 2 cores) and in
rotated order per round. Ratios are taken per round against the 1-server-per-stage swarm. On a 2-core machine the 2x
swarm has no more compute than the 1x one: the ratio is what averaging (its processes, matchmaking and the pipeline
drain while a round runs) costs.

With `--slowdown N` every server emulates a device N times slower than a core (it sleeps the rest of each forward
and backward, leaving the CPU to the others, as a GPU server's compute does): then the 2x swarm has twice the
compute, and what averaging costs is read against the same swarm stepping alone (`--solo`: its rounds, its
processes' CPU and the pipeline's drain at each global batch, which `--samples-per-step` sizes) and against one server
per stage on a device as fast as two (the same compute per stage in one peer: no all-reduce, a drain through faster
devices).

    python -m tests.benchmarks.bench_averaging [--quick] [--stages S] [--batch-size B] [--in-flight K]
        [--samples-per-step N] [--slowdown N] [--only WORDS] [--skip WORDS] [--model-flags=FLAGS]
"""

from __future__ import annotations

import os
import statistics

from swarm.cli import to_argv
from tests.benchmarks import common, swarmrun

TARGET = 0.90
PARAMS_EVERY_EPOCH = ["--fixed-groups", "--param-average-every", "1"]
VARIANTS = {  # name -> (servers per stage, extra server flags)
    "1 per stage, no all-reduce": (1, []),
    # as many processes as the swarms below, each stepping alone: what a second peer per stage costs on these cores
    # without any averaging
    "2 per stage, no all-reduce (--solo)": (2, ["--solo"]),
    "2 per stage, rounds wait --matchmaking-time": (2, ["--no-early-rounds", "--no-fixed-groups"]),
    "2 per stage, early rounds": (2, ["--early-rounds", "--no-fixed-groups"]),
    "2 per stage, fixed groups": (2, ["--fixed-groups"]),
    # the round overlaps the next epoch's compute (one step of staleness) instead of pausing the stage
    "2 per stage, fixed groups, delayed updates": (2, ["--fixed-groups", "--delay-optimizer-step"]),
    # parameter averaging every epoch (--param-average-every 1): the peers' parameters averaged whole each time, or
    # first a probe round that finds them equal (peers on one kind of device are) and averages nothing
    "2 per stage, fixed groups, parameters averaged every epoch": (
        2,
        [*PARAMS_EVERY_EPOCH, "--no-param-average-probe"],
    ),
    "2 per stage, fixed groups, parameters probed every epoch": (2, PARAMS_EVERY_EPOCH),
    # local-step training (--local-batch): inner steps every 32 of a peer's samples, an outer round every 512 samples
    # of the stage (H = 8), with the drain at each outer boundary, and with the next interval admitted meanwhile
    "2 per stage, local steps (local batch 32, outer 512)": (2, ["--local-batch", "32", "--samples-per-step", "512"]),
    "2 per stage, local steps (local batch 32, outer 512), lookahead 512": (
        2,
        ["--local-batch", "32", "--samples-per-step", "512", "--lookahead-samples", "512"],
    ),
}
# with emulated devices (--slowdown 2 or more) only: one server per stage on a device as fast as two, the same compute per stage
# as the 2x swarms in one peer, whose global batch drains through devices twice as fast and needs no all-reduce
TWICE_AS_FAST = "1 per stage, each as fast as 2 (--slowdown halved)"
REFERENCE = "1 per stage, no all-reduce"
SOLO, DEFAULT = "2 per stage, no all-reduce (--solo)", "2 per stage, fixed groups"


def main(argv: list[str] | None = None) -> dict:
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="local_debug", help="model preset (default: local_debug)")
    p.add_argument(
        "--model-flags", default="", help="more model flags, e.g. --model-flags='--d-model 384 --no-share-layers'"
    )
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--in-flight", type=int, default=4, help="microbatches in flight in the trainer")
    p.add_argument("--samples-per-step", type=int, default=32)
    p.add_argument("--window", type=float, default=None, help="seconds measured per swarm run")
    p.add_argument(
        "--slowdown",
        type=float,
        default=1.0,
        help="every server emulates a device N times slower than a core (server --slowdown: it sleeps the rest), so "
        "that the stages' compute leaves the CPU to the averaging, as GPU servers' does",
    )
    p.add_argument(
        "--only", default="", help="comma-separated words: run the variants whose names contain one (and the reference)"
    )
    p.add_argument("--skip", default="", help="comma-separated words: leave out the variants whose names contain one")
    args = p.parse_args(argv)
    words, skipped = ([w.strip() for w in arg.split(",") if w.strip()] for arg in (args.only, args.skip))
    emulated = args.slowdown > 1.0
    # a device as fast as two must still be emulated (a slowdown of at least 1)
    candidates = {**VARIANTS, TWICE_AS_FAST: (1, [])} if args.slowdown >= 2.0 else VARIANTS
    variants = {
        n: v
        for n, v in candidates.items()
        if n == REFERENCE or ((not words or any(w in n for w in words)) and not any(w in n for w in skipped))
    }
    common.exit_on_sigterm()
    repeats = args.repeats or (1 if args.quick else 3)
    window = args.window or (15.0 if args.quick else 30.0)
    common.log(
        f"bench_averaging: {args.stages} stages, batch {args.batch_size}, in-flight {args.in_flight}, global batch "
        f"{args.samples_per_step}, {repeats} round(s), window {window:.0f}s, servers slowed {args.slowdown:g}x"
    )
    model = ["--preset", args.preset, "--n-stages", str(args.stages), *args.model_flags.split()]
    results: dict[str, list[dict]] = {name: [] for name in variants}
    swarm = swarmrun.new_swarm(args.out, "averaging")
    with swarm:
        swarm.start_dht()
        corpus = swarmrun.small_corpus(swarm.log_dir / "corpus.txt")
        names = list(variants)
        for r in range(repeats):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                per_stage, flags = variants[name]
                swarm_name = f"avg{r}-{names.index(name)}"
                addresses = {}
                for s in range(args.stages):
                    for i in range(per_stage):
                        port = common.free_port()
                        server = f"server-{swarm_name}-s{s}-{i}"
                        extra = [*model, "--samples-per-step", str(args.samples_per_step), "--lookahead-samples", "0"]
                        slowdown = args.slowdown / 2 if name == TWICE_AS_FAST else args.slowdown
                        extra += ["--slowdown", str(slowdown)]
                        swarm.start_server(server, s, swarmrun.server_args(port, swarm_name, [*extra, *flags]))
                        addresses[server] = f"127.0.0.1:{port}"
                swarmrun.wait_ready(swarm, addresses)
                common.log(f"round {r + 1}: {name}")
                config = swarmrun.trainer_config(swarm_name, args, "blockwise8", corpus)
                run = swarmrun.measure_trainer(
                    swarm,
                    f"trainer-{swarm_name}",
                    [*to_argv(config), *model],
                    window=window,
                    warmup_steps=2 * args.samples_per_step // args.batch_size,
                )
                results[name].append(run)
                common.log(f"{name}: {run['samples_per_second']:.1f} samples/s, lost {run['lost_microbatches']}")
                swarm.stop(list(addresses))

    speeds = {name: [x["samples_per_second"] for x in runs] for name, runs in results.items()}
    rows = []
    report = {}
    for name, values in speeds.items():
        ratio = common.summary(common.per_round_ratio(values, speeds[REFERENCE]))
        report[name] = {"samples_per_second": common.summary(values), "vs_reference": ratio, "runs": results[name]}
        rows.append([common.fmt(ratio), name, common.fmt(common.summary(values))])
    common.table(
        f"stage averaging: {args.stages} stages, 1 trainer (in-flight {args.in_flight}, batch {args.batch_size}), "
        f"global batch {args.samples_per_step}, servers slowed {args.slowdown:g}x; median [min-max] of {repeats} "
        "round(s); load average now "
        f"{os.getloadavg()[0]:.1f}",
        ["vs 1 per stage", "variant", "samples/s"],
        rows,
    )
    # on 2 shared cores the 2x swarm has the 1x swarm's compute; on emulated devices it has twice it, and the swarm
    # without averaging is the same one stepping alone, or one peer per stage as fast as two
    if DEFAULT in speeds and not emulated:
        default = statistics.median(common.per_round_ratio(speeds[DEFAULT], speeds[REFERENCE]))
        print(f"with stage averaging / without (1 per stage): {default:.3f}; target >= {TARGET}")
    if DEFAULT in speeds and SOLO in speeds:
        same = statistics.median(common.per_round_ratio(speeds[DEFAULT], speeds[SOLO]))
        target = f"; target >= {TARGET}" if emulated else ""
        print(f"with stage averaging / the same 2-per-stage swarm stepping alone: {same:.3f}{target}")
    if DEFAULT in speeds and TWICE_AS_FAST in speeds:
        fast = statistics.median(common.per_round_ratio(speeds[DEFAULT], speeds[TWICE_AS_FAST]))
        print(f"with stage averaging / 1 per stage on devices as fast as 2: {fast:.3f}")
    result = {
        "benchmark": "averaging",
        "hardware": common.hardware(),
        "stages": args.stages,
        "batch_size": args.batch_size,
        "in_flight": args.in_flight,
        "samples_per_step": args.samples_per_step,
        "slowdown": args.slowdown,
        "window_s": window,
        "repeats": repeats,
        "results": report,
        "target": TARGET,
    }
    common.write_json(args.out, "averaging", result)
    return result


if __name__ == "__main__":
    main()
