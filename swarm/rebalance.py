"""Which stage a peer serves: the pure decision shared by the server's rebalancer and `swarm-simulate`.

A pipeline runs at the speed of its slowest stage: throughput = min over stages of the stage's capacity (the sum of
its peers' samples/s). Stochastic wiring balances load *within* a stage; only moving peers *between* stages repairs a
stage that lost peers to preemption. Every `period_s` (aligned to wall-clock multiples, see `next_decision_time`) each
peer reads the same published `SwarmView` and calls `decide`. The rule is deterministic, so every peer computes the
same plan and only the peers named in it move: at most `max_moves_per_period` per period, with no coordinator.

Two algorithms share the interface:
- "paper": Algorithm 2 of Ryabinin et al. (2023) as written: stage load = total queue length; the least-queued peer of
  the least-loaded stage moves to the most-loaded stage; no margin, no cooldown, one move per period. Peers still
  downloading state are not announced yet, so it does not see them. We add only the never-empty guard.
- "swarm" (default): load = demand / committed capacity. A peer moves from donor d to bottleneck b only if the donor
  stays below the bottleneck's current load by the hysteresis margin, so the sorted (descending) vector of stage loads
  strictly decreases with every move: no oscillation under a consistent view, and the donor never becomes the new
  bottleneck even while the mover downloads. Capacity of peers still downloading counts where they are going, so a
  slow migration is not answered with a second one.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass, field

ALGORITHMS = ("swarm", "paper")


@dataclass(frozen=True, kw_only=True)
class RebalanceConfig:
    """How and how often peers move between stages. Frozen: it is part of the memo key of a view's plan."""

    algorithm: str = field(
        default="swarm",
        metadata={
            "help": "swarm: demand/capacity with hysteresis and cooldown; "
            "paper: Algorithm 2 of the SWARM paper as written",
            "choices": list(ALGORITHMS),
        },
    )
    period_s: float = field(default=60.0, metadata={"help": "seconds between decisions (at wall-clock multiples)"})
    # Relative load margin a move must clear. The strict-improvement rule already prevents oscillation under exact
    # numbers; the margin absorbs measurement noise (live, peers' measured speeds differ by ~10%: without it, peers
    # flap between allocations that are equally good). Above 1 / (peers per stage) it blocks useful moves; in the
    # churn simulator 0.1 and 0.01 give identical results, 0.2 costs 0.5 point.
    hysteresis: float = field(default=0.1, metadata={"help": "relative load margin a move must clear"})
    cooldown_s: float = field(default=120.0, metadata={"help": "a peer that joined or moved stays put this long"})
    max_moves_per_period: int = field(default=1, metadata={"help": "peers that may move in one period, swarm-wide"})

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"--rebalance-algorithm must be one of {ALGORITHMS}, got {self.algorithm!r}")
        if not self.period_s > 0:
            raise ValueError(f"--rebalance-period-s must be > 0, got {self.period_s}")
        if not 0 <= self.hysteresis < 1:
            raise ValueError(f"--rebalance-hysteresis must be in [0, 1), got {self.hysteresis}")
        if not self.cooldown_s >= 0:
            raise ValueError(f"--rebalance-cooldown-s must be >= 0, got {self.cooldown_s}")
        if self.max_moves_per_period < 1:
            raise ValueError(f"--rebalance-max-moves-per-period must be >= 1, got {self.max_moves_per_period}")


@dataclass(frozen=True, slots=True)
class PeerLoad:
    """One peer's published record.

    `throughput`: measured capacity on its stage, samples/s (0 = not measured yet: never chosen to move).
    `queue_len`: microbatches waiting (read by "paper" only). `demand`: samples/s routed to it (read by "swarm").
    `last_move_s`: when it last took a stage, by joining or moving (-inf = never).
    `ready`: False while it downloads its stage's state after joining or moving; its capacity is committed to this
    stage but serves nothing yet.
    """

    peer_id: str
    throughput: float
    queue_len: float = 0.0
    demand: float = 0.0
    last_move_s: float = -math.inf
    ready: bool = True


@dataclass(frozen=True, slots=True)
class StageLoad:
    stage: int
    peers: tuple[PeerLoad, ...]

    @property
    def capacity(self) -> float:
        """Committed capacity: includes peers still downloading this stage's state."""
        return sum(p.throughput for p in self.peers)

    @property
    def serving_capacity(self) -> float:
        return sum(p.throughput for p in self.peers if p.ready)


@dataclass(frozen=True)
class SwarmView:
    """Every stage's peers as published in the DHT. Invariants: `stages[i].stage == i`; peer ids are unique."""

    stages: tuple[StageLoad, ...]
    # plan per (now_s, config), so the N `decide` calls of one period cost one plan, not N. Not part of equality.
    _plans: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not self.stages:
            raise ValueError("a view needs at least one stage")
        if any(s.stage != i for i, s in enumerate(self.stages)):
            raise ValueError("view stages must be numbered 0..n-1 in order")
        n_peers = sum(len(s.peers) for s in self.stages)
        if len({p.peer_id for s in self.stages for p in s.peers}) != n_peers:
            raise ValueError("peer ids must be unique across the view")


@dataclass(frozen=True, slots=True)
class Move:
    peer_id: str
    src: int
    dst: int


def pipeline_throughput(view: SwarmView) -> float:
    """Samples/s the pipeline can push now: its slowest stage's serving capacity (0 if a stage has none)."""
    return min(s.serving_capacity for s in view.stages)


def optimal_throughput(throughputs: list[float], n_stages: int) -> float:
    """What `pipeline_throughput` could be if these peers (`throughputs` sorted ascending) were assigned perfectly.

    Exact for equal peers: floor(n / S) x c. Otherwise an upper bound: for every k < S, k stages may hold one of the k
    largest peers each and the other S - k share the rest, so the optimum is <= (total - k largest) / (S - k).
    """
    n = len(throughputs)
    if n < n_stages:
        return 0.0
    if throughputs[0] == throughputs[-1]:
        return (n // n_stages) * throughputs[0]
    total = sum(throughputs)
    best, top = total / n_stages, 0.0
    for k in range(1, n_stages):
        top += throughputs[-k]
        best = min(best, (total - top) / (n_stages - k))
    return best


def next_decision_time(now_s: float, cfg: RebalanceConfig) -> float:
    """The next wall-clock multiple of `period_s` after `now_s`: all peers decide on the same epoch's view."""
    return (math.floor(now_s / cfg.period_s) + 1) * cfg.period_s


def stage_demands(view: SwarmView) -> list[float]:
    """Samples/s routed to each stage: the same for all.

    Every sample passes every stage, so in steady state all stages see the same demand and the load ranking is the
    inverse capacity ranking. Measured live, per-stage sums differ by noise (and a stage whose peers are all new, or
    that has none, reports 0, which would make a starved stage look idle), so every stage is given the largest stage
    demand reported; with no demand anywhere, 1.
    """
    largest = max(sum(p.demand for p in s.peers) for s in view.stages)
    return [largest if largest > 0 else 1.0] * len(view.stages)


def stage_loads(view: SwarmView) -> list[float]:
    """Demand over committed capacity per stage; inf for a stage with no peers."""
    return [
        d / s.capacity if s.capacity > 0 else math.inf for d, s in zip(stage_demands(view), view.stages, strict=True)
    ]


def decide(view: SwarmView, peer_id: str, now_s: float, cfg: RebalanceConfig) -> Move | None:
    """The move `peer_id` makes this period, or None. Every peer that calls this with the same view, time and config
    gets a consistent answer: the union of all peers' moves is `plan_moves(view, now_s, cfg)`."""
    key = (now_s, cfg)
    plan = view._plans.get(key)
    if plan is None:
        plan = view._plans[key] = {m.peer_id: m for m in plan_moves(view, now_s, cfg)}
    return plan.get(peer_id)


def plan_moves(view: SwarmView, now_s: float, cfg: RebalanceConfig) -> tuple[Move, ...]:
    """All moves of this period. Invariants: at most `max_moves_per_period` moves, each peer at most once, and every
    donor stage keeps at least one ready peer."""
    if cfg.algorithm == "paper":
        return _plan_paper(view)
    return _plan_swarm(view, now_s, cfg)


def _plan_paper(view: SwarmView) -> tuple[Move, ...]:
    # Peers that are downloading state have not (re-)announced yet: Algorithm 2 cannot see them.
    ready = [[p for p in s.peers if p.ready] for s in view.stages]
    queue = [sum(p.queue_len for p in peers) for peers in ready]
    order = range(len(queue))
    s_min = min(order, key=lambda s: (queue[s], s))
    s_max = max(order, key=lambda s: (queue[s], -s))
    if queue[s_max] <= queue[s_min] or len(ready[s_min]) < 2:  # balanced, or the move would empty s_min
        return ()
    mover = min(ready[s_min], key=lambda p: (p.queue_len, p.peer_id))
    return (Move(mover.peer_id, s_min, s_max),)


def _plan_swarm(view: SwarmView, now_s: float, cfg: RebalanceConfig) -> tuple[Move, ...]:
    demand = stage_demands(view)
    cap = [s.capacity for s in view.stages]
    loads = [d / c if c > 0 else math.inf for d, c in zip(demand, cap, strict=True)]
    n_ready = [sum(p.ready for p in s.peers) for s in view.stages]
    movable = [
        [p for p in s.peers if p.ready and p.throughput > 0 and now_s - p.last_move_s >= cfg.cooldown_s]
        for s in view.stages
    ]
    moves: list[Move] = []
    while len(moves) < cfg.max_moves_per_period:
        b = max(range(len(loads)), key=lambda s: (loads[s], -s))  # the bottleneck; ties: lowest index
        best: tuple | None = None
        for d, peers in enumerate(movable):
            if d == b or n_ready[d] < 2:  # never take a stage's last serving peer
                continue
            for p in peers:
                left = cap[d] - p.throughput
                load_d = demand[d] / left if left > 0 else math.inf
                if load_d * (1 + cfg.hysteresis) >= loads[b]:  # donor would not stay clearly below the bottleneck
                    continue
                load_b = demand[b] / (cap[b] + p.throughput)
                # Lowest worst-of-the-two load after the move; then the least loaded donor; then a stable id order.
                key = (max(load_d, load_b), load_d, p.peer_id)
                if best is None or key < best[0]:
                    best = (key, d, p)
        if best is None:
            break
        _, d, p = best
        moves.append(Move(p.peer_id, d, b))
        movable[d] = [q for q in movable[d] if q is not p]
        n_ready[d] -= 1
        cap[d] -= p.throughput
        cap[b] += p.throughput
        loads[d] = demand[d] / cap[d]
        loads[b] = demand[b] / cap[b]
    return tuple(moves)


def choose_stage(view: SwarmView, peer_id: str, throughput: float) -> int:
    """Stage a new peer joins (`--stage auto`): the one whose reinforcement most lowers the sorted (descending) vector
    of stage loads, i.e. the bottleneck, which raises pipeline throughput the most. Ties (several equally starved
    stages) break by a stable hash of `peer_id`, so peers joining at the same moment from the same view spread out
    instead of all landing on one stage."""
    if throughput <= 0:
        raise ValueError(f"throughput of a joining peer must be > 0, got {throughput}")
    demand = stage_demands(view)
    cap = [s.capacity for s in view.stages]
    loads = [d / c if c > 0 else math.inf for d, c in zip(demand, cap, strict=True)]

    def after_join(s: int) -> tuple:
        new = list(loads)
        new[s] = demand[s] / (cap[s] + throughput)
        return (sorted(new, reverse=True), zlib.crc32(f"{peer_id}:{s}".encode()))

    return min(range(len(cap)), key=after_join)
