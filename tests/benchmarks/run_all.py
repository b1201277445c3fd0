"""Run every benchmark, one after another, each in its own process (so one that fails or hangs cannot take the others
with it), with the same `--quick` and `--out`. Exit status 1 if any failed.

    python -m tests.benchmarks.run_all [--quick] [--out DIR] [--only wire,transport] [--device auto|cpu|cuda]

| script | measures |
|---|---|
| bench_wire | bytes per microbatch per traffic class and codec; codec GB/s against a copy; codec time / stage compute |
| bench_transport | stage RPC round trip of a 4x512x1024 activation against a raw grpc.aio bytes echo |
| bench_pipeline | local swarm samples/s against the same stages in one process (wall time and per CPU-second) |
| bench_averaging | local swarm samples/s with 2 servers per stage (all-reduce) against 1; early rounds against rounds that wait; `--slowdown N`: on emulated devices, against the same swarm stepping alone |
| bench_routing | shares of microbatches of servers slowed 1x/2x/4x against their capacities; stage throughput |
| bench_wan | relative throughput behind shaping proxies (wan_proxy.py): bandwidth x RTT x codec |
| bench_quality | held-out loss of swarm-local configurations against one process trained on the same samples |
| bench_lowrank | ACP-SGD in one process: held-out loss over rank and ablations against whole gradients; bytes per round |
| bench_socket_bytes | stage all-reduce bytes the peers' daemons send over TCP, against the servers' count and fp32, per codec |
| bench_backprop | pipeline codecs and boundaries in one process: held-out loss against fp32, bytes per direction |
| bench_flood | a real server's RSS under rounds of concurrent large requests; every call answered within its deadline |
| bench_robust | --robust-clip's reducer: time against the weighted mean's; error with one attacking sender against the honest mean |
| bench_rounds | failed all-reduce rounds among peers that stay up, by how a reducer's stream ends (hivemind's way, ours) |
| bench_stage_scale | a stage of N slow peers: samples/s against N x one peer, Progress calls per sample, epoch ends, stalls |

Each prints its tables on stdout, progress on stderr, and writes `<out>/<name>.json` (hardware included); bench_wan
also writes a PNG. Run them on an otherwise idle machine: wall-clock ratios are interleaved but not immune to load.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

BENCHMARKS = (
    "wire",
    "transport",
    "pipeline",
    "averaging",
    "routing",
    "wan",
    "quality",
    "lowrank",
    "socket_bytes",
    "backprop",
    "flood",
    "robust",
    "rounds",
    "stage_scale",
)
WITH_DEVICE = ("wire", "pipeline")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="each benchmark's quick mode: a few minutes in all")
    p.add_argument("--out", default="bench-results", help="folder for JSON and PNG results (default: bench-results)")
    p.add_argument("--only", default=None, help=f"comma-separated subset of {','.join(BENCHMARKS)}")
    p.add_argument("--device", default="auto", choices=["auto", "cpu", "cuda"], help="for wire and pipeline")
    p.add_argument("--timeout", type=float, default=None, help="seconds per benchmark (default: 600 quick, 3600)")
    args = p.parse_args(argv)
    names = args.only.split(",") if args.only else list(BENCHMARKS)
    unknown = set(names) - set(BENCHMARKS)
    if unknown:
        p.error(f"unknown benchmark(s) {sorted(unknown)}; choose from {BENCHMARKS}")
    timeout = args.timeout or (900 if args.quick else 7200)
    status = {}
    for name in names:
        cmd = [sys.executable, "-m", f"tests.benchmarks.bench_{name}", "--out", args.out]
        cmd += ["--quick"] if args.quick else []
        cmd += ["--device", args.device] if name in WITH_DEVICE else []
        print(f"\n##### {name}: {' '.join(cmd[1:])}", flush=True)
        start = time.monotonic()
        proc = subprocess.Popen(cmd)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.terminate()  # its LocalSwarm stops the processes it started on SIGTERM
            try:
                rc = proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
            print(f"{name}: timed out after {timeout:.0f}s", file=sys.stderr, flush=True)
        except BaseException:
            proc.terminate()
            proc.wait(timeout=60)
            raise
        status[name] = {"returncode": rc, "seconds": round(time.monotonic() - start, 1)}
    print("\n##### summary")
    for name, s in status.items():
        print(
            f"{name:10s} {'ok' if s['returncode'] == 0 else 'FAILED (' + str(s['returncode']) + ')':12s} "
            f"{s['seconds']:7.1f}s"
        )
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "run_all.json").write_text(json.dumps({"quick": args.quick, "status": status}, indent=2))
    return 0 if all(s["returncode"] == 0 for s in status.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
