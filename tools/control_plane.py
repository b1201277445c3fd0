"""A stage's control plane, simulated: how many Progress calls, messages and bytes its peers exchange per sample, how
long its epochs take to end, and how long it stalls, for N = 2 .. 256 peers on one stage.

Simulated peers, links and faults drive the real parts: the epoch rules (server/collab/rules.py `on_poll`,
`on_end_message`), the choice of an epoch's hubs and how often a hub calls each peer (server/collab/hubs.py
`hubs_for`, `period`, `HUB_FROM`), and the periodic direct count (server/collab/epoch.py
`DIRECT_PEERS_PER_PERIOD`). What is simplified: a peer of a later stage computes microbatches back to back while
the stage's global batch has room (stage 0's admission as one counter), every count it hears from an honest peer is
proven (the admissions behind it check out), an epoch's round takes `round_s` once a peer ends it, and a call costs
its link's latency plus its bytes over the sender's bandwidth.

Faults, from `fault_at_s` on: frozen peers take and send nothing (a call to one fails after `peer_timeout` and its
sender drops it, so the hubs of later messages are chosen without it); lying peers claim a whole global batch with
every message and ask the stage to end every epoch (their counts prove nothing, their word ends nothing), and as hubs
pass nothing on. Pure computation, seeded; results to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import heapq
import json
import random
import statistics
import sys
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

from tqdm import tqdm

from server.collab import hubs, rules
from server.collab.epoch import DIRECT_PEERS_PER_PERIOD
from server.collab.rules import Act, EpochView
from swarm.cli import add_config_args, add_config_file_arg, config_from_args, parse_args

STAGE = 1  # a later stage: its peers end epochs on proof alone (rules.py `trusts`)


@dataclass(frozen=True, kw_only=True)
class ControlConfig:
    samples_per_peer: int = field(
        default=64, metadata={"help": "the global batch is this many samples per peer (epochs of similar length)"}
    )
    microbatch: int = field(default=8, metadata={"help": "samples per microbatch"})
    speed: float = field(default=4.0, metadata={"help": "mean samples/s of a peer (lognormal spread)"})
    speed_spread: float = field(default=0.3, metadata={"help": "sigma of log(speed)"})
    latency_s: float = field(default=0.05, metadata={"help": "one-way latency of a call"})
    bandwidth: float = field(default=12.5e6, metadata={"help": "bytes/s a peer sends (100 Mb/s)"})
    message_bytes: int = field(default=900, metadata={"help": "bytes of one signed Progress message"})
    announce_period: float = field(default=5.0, metadata={"help": "--announce-period: the periodic count"})
    peer_timeout: float = field(default=2.0, metadata={"help": "--peer-timeout: a call to a frozen peer fails after"})
    progress_period: float = field(default=0.5, metadata={"help": "--progress-period: a peer's poll"})
    round_s: float = field(default=1.0, metadata={"help": "seconds an epoch's round takes once a peer ends it"})
    lease_s: float = field(
        default=10.0, metadata={"help": "stage 0 admits a microbatch again this long after it stopped coming back"}
    )
    epochs: int = field(default=6, metadata={"help": "epochs to simulate"})
    frozen: float = field(default=0.0, metadata={"help": "share of the peers that freeze at fault_at_s"})
    lying: float = field(default=0.0, metadata={"help": "share of the peers that lie from fault_at_s on"})
    fault_at_s: float = field(default=20.0, metadata={"help": "when the faulty peers turn"})
    hub_from: int = field(
        default=0, metadata={"help": "other peers from which counts go through hubs (0: the server's HUB_FROM)"}
    )
    seed: int = field(default=0, metadata={"help": "random seed"})


@dataclass
class Peer:
    name: str
    speed: float
    epoch: int = 0
    held: int = 0
    ending: bool = False
    computing: bool = False
    listed: set[str] = field(default_factory=set)  # the stage's other peers it still lists
    counts: dict[tuple[str, int], int] = field(default_factory=dict)  # (peer, epoch) -> proven samples
    known: dict[int, int] = field(default_factory=lambda: defaultdict(int))  # epoch -> proven samples of listed peers
    epochs: dict[str, int] = field(default_factory=dict)  # peer -> the latest epoch it reported
    last_direct: float = -1e9
    outbox: dict[str, list[tuple]] = field(default_factory=lambda: defaultdict(list))  # as a hub: dst -> messages
    flushing: set[str] = field(default_factory=set)  # destinations with a hub flush scheduled
    first_ends: hubs.FirstEnds = field(default_factory=hubs.FirstEnds)  # what makes a hub pass on at once


class Simulation:
    def __init__(self, cfg: ControlConfig, n: int):
        self.cfg, self.n = cfg, n
        rng = random.Random(cfg.seed * 1000 + n)
        self.rng = rng
        self.quota = cfg.samples_per_peer * n
        self.hub_from = cfg.hub_from or hubs.HUB_FROM
        names = [f"peer{i:03d}" for i in range(n)]
        self.peers = {p: Peer(p, cfg.speed * rng.lognormvariate(0.0, cfg.speed_spread)) for p in names}
        for p in self.peers.values():
            p.listed = set(names) - {p.name}
        faulty = rng.sample(names, round((cfg.frozen + cfg.lying) * n))
        n_frozen = round(cfg.frozen * n)
        self.frozen_ids, self.lying_ids = set(faulty[:n_frozen]), set(faulty[n_frozen:])
        self.events: list[tuple[float, int, str, tuple]] = []
        self.seq = 0
        self.now = 0.0
        self.admitted: dict[int, int] = defaultdict(int)  # stage 0's admissions towards each epoch
        self.computed: dict[int, int] = defaultdict(int)  # samples computed of each epoch's global batch
        self.stage0_epoch = 0  # stage 0 admits towards this epoch; it moves on once the batch came back to it
        self.full_at: dict[int, float] = {}  # when the stage's samples of an epoch were all computed
        self.ended_at: dict[int, list[float]] = defaultdict(list)  # when each honest peer ended each epoch
        self.calls = self.messages = self.bytes = self.samples = 0
        self.calls_by: dict[str, float] = defaultdict(float)  # calls each peer made

    # --- plumbing -----------------------------------------------------------------------------------------------

    def at(self, t: float, kind: str, *args) -> None:
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, kind, args))

    def faulty(self, name: str, kind: set[str]) -> bool:
        return name in kind and self.now >= self.cfg.fault_at_s

    def honest(self) -> list[Peer]:
        bad = self.frozen_ids | self.lying_ids
        return [p for p in self.peers.values() if p.name not in bad]

    def call(self, src: Peer, dst: str, messages: list[tuple]) -> None:
        """One Progress call from `src` to `dst` carrying `messages` (a hub's passes several on)."""
        size = self.cfg.message_bytes * max(len(messages), 1)
        self.calls += 1
        self.calls_by[src.name] += 1
        self.bytes += size
        delay = self.cfg.latency_s + size / self.cfg.bandwidth
        if self.faulty(dst, self.frozen_ids):  # no answer: the call times out and the sender drops the peer
            self.at(self.now + self.cfg.peer_timeout, "drop", src.name, dst)
            return
        self.at(self.now + delay, "deliver", dst, messages)

    def message(self, p: Peer, end_epoch: bool) -> tuple:
        """(sender, epoch, samples it claims, end_epoch, samples its admissions prove)."""
        if self.faulty(p.name, self.lying_ids):
            return (p.name, p.epoch, self.quota, True, p.held)
        return (p.name, p.epoch, p.held, end_epoch, p.held)

    def tell(self, p: Peer, end_epoch: bool, direct: bool = False) -> None:
        """Our count after a backward (or at an epoch's end, or periodically): to the epoch's hubs in a stage of
        HUB_FROM peers or more, else to every listed peer (hubs.py)."""
        if self.faulty(p.name, self.frozen_ids):
            return
        msg = self.message(p, end_epoch)
        if direct or len(p.listed) < self.hub_from:
            for dst in sorted(p.listed):
                self.call(p, dst, [msg])
            return
        for hub in hubs.hubs_for(p.epoch, [*p.listed, p.name]):
            if hub == p.name:
                self.relay(p, msg, urgent=end_epoch)
            else:
                self.call(p, hub, [msg + ("via_hub",)])

    def relay(self, hub: Peer, msg: tuple, urgent: bool) -> None:
        """As a hub: queue `msg` for every peer we list; flush each every `period`, at once for an epoch's end."""
        if self.faulty(hub.name, self.lying_ids | self.frozen_ids):
            return  # a lying hub withholds
        urgent = hub.first_ends(msg[0], msg[1], urgent, hub.epoch)
        wait = 0.0 if urgent else hubs.period(len(hub.listed) + 1)
        for dst in hub.listed:
            if dst == msg[0]:
                continue
            hub.outbox[dst].append(msg[:5])
            if dst not in hub.flushing or urgent:
                hub.flushing.add(dst)
                self.at(self.now + wait, "flush", hub.name, dst)

    # --- a peer ---------------------------------------------------------------------------------------------------

    def start_work(self, p: Peer) -> None:
        """A trainer's next microbatch, admitted by stage 0 at its epoch: a call of a later epoch than ours ends ours
        first (rules.py `on_call`), and the call runs after our step."""
        if p.computing or p.ending or self.faulty(p.name, self.frozen_ids):
            return
        epoch = self.stage0_epoch
        if self.admitted[epoch] + self.cfg.microbatch > self.quota:
            return  # the batch is admitted: we wait for its end
        if epoch > p.epoch:
            if rules.on_call(self.view(p, stage0_at=epoch), epoch, signer_is_peer=False).act is Act.ANNOUNCE_AND_END:
                self.tell(p, end_epoch=True)
                self.end(p)
            return
        self.admitted[epoch] += self.cfg.microbatch
        p.computing = True
        self.at(self.now + self.cfg.microbatch / p.speed, "backward", p.name, epoch)

    def view(self, p: Peer, stage0_at: int = -1) -> EpochView:
        proven = p.known[p.epoch]
        return EpochView(
            stage=STAGE,
            epoch=p.epoch,
            quota=self.quota,
            lookahead=0,
            held=p.held,
            proven=proven,
            stage0_at=stage0_at,
            joined_at=-1,
            accumulating=not p.ending,
            peer_epochs={q: e for q, e in p.epochs.items() if q in p.listed},
        )

    def poll(self, p: Peer) -> None:
        if self.faulty(p.name, self.frozen_ids) or self.faulty(p.name, self.lying_ids):
            return
        decision = rules.on_poll(self.view(p))
        if decision.act is Act.ANNOUNCE_AND_END:
            self.tell(p, end_epoch=True)
            self.end(p)
        elif decision.act in (Act.END, Act.CATCH_UP):
            self.end(p)

    def end(self, p: Peer) -> None:
        if p.ending:
            return
        p.ending = True
        self.ended_at[p.epoch].append(self.now)
        self.at(self.now + self.cfg.round_s, "stepped", p.name)

    # --- events ---------------------------------------------------------------------------------------------------

    def on_backward(self, name: str, epoch: int) -> None:
        p = self.peers[name]
        p.computing = False
        if self.faulty(name, self.frozen_ids):  # it never comes back: stage 0 admits it again when its lease ends
            self.at(self.now + self.cfg.lease_s, "release", epoch)
            return
        self.samples += self.cfg.microbatch
        self.computed[epoch] += self.cfg.microbatch
        if self.computed[epoch] >= self.quota and epoch not in self.full_at:
            self.full_at[epoch] = self.now
            if epoch == self.stage0_epoch:  # the batch is back at stage 0 too: it steps and admits the next
                self.at(self.now + self.cfg.latency_s + self.cfg.round_s, "stage0", epoch + 1)
        if epoch == p.epoch and not p.ending:  # a late one joins our next gradients, uncounted towards an end
            p.held += self.cfg.microbatch
        self.tell(p, end_epoch=False)
        self.poll(p)
        self.start_work(p)

    def on_deliver(self, name: str, messages: list[tuple]) -> None:
        p = self.peers[name]
        if self.faulty(name, self.frozen_ids):
            return
        for msg in messages:
            sender, epoch, _claimed, end_epoch, proven = msg[:5]
            self.messages += 1
            if sender not in p.listed:
                continue
            p.epochs[sender] = max(p.epochs.get(sender, -1), epoch)
            key = (sender, epoch)
            if proven > p.counts.get(key, 0):  # a peer's progress only moves forward
                p.known[epoch] += proven - p.counts.get(key, 0)
                p.counts[key] = proven
            if len(msg) > 5 and hubs.is_hub(epoch, p.name, p.listed):
                self.relay(p, msg, urgent=end_epoch)
            if end_epoch and rules.on_end_message(self.view(p), epoch, sender):
                self.end(p)
        self.poll(p)

    def on_flush(self, hub_name: str, dst: str) -> None:
        hub = self.peers[hub_name]
        hub.flushing.discard(dst)
        queued, hub.outbox[dst] = hub.outbox[dst], []
        if queued and dst in hub.listed:
            self.call(hub, dst, queued[: hubs.MAX_PASSED_ON])
            if len(queued) > hubs.MAX_PASSED_ON:
                hub.outbox[dst] = queued[hubs.MAX_PASSED_ON :]
                hub.flushing.add(dst)
                self.at(self.now + hubs.period(len(hub.listed) + 1), "flush", hub_name, dst)

    def on_stepped(self, name: str) -> None:
        p = self.peers[name]
        p.ending, p.held = False, 0
        p.epoch += 1
        p.counts = {k: v for k, v in p.counts.items() if k[1] >= p.epoch}
        p.known = defaultdict(int, {e: n for e, n in p.known.items() if e >= p.epoch})
        self.tell(p, end_epoch=False)
        self.start_work(p)

    def on_refresh(self, name: str) -> None:
        p = self.peers[name]
        direct_every = self.cfg.announce_period * len(p.listed) / DIRECT_PEERS_PER_PERIOD
        direct = self.now - p.last_direct >= direct_every
        if direct:
            p.last_direct = self.now
        self.tell(p, end_epoch=False, direct=direct)
        self.at(self.now + self.cfg.announce_period, "refresh", name)

    def on_poll_timer(self, name: str) -> None:
        p = self.peers[name]
        self.poll(p)
        self.start_work(p)
        self.at(self.now + self.cfg.progress_period, "poll", name)

    def on_release(self, epoch: int) -> None:
        self.admitted[epoch] -= self.cfg.microbatch

    def on_stage0(self, epoch: int) -> None:
        self.stage0_epoch = max(self.stage0_epoch, epoch)

    def on_drop(self, name: str, dropped: str) -> None:
        p = self.peers[name]
        if dropped in p.listed:
            p.listed.discard(dropped)
            for (q, e), n in list(p.counts.items()):
                if q == dropped:
                    p.known[e] -= n
                    del p.counts[(q, e)]

    def run(self) -> dict:
        for p in self.peers.values():
            jitter = self.rng.random()
            self.at(jitter * self.cfg.announce_period, "refresh", p.name)
            self.at(jitter * self.cfg.progress_period, "poll", p.name)
            self.at(0.0, "start", p.name)
        handlers: dict[str, Callable[..., None]] = {
            "backward": self.on_backward,
            "deliver": self.on_deliver,
            "flush": self.on_flush,
            "stepped": self.on_stepped,
            "refresh": self.on_refresh,
            "poll": self.on_poll_timer,
            "drop": self.on_drop,
            "release": self.on_release,
            "stage0": self.on_stage0,
            "start": lambda name: self.start_work(self.peers[name]),
        }
        honest = self.honest()
        horizon = 20.0 * self.cfg.epochs * self.cfg.samples_per_peer / self.cfg.speed  # a stalled stage ends too
        running = True  # until every honest peer finished the epochs asked for (it only changes as a peer steps)
        while self.events and running and self.now < horizon:
            self.now, _, kind, args = heapq.heappop(self.events)
            handlers[kind](*args)
            if kind == "stepped":
                running = min(p.epoch for p in honest) < self.cfg.epochs
        return self.report()

    def report(self) -> dict:
        honest = self.honest()
        done = min(p.epoch for p in honest)
        # per epoch, the seconds from its last sample computed to each honest peer's end of it
        ends = {e: [t - self.full_at[e] for t in self.ended_at[e]] for e in range(done) if e in self.full_at}
        median = [statistics.median(v) for v in ends.values() if v]
        slowest = [max(v) for v in ends.values() if v]
        samples = max(self.samples, 1)
        return {
            "peers": self.n,
            "epochs": done,
            "seconds": round(self.now, 1),
            "stage_samples_per_s": round(self.samples / max(self.now, 1e-9), 1),
            "calls_per_stage_sample": round(self.calls / samples, 3),
            "calls_per_sample_per_peer": round(self.calls / samples / self.n, 5),
            "messages_taken_per_stage_sample_per_peer": round(self.messages / samples / self.n, 3),
            "bytes_per_stage_sample_per_peer": round(self.bytes / samples / self.n, 1),
            "busiest_peer_calls_per_s": round(max(self.calls_by.values(), default=0.0) / max(self.now, 1e-9), 1),
            "epoch_end_s_median": round(statistics.median(median), 3) if median else None,
            "longest_stall_s": round(max(slowest), 3) if slowest else None,
        }


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m tools.control_plane", description=__doc__.split("\n")[0])
    add_config_file_arg(parser)
    add_config_args(parser, ControlConfig)
    parser.add_argument("--peers", type=int, nargs="+", default=[2, 4, 8, 16, 32, 64, 128, 256])
    parser.add_argument("--json", action="store_true", help="print one JSON object per peer count")
    return parser


COLUMNS = (
    ("peers", "N"),
    ("epochs", "epochs"),
    ("stage_samples_per_s", "samples/s"),
    ("calls_per_stage_sample", "calls/stage sample"),
    ("messages_taken_per_stage_sample_per_peer", "msgs taken/stage sample/peer"),
    ("bytes_per_stage_sample_per_peer", "bytes/stage sample/peer"),
    ("busiest_peer_calls_per_s", "busiest peer calls/s"),
    ("epoch_end_s_median", "epoch end s (median)"),
    ("longest_stall_s", "longest stall s"),
)


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parse_args(parser, argv)
    cfg = config_from_args(ControlConfig, args)
    if any(n < 2 for n in args.peers):
        parser.error("--peers: a stage of at least 2 peers")
    rows = []
    for n in tqdm(args.peers, desc="control plane", unit="stage", file=sys.stderr):
        rows.append(Simulation(cfg, n).run())
    if args.json:
        for row in rows:
            print(json.dumps(row))
        return
    print("| " + " | ".join(title for _, title in COLUMNS) + " |")
    print("|" + "---|" * len(COLUMNS))
    for row in rows:
        print("| " + " | ".join(str(row[key]) for key, _ in COLUMNS) + " |")


if __name__ == "__main__":
    main()
