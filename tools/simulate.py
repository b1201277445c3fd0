"""`swarm-simulate`: stage rebalancing under churn, after §4.4 of the SWARM paper (its Table 5 and Figure 6).

A trace of joins and departures (synthetic and seeded, or a CSV) drives a pipeline of `n_stages` stages. As in the
paper, a departure removes a random peer of a random (non-empty) stage. Pipeline throughput = min over stages of the
serving capacity; "optimal" = the best assignment of the same joined peers at every instant with free, instant moves
(exact for equal peers, an upper bound for heterogeneous ones, so a % against it is never flattering). Every period
every peer calls `swarm.rebalance.decide` on the same view, exactly as a server does; a moving peer serves nothing for
`migration_s` while it downloads its new stage's state, and a joining peer likewise. Joiners pick their stage with
`choose_stage` under every policy (the paper: new peers join the stage that needs them), so the policies differ only in
the rebalancer. Pure computation: no networking. Results go to stdout; progress to stderr.
"""

from __future__ import annotations

import argparse
import bisect
import csv
import dataclasses
import heapq
import json
import math
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import NamedTuple

from tqdm import tqdm

from swarm.cli import add_config_args, add_config_file_arg, config_from_args, parse_args
from swarm.rebalance import PeerLoad, RebalanceConfig, StageLoad, SwarmView, choose_stage, decide, optimal_throughput

HOUR = 3600.0
BIN_S = 300.0  # resolution of the throughput-over-time series; divides an hour, so hour windows are whole bins
REBALANCE_FLAGS = ("hysteresis", "cooldown_s", "max_moves_per_period")
GPU_CLASSES = ((1.0, 0.5), (2.0, 0.3), (4.0, 0.2))  # (relative samples/s, share) for --hetero: T4/V100/A100-like


@dataclass(frozen=True, kw_only=True)
class SimConfig:
    """One simulated swarm. Population: joins at a Poisson rate, so mean live peers = peers_per_stage x n_stages."""

    # Defaults are calibrated so that "no rebalancing" lands near the paper's Table 5 baseline (82.7% overall, 45.4%
    # in the last hour): a small swarm whose join rate peaks mid-trace, so it shrinks through the last hours.
    n_stages: int = field(default=4, metadata={"help": "pipeline stages"})
    hours: float = field(default=32.0, metadata={"help": "length of the simulated trace, hours"})
    peers_per_stage: float = field(
        default=5.0, metadata={"help": "mean live peers per stage: sets the join rate (Poisson)"}
    )
    lifetime_h: float = field(default=8.0, metadata={"help": "mean peer lifetime (Weibull), hours"})
    weibull_shape: float = field(
        default=0.8, metadata={"help": "shape of the lifetimes; < 1: many early preemptions, a few long-lived peers"}
    )
    daily_swing: float = field(
        default=0.95,
        metadata={
            "help": "join rate x (1 + swing x cos(2 pi (t - peak) / 24 h)), in [0, 1): spot capacity comes and goes"
        },
    )
    peak_h: float = field(default=20.0, metadata={"help": "hour of the trace when joins peak"})
    burst_every_h: float = field(
        default=8.0, metadata={"help": "mean hours between preemption waves (Poisson; 0: none)"}
    )
    burst_fraction: float = field(default=0.2, metadata={"help": "share of live peers a wave reclaims at once"})
    hetero: bool = field(
        default=False, metadata={"help": "peers 1x/2x/4x fast (T4/V100/A100-like, 50/30/20%%) instead of all equal"}
    )
    migration_s: float = field(
        default=30.0, metadata={"help": "seconds a moving or joining peer serves nothing (state download)"}
    )
    inflight_per_peer: float = field(
        default=2.0, metadata={"help": "microbatches in flight per serving peer: the queues that 'paper' reads"}
    )

    def __post_init__(self) -> None:
        positive = ("n_stages", "hours", "peers_per_stage", "lifetime_h", "weibull_shape", "inflight_per_peer")
        bad = [(n, "> 0") for n in positive if not getattr(self, n) > 0]
        bad += [(n, ">= 0") for n in ("burst_every_h", "migration_s", "peak_h") if not getattr(self, n) >= 0]
        bad += [(n, "in [0, 1)") for n in ("daily_swing", "burst_fraction") if not 0 <= getattr(self, n) < 1]
        if bad:
            name, rule = bad[0]
            raise ValueError(f"--{name.replace('_', '-')} must be {rule}, got {getattr(self, name)}")


class Event(NamedTuple):
    """A trace row. `peer_id` empty on a leave: a random peer of a random stage leaves, chosen by the pre-drawn
    uniforms `u_stage`, `u_peer` so that every policy replays the same trace."""

    time_s: float
    kind: str  # "join" | "leave"
    peer_id: str
    throughput: float
    u_stage: float
    u_peer: float


def synthetic_trace(cfg: SimConfig, seed: int) -> list[Event]:
    """Seeded preemption trace: the swarm starts at its mean size, then joins arrive at a daily-modulated Poisson
    rate, each joiner brings a Weibull lifetime, and preemption waves reclaim a share of live peers at once.
    Departures are anonymous (as in the paper only the live count comes from the trace), so each lifetime only fixes
    *when* someone leaves."""
    rng = random.Random(seed)
    horizon, life_mean = cfg.hours * HOUR, cfg.lifetime_h * HOUR
    mean_n = cfg.peers_per_stage * cfg.n_stages
    rate = mean_n / life_mean  # Little's law: mean population = join rate x mean lifetime
    peak = rate * (1 + cfg.daily_swing)
    timeline = [(0.0, "join")] * round(mean_n)
    t = 0.0
    while (t := t + rng.expovariate(peak)) < horizon:  # thinning: a Poisson process with a time-varying rate
        if rng.random() * peak < rate * (1 + cfg.daily_swing * math.cos(2 * math.pi * (t / HOUR - cfg.peak_h) / 24)):
            timeline.append((t, "join"))
    t = 0.0
    while cfg.burst_every_h > 0 and (t := t + rng.expovariate(1 / (cfg.burst_every_h * HOUR))) < horizon:
        timeline.append((t, "burst"))
    timeline.sort()
    scale = life_mean / math.gamma(1 + 1 / cfg.weibull_shape)
    events: list[Event] = []
    pending: list[float] = []  # heap of scheduled departure times

    def leave(at: float) -> None:
        events.append(Event(at, "leave", "", 0.0, rng.random(), rng.random()))

    for t, kind in timeline:
        while pending and pending[0] <= t:
            leave(heapq.heappop(pending))
        if kind == "join":
            c = rng.choices([g for g, _ in GPU_CLASSES], [w for _, w in GPU_CLASSES])[0] if cfg.hetero else 1.0
            events.append(Event(t, "join", f"p{len(events)}", c, 0.0, 0.0))
            heapq.heappush(pending, t + rng.weibullvariate(scale, cfg.weibull_shape))
        else:  # a wave: these peers leave now instead of at their scheduled time
            for gone in rng.sample(range(len(pending)), round(cfg.burst_fraction * len(pending))):
                pending[gone] = math.inf
                leave(t)
            pending = [x for x in pending if x != math.inf]
            heapq.heapify(pending)
    while pending and pending[0] < horizon:
        leave(heapq.heappop(pending))
    return events


def read_trace(path: str, seed: int) -> list[Event]:
    """CSV rows `time_s,event,peer_id[,throughput]` (event: join|leave; a header row is allowed). A leave with an
    empty peer_id removes a random peer of a random stage, drawn from `seed`."""
    rng = random.Random(seed)
    events = []
    with open(path, newline="") as f:
        for row in csv.reader(f):
            if not row or row[0].strip().startswith("#") or row[0].strip() == "time_s":
                continue
            t, kind, pid = float(row[0]), row[1].strip(), row[2].strip() if len(row) > 2 else ""
            if kind not in ("join", "leave") or (kind == "join" and not pid):
                raise ValueError(f"{path}: bad trace row {row!r}; expected time_s,join|leave,peer_id[,throughput]")
            c = float(row[3]) if len(row) > 3 and row[3].strip() else 1.0
            events.append(Event(t, kind, pid, c, rng.random(), rng.random()))
    return sorted(events, key=lambda e: e.time_s)


def mva_queues(n_serving: list[int], capacity: list[float], inflight: int) -> list[float]:
    """Mean queue per peer, by exact mean-value analysis of a closed product-form network: trainers keep `inflight`
    microbatches in the pipeline; throughput-weighted routing gives every peer of stage s the same service demand
    1 / capacity_s, so all peers of a stage have the same mean queue. Queues pile up at the bottleneck, as measured."""
    demand = [1 / c if c > 0 else 0.0 for c in capacity]
    q = [0.0] * len(capacity)
    for k in range(1, inflight + 1):
        r = [d * (1 + qs) for d, qs in zip(demand, q, strict=True)]
        x = k / sum(n * rs for n, rs in zip(n_serving, r, strict=True))
        q = [x * rs for rs in r]
    return q


@dataclass(slots=True)
class _Peer:
    stage: int
    throughput: float
    last_move_s: float = -math.inf
    joined: bool = False  # finished its join download: counts toward the optimum
    serving: bool = False  # not downloading (after a join or a move): counts toward achieved throughput


@dataclass
class RunResult:
    achieved: list[float]  # integral of pipeline throughput per BIN_S bin, samples
    optimal: list[float]
    moves: int = 0


class _Swarm:
    """Simulator state. Invariants: `serve[s]` = sum of serving peers' throughput on stage s; `joined` = sorted
    throughputs of joined peers; `members[s]` = ids on stage s (downloading or not)."""

    def __init__(self, n_stages: int) -> None:
        self.n_stages, self.peers, self.joined = n_stages, dict[str, _Peer](), list[float]()
        self.members: list[list[str]] = [[] for _ in range(n_stages)]
        self.serve = [0.0] * n_stages

    def view(self, queue_model: float | None) -> SwarmView:
        """What peers publish: throughput, demand (routed samples/s) and, if `queue_model`, MVA queue lengths."""
        x = min(self.serve)
        queues = [0.0] * self.n_stages
        if queue_model and x > 0:
            n = [sum(self.peers[p].serving for p in m) for m in self.members]
            queues = mva_queues(n, self.serve, min(256, max(1, round(queue_model * sum(n)))))
        stages = []
        for s, ids in enumerate(self.members):
            loads = []
            for pid in ids:
                p = self.peers[pid]
                on = p.serving
                dem = x * p.throughput / self.serve[s] if on else 0.0
                loads.append(PeerLoad(pid, p.throughput, queues[s] if on else 0.0, dem, p.last_move_s, on))
            stages.append(StageLoad(s, tuple(loads)))
        return SwarmView(tuple(stages))


def simulate(trace: list[Event], sim: SimConfig, policy: RebalanceConfig | None) -> RunResult:
    """Replay `trace` under `policy` (None: never rebalance). Deterministic for a given trace."""
    horizon = sim.hours * HOUR
    n_bins = math.ceil(horizon / BIN_S)
    res = RunResult([0.0] * n_bins, [0.0] * n_bins)
    sw = _Swarm(sim.n_stages)
    ready: list[tuple[float, str]] = []  # heap of (time a download ends, peer id)
    queue_model = sim.inflight_per_peer if policy and policy.algorithm == "paper" else None
    t, ti, tick = 0.0, 0, policy.period_s if policy else math.inf
    achieved = optimal = 0.0

    def serve_on(p: _Peer, sign: float) -> None:
        sw.serve[p.stage] += sign * p.throughput
        p.serving = sign > 0

    while True:
        t_ready = ready[0][0] if ready else math.inf
        t_trace = trace[ti].time_s if ti < len(trace) else math.inf
        t_next = min(t_ready, t_trace, tick, horizon)
        for acc, v in ((res.achieved, achieved), (res.optimal, optimal)):  # integrate the piecewise-constant rates
            a = t
            while v and a < t_next:
                i = int(a // BIN_S)
                b = min(t_next, (i + 1) * BIN_S)
                acc[i] += v * (b - a)
                a = b
        t = t_next
        if t >= horizon:
            return res
        if t_ready == t:  # downloads end first, so a peer that became ready at t is visible to decisions at t
            _, pid = heapq.heappop(ready)
            p = sw.peers.get(pid)
            if p is not None and not p.serving and p.last_move_s + sim.migration_s <= t:
                serve_on(p, +1)
                if not p.joined:
                    p.joined = True
                    bisect.insort(sw.joined, p.throughput)
        elif t_trace == t:
            e = trace[ti]
            ti += 1
            if e.kind == "join" and e.peer_id not in sw.peers:
                stage = choose_stage(sw.view(None), e.peer_id, e.throughput)
                sw.peers[e.peer_id] = _Peer(stage, e.throughput, last_move_s=t)
                sw.members[stage].append(e.peer_id)
                heapq.heappush(ready, (t + sim.migration_s, e.peer_id))
            elif e.kind == "leave":
                pid = e.peer_id if e.peer_id in sw.peers else ""
                if not pid and sw.peers:  # the paper's protocol: a random peer of a random stage
                    stages = [m for m in sw.members if m]
                    ids = sorted(stages[int(e.u_stage * len(stages))])
                    pid = ids[int(e.u_peer * len(ids))]
                if pid:
                    p = sw.peers.pop(pid)
                    sw.members[p.stage].remove(pid)
                    if p.serving:
                        serve_on(p, -1)
                    if p.joined:
                        del sw.joined[bisect.bisect_left(sw.joined, p.throughput)]
        else:  # every peer decides on the same view, independently; moves apply after all have decided
            assert policy is not None
            view = sw.view(queue_model)
            moves = [m for st in view.stages for pl in st.peers if (m := decide(view, pl.peer_id, t, policy))]
            for m in moves:
                p = sw.peers[m.peer_id]
                serve_on(p, -1)
                sw.members[m.src].remove(m.peer_id)
                sw.members[m.dst].append(m.peer_id)
                p.stage, p.last_move_s = m.dst, t
                heapq.heappush(ready, (t + sim.migration_s, m.peer_id))
            res.moves += len(moves)
            tick += policy.period_s
        achieved = min(sw.serve)
        optimal = optimal_throughput(sw.joined, sim.n_stages)


def policies(periods: list[float], base: RebalanceConfig) -> list[tuple[str, RebalanceConfig | None]]:
    """The compared rebalancers ("Alg.2": the paper's as written; "swarm": ours); the optimum is every %'s base."""
    rules = [
        (f"{label} T={p:g}s", dataclasses.replace(base, algorithm=algo, period_s=p))
        for algo, label in (("paper", "Alg.2"), ("swarm", "swarm"))
        for p in periods
    ]
    return [("no rebalancing", None), *rules]


def _pct(res: RunResult, lo: int, hi: int) -> float:
    opt = sum(res.optimal[lo:hi])
    return 100 * sum(res.achieved[lo:hi]) / opt if opt > 0 else 100.0


def run_experiment(
    sim: SimConfig, base: RebalanceConfig, periods: list[float], seeds: int, trace_csv: str | None = None
) -> dict:
    """All policies on the same `seeds` traces. Per policy: mean (and sd over seeds) % of optimal throughput,
    integrated over the whole run, its first hour and its last hour; migrations per run; mean throughput per bin."""
    runs = policies(periods, base)
    n_bins = math.ceil(sim.hours * HOUR / BIN_S)
    hour = round(HOUR / BIN_S)
    windows = {"overall": (0, n_bins), "first_hour": (0, hour), "last_hour": (max(0, n_bins - hour), n_bins)}
    pct: dict[str, dict[str, list[float]]] = {name: {w: [] for w in windows} for name, _ in runs}
    moves: dict[str, list[int]] = {name: [] for name, _ in runs}
    series: dict[str, list[float]] = {name: [0.0] * n_bins for name, _ in runs + [("optimal", None)]}
    # a bar in a terminal, a line per seed otherwise (logs, CI)
    bar = tqdm(total=seeds * len(runs), desc=f"{sim.n_stages} stages", leave=False) if sys.stderr.isatty() else None
    for seed in range(seeds):
        trace = read_trace(trace_csv, seed) if trace_csv else synthetic_trace(sim, seed)
        if bar is None:
            print(f"  {sim.n_stages} stages: seed {seed + 1}/{seeds}", file=sys.stderr)
        for name, policy in runs:
            if bar is not None:
                bar.set_postfix_str(f"seed {seed + 1}/{seeds}, {name}")
            res = simulate(trace, sim, policy)
            if bar is not None:
                bar.update()
            for w, (lo, hi) in windows.items():
                pct[name][w].append(_pct(res, lo, hi))
            moves[name].append(res.moves)
            series[name] = [s + a / BIN_S / seeds for s, a in zip(series[name], res.achieved, strict=True)]
        series["optimal"] = [s + o / BIN_S / seeds for s, o in zip(series["optimal"], res.optimal, strict=True)]
    if bar is not None:
        bar.close()
    table = {
        name: {
            **{w: statistics.fmean(v) for w, v in pct[name].items()},
            **{f"{w}_sd": statistics.pstdev(v) for w, v in pct[name].items()},
            "moves_per_run": statistics.fmean(moves[name]),
        }
        for name, _ in runs
    }
    return {"table": table, "series": series, "bin_s": BIN_S}


def format_table(table: dict, title: str) -> str:
    lines = [title, f"{'policy':<28}{'overall %':>16}{'first hour %':>16}{'last hour %':>16}{'moves/run':>11}"]
    for name, r in table.items():
        cells = "".join(f"{r[w]:>9.1f} ± {r[w + '_sd']:<4.1f}" for w in ("overall", "first_hour", "last_hour"))
        lines.append(f"{name:<28}{cells}{r['moves_per_run']:>11.1f}")
    lines.append(f"{'optimal (free, instant moves)':<28}{'100.0':>9}{'100.0':>16}{'100.0':>16}{'-':>11}")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")  # files only: no display on servers
        import matplotlib.pyplot as plt
    except ImportError as e:
        raise SystemExit("--out-png needs matplotlib: pip install matplotlib (or drop --out-png)") from e
    fig, (ax_t, ax_s) = plt.subplots(1, 2, figsize=(13, 4.5))
    main = result["main"]
    for name, ys in main["series"].items():
        xs = [(i + 0.5) * main["bin_s"] / HOUR for i in range(len(ys))]
        ax_t.plot(xs, ys, label=name, lw=1.8 if name == "optimal" else 1.0, ls="--" if name == "optimal" else "-")
    ax_t.set(xlabel="time, hours", ylabel="pipeline throughput, samples/s", title=f"{result['n_stages']} stages")
    ax_t.legend(fontsize=7)
    stages = sorted(result["scaling"], key=int)
    for name in main["table"]:
        ax_s.plot([int(s) for s in stages], [result["scaling"][s][name] for s in stages], marker="o", label=name)
    ax_s.set(xscale="log", xlabel="pipeline stages", ylabel="% of optimal throughput, overall", title="scaling")
    ax_s.minorticks_off()
    ax_s.set_xticks([int(s) for s in stages], [str(s) for s in stages])
    ax_s.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="swarm-simulate", description=__doc__.split("\n")[0])
    add_config_file_arg(parser)
    add_config_args(parser, SimConfig)
    rebalance = {f.name: f for f in dataclasses.fields(RebalanceConfig)}
    for f in REBALANCE_FLAGS:  # the simulator sweeps the algorithm and the period itself
        default = getattr(RebalanceConfig(), f)
        help = f"{rebalance[f].metadata['help']} (default: {default})"
        parser.add_argument(f"--rebalance-{f.replace('_', '-')}", type=type(default), help=help)
    parser.add_argument("--periods", type=float, nargs="+", default=[300.0, 60.0], help="rebalancing periods T, s")
    parser.add_argument(
        "--seeds", type=int, default=10, help="seeded traces, each replayed under every policy (default: 10)"
    )
    parser.add_argument(
        "--scaling-stages",
        type=int,
        nargs="*",
        default=[4, 8, 16, 32],
        help="pipeline depths of the scaling table, besides --n-stages (default: 4 8 16 32)",
    )
    parser.add_argument("--trace-csv", help="replay time_s,join|leave,peer_id[,throughput] (disables scaling)")
    parser.add_argument("--quick", action="store_true", help="4 h, 3 seeds, 4 and 8 stages: a smoke run")
    parser.add_argument("--out-json", help="write the full results here as JSON")
    parser.add_argument("--out-png", help="plot throughput over time and the scaling table here (needs matplotlib)")
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parse_args(parser, argv)
    if args.quick:
        args.hours, args.seeds, args.scaling_stages = min(args.hours, 4.0), min(args.seeds, 3), [4, 8]
    sim = config_from_args(SimConfig, args)
    base = RebalanceConfig(**{f: v for f in REBALANCE_FLAGS if (v := getattr(args, "rebalance_" + f)) is not None})
    if args.seeds < 1:
        parser.error(f"--seeds must be >= 1, got {args.seeds}")
    stages = [] if args.trace_csv else sorted(set(args.scaling_stages) - {sim.n_stages})
    result: dict = {
        "n_stages": sim.n_stages,
        "sim": dataclasses.asdict(sim),
        "rebalance": dataclasses.asdict(base),
        "seeds": args.seeds,
        "periods": args.periods,
        "scaling": {},
    }
    for n in [sim.n_stages, *stages]:
        started = time.perf_counter()
        out = run_experiment(dataclasses.replace(sim, n_stages=n), base, args.periods, args.seeds, args.trace_csv)
        print(f"{n} stages: {args.seeds} seeds in {time.perf_counter() - started:.1f}s", file=sys.stderr)
        result["scaling"][str(n)] = {name: r["overall"] for name, r in out["table"].items()}
        if n == sim.n_stages:
            result["main"] = out
    print(
        format_table(
            result["main"]["table"],
            f"% of optimal throughput, {sim.n_stages} stages, {sim.hours:g} h, "
            f"{args.seeds} seeds (mean ± sd over seeds), migration {sim.migration_s:g} s",
        )
    )
    names = list(result["main"]["table"])
    print("\noverall % of optimal by pipeline depth\n" + f"{'stages':<8}" + "".join(f"{n:>16}" for n in names))
    for n in sorted(result["scaling"], key=int):
        print(f"{n:<8}" + "".join(f"{result['scaling'][n][name]:>16.1f}" for name in names))
    if args.out_json:
        with open(args.out_json, "w") as f:
            json.dump(result, f, indent=1)
    if args.out_png:
        plot(result, args.out_png)


if __name__ == "__main__":
    main()
