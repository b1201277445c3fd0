"""WAN emulation: the paper's Table 1 on our system. Relative training throughput at {no limit, 500, 100 Mb/s} x {0, 10,
50, 100, 200 ms RTT}, with codec none and blockwise8, relative to no limit.

A live swarm (`LocalSwarm`: DHT, one server per stage, one trainer). Every server sits behind its own link, a
user-space shaping proxy (`wan_proxy.py`: RTT/2 each way, a token bucket per direction at the given rate) that the
server announces instead of its own port (`--announce-port`), so every trainer<->server byte crosses a shaped link
(the DHT's traffic does not). One trainer per codec runs through the whole grid; the links change under it, and after
each change a settling time passes before a window is measured. "No limit" (the proxy in place, no shaping) is measured
between every three cells, and each cell is divided by the mean of the references on either side of it.

Scaling to 2 CPU cores: the paper's point (square-cube law) is that a stage's compute per microbatch grows faster than
its activations, so what matters is compute time per microbatch against transfer time per microbatch on the link.
The default model (d_model 512, 2 shared layers per stage, seq 128, batch 4; 1 MiB fp32 activations) is sized so that
a stage's forward+backward on one core is of the order of sending its 5 activation-sized tensors at 100 Mb/s in fp32:
fp32 then has to hide that transfer and 8-bit carries a quarter of it. The measured ratio is reported. The trainer keeps
`--in-flight` microbatches in the pipeline (default 12) to cover 5 sequential round trips per microbatch at 200 ms.

--quick measures blockwise8 at 100 Mb/s and 100 ms only (with no-limit references before and after).

    python -m tests.benchmarks.bench_wan [--quick] [--codecs none,blockwise8] [--in-flight N] [--window S]
"""

from __future__ import annotations

import asyncio
import shlex
import time

import torch

from swarm.cli import to_argv
from swarm.config import model_config
from swarm.model import Stage
from swarm.pipeline import stage_backward, stage_forward
from tests.benchmarks import common, swarmrun
from tests.benchmarks.wan_proxy import ProxyThread, selftest

RATES = (0.0, 500.0, 100.0)  # Mb/s per direction; 0: no limit
RTTS = (0.0, 10.0, 50.0, 100.0, 200.0)
QUICK_CELLS = [(100.0, 100.0)]
TARGET = 0.80  # blockwise8 at 100 Mb/s, 100 ms RTT, relative to no limit


def stage_seconds(cfg, batch_size: int, repeats: int = 3) -> float:
    """Forward + backward (with recompute) of a middle stage on one thread: what a server spends per microbatch."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        stage = Stage(cfg, 1).train()
        x = torch.randn(batch_size, cfg.max_seq_len, cfg.d_model)
        times = []
        for _ in range(repeats + 1):
            start = time.perf_counter()
            stage_forward(stage, x)
            stage_backward(stage, x, grad_outputs=torch.ones_like(x) * 1e-3)
            times.append(time.perf_counter() - start)
        return common.summary(times[1:])["median"]
    finally:
        torch.set_num_threads(before)


def label(rate: float, rtt: float) -> str:
    return f"{int(rate)} Mb/s" if rate else "no limit", f"{rtt:g} ms"


def main(argv: list[str] | None = None) -> dict:
    p = common.parser(__doc__.split("\n\n")[0])
    p.add_argument("--stages", type=int, default=3)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--layers-per-stage", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--in-flight", type=int, default=12)
    p.add_argument("--window", type=float, default=None, help="seconds measured per cell")
    p.add_argument("--server-args", default="", help="extra flags for every server")
    p.add_argument(
        "--codecs",
        default=None,
        help="comma-separated, each CODEC or FORWARD/BACKWARD (blockwise8/lowrank8) (default: none,blockwise8; "
        "--quick: blockwise8)",
    )
    args = p.parse_args(argv)
    common.exit_on_sigterm()
    window = args.window or (8.0 if args.quick else 20.0)
    codecs = args.codecs.split(",") if args.codecs else (["blockwise8"] if args.quick else ["none", "blockwise8"])
    cells = QUICK_CELLS if args.quick else [(r, t) for r in RATES for t in RTTS if (r, t) != (0.0, 0.0)]
    passes = args.repeats or 1
    cfg = model_config(
        "local_debug",
        n_stages=args.stages,
        d_model=args.d_model,
        n_heads=8,
        d_ff=3 * args.d_model,
        layers_per_stage=args.layers_per_stage,
        max_seq_len=args.seq_len,
    )
    model_flags = [
        "--preset",
        "local_debug",
        "--n-stages",
        str(args.stages),
        "--d-model",
        str(args.d_model),
        "--n-heads",
        "8",
        "--d-ff",
        str(3 * args.d_model),
        "--layers-per-stage",
        str(args.layers_per_stage),
        "--max-seq-len",
        str(args.seq_len),
    ]

    common.log("wan: checking the emulator")
    emulator = asyncio.run(
        selftest([(0, 0), (100, 100)] if args.quick else [(0, 0), (10, 500), (100, 100), (200, 100)])
    )
    compute_s = stage_seconds(cfg, args.batch_size)
    act_bytes = args.batch_size * args.seq_len * args.d_model * 4
    transfer_s = 5 * act_bytes / (100e6 / 8)  # a middle server's 5 activation-sized tensors, fp32, at 100 Mb/s
    common.log(
        f"wan: middle stage fwd+bwd {compute_s * 1e3:.0f} ms on 1 thread; its 5 fp32 tensors at 100 Mb/s "
        f"{transfer_s * 1e3:.0f} ms"
    )

    sequence: list[tuple[float, float]] = [(0.0, 0.0)]
    for i, cell in enumerate(cells):
        sequence.append(cell)
        if i % 3 == 2 or i == len(cells) - 1:
            sequence.append((0.0, 0.0))
    sequence = sequence * passes

    measurements: dict[str, list[dict]] = {}
    swarm = swarmrun.new_swarm(args.out, "wan")
    routes, addresses = {}, {}
    for _ in range(args.stages):
        routes[common.free_port()] = ("127.0.0.1", common.free_port())
    with swarm, ProxyThread(routes) as proxy:
        swarm.start_dht()
        corpus = swarmrun.small_corpus(swarm.log_dir / "corpus.txt")
        for s, (listen, (_, port)) in enumerate(routes.items()):
            name = f"server-s{s}"
            swarm.start_server(
                name,
                s,
                swarmrun.server_args(
                    port, "wan", [*model_flags, "--announce-port", str(listen), *shlex.split(args.server_args)]
                ),
            )
            addresses[name] = f"127.0.0.1:{port}"
        swarmrun.wait_ready(swarm, addresses)
        common.log("servers ready")
        for codec in codecs:
            proxy.set(0.0, 0.0)
            trainer = swarmrun.TrainerHandle(
                swarm,
                f"trainer-{codec.replace('/', '_')}",
                [*to_argv(swarmrun.trainer_config("wan", args, codec, corpus, request_timeout=120.0)), *model_flags],
            )
            try:
                trainer.snapshot(min_steps=args.in_flight)
                rows = measurements[codec] = []
                for rate, rtt in sequence:
                    proxy.set(rtt, rate)
                    time.sleep(2.0 + 8 * rtt / 1000)  # microbatches sent under the previous link finish
                    counters = proxy.proxy.counters
                    before = {port: (c["up"]["bytes"], c["down"]["bytes"]) for port, c in counters.items()}
                    start = time.monotonic()
                    r = trainer.window(window)
                    span = time.monotonic() - start
                    util = 0.0
                    if rate:
                        for port, c in counters.items():
                            busiest = max(c["up"]["bytes"] - before[port][0], c["down"]["bytes"] - before[port][1])
                            util = max(util, busiest * 8 / span / (rate * 1e6))
                    rows.append({"rate_mbit": rate, "rtt_ms": rtt, "link_utilization_max": util, **r})
                    common.log(
                        f"wan {codec}: {' '.join(label(rate, rtt))}: {r['samples_per_second']:.2f} samples/s, "
                        f"busiest link direction {util:.0%}"
                    )
            finally:
                proxy.set(0.0, 0.0)  # the trainer's last microbatches finish fast
                trainer.stop()

    # each cell relative to the mean of the no-limit references measured just before and after it
    report: dict[str, dict] = {}
    for codec, rows in measurements.items():
        refs = [i for i, m in enumerate(rows) if m["rate_mbit"] == 0 and m["rtt_ms"] == 0]
        per_cell: dict[str, dict] = {}
        for i, m in enumerate(rows):
            if i in refs:
                continue
            prev = max(j for j in refs if j < i)
            nxt = min((j for j in refs if j > i), default=prev)
            ref = (rows[prev]["samples_per_second"] + rows[nxt]["samples_per_second"]) / 2
            key = "|".join(label(m["rate_mbit"], m["rtt_ms"]))
            cell = per_cell.setdefault(key, {"relative": [], "samples_per_second": [], "utilization": []})
            cell["relative"].append(m["samples_per_second"] / ref)
            cell["samples_per_second"].append(m["samples_per_second"])
            cell["utilization"].append(m["link_utilization_max"])
        report[codec] = {
            "no_limit_samples_per_second": common.summary([rows[i]["samples_per_second"] for i in refs]),
            "cells": {
                k: {
                    "relative": common.summary(v["relative"]),
                    "samples_per_second": common.summary(v["samples_per_second"]),
                    "link_utilization_max": common.summary(v["utilization"]),
                }
                for k, v in per_cell.items()
            },
        }

    rtts = sorted({t for _, t in cells} | {0.0})
    rates = [r for r in RATES if any(c[0] == r for c in cells) or r == 0.0]
    for codec in report:
        rows_out = []
        for rate in rates:
            row = [label(rate, 0)[0]]
            for rtt in rtts:
                key = "|".join(label(rate, rtt))
                if (rate, rtt) == (0.0, 0.0):
                    row.append("1 (ref)")
                elif key in report[codec]["cells"]:
                    c = report[codec]["cells"][key]
                    row.append(f"{common.fmt(c['relative'])} ({c['link_utilization_max']['median']:.0%})")
                else:
                    row.append("")
            rows_out.append(row)
        ref = report[codec]["no_limit_samples_per_second"]
        common.table(
            f"relative throughput, codec {codec} (no limit: {common.fmt(ref)} samples/s; in brackets the busiest"
            f" link direction's utilization); in-flight {args.in_flight}, window {window:.0f}s",
            ["bandwidth \\ RTT", *[f"{t:g} ms" for t in rtts]],
            rows_out,
        )
    key = "|".join(label(100.0, 100.0))
    headline = report.get("blockwise8", {}).get("cells", {}).get(key, {}).get("relative", {}).get("median")
    if headline is not None:
        verdict = "meets" if headline >= TARGET else "falls short of"
        print(f"blockwise8 at 100 Mb/s, 100 ms RTT: {headline:.3f} of no limit; {verdict} the target {TARGET}")
    result = {
        "benchmark": "wan",
        "hardware": common.hardware(),
        "model_flags": model_flags,
        "batch_size": args.batch_size,
        "in_flight": args.in_flight,
        "window_s": window,
        "passes": passes,
        "emulator_check": emulator,
        "middle_stage_compute_s_1_thread": compute_s,
        "middle_stage_fp32_transfer_s_at_100mbit": transfer_s,
        "sequence": measurements,
        "results": report,
        "target": TARGET,
    }
    common.write_json(args.out, "wan", result)
    plot(report, rates, rtts, args.out)
    return result


def plot(report: dict, rates: list[float], rtts: list[float], out: str) -> None:
    plt = common.pyplot()
    if plt is None or len(rtts) < 3:
        return
    fig, ax = plt.subplots(figsize=(6, 4))
    for codec in report:
        style = "--" if codec == "none" else "-"
        for rate in rates:
            xs, ys = [], []
            for rtt in rtts:
                key = "|".join(label(rate, rtt))
                if (rate, rtt) == (0.0, 0.0):
                    xs.append(rtt), ys.append(1.0)
                elif key in report[codec]["cells"]:
                    xs.append(rtt), ys.append(report[codec]["cells"][key]["relative"]["median"])
            ax.plot(xs, ys, style, marker="o", label=f"{codec}, {label(rate, 0)[0]}")
    ax.set_xlabel("RTT (ms)")
    ax.set_ylabel("throughput relative to no limit")
    ax.axhline(TARGET, color="grey", lw=0.5)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = f"{out}/wan.png"
    fig.savefig(path, dpi=120)
    common.log(f"wrote {path}")


if __name__ == "__main__":
    main()
