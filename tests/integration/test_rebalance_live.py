"""Rebalancing on real local swarms: servers move between stages while trainers train, and `--stage auto` joins
where capacity is missing. The decision function itself is tested in test_rebalance.py.

Servers run `--slowdown 30`: each emulates a device 30x slower than this CPU, sleeping rather than computing (see
server/compute.py `Timing.timed`), so a stage's capacity is set by how many servers it has, not by how the 2 cores are shared at
that moment, and the swarm's throughput can actually rise when the allocation improves.

They also run with `--lookahead-samples 64`: in the exact default, stage 0 admits one global batch and waits for it to
step, so each epoch drains the pipeline and pays an all-reduce, and a second peer on a stage adds little (measured:
0.95x after 4/1/1 -> 2/2/2; 1.17-2.01x with 32 samples of lookahead, 1.51x with 64). Not `--delay-optimizer-step`: rounds of consecutive
epochs then overlap, hivemind's matchmaking can group one peer's round for epoch e with another's for e + 1, and
those rounds fail (1.06-1.27x)."""

import re
import time
from pathlib import Path

import pytest

from tests.conftest import wait_for
from tools.processes import LocalSwarm

pytestmark = [pytest.mark.integration]

MODEL = ["--preset", "local_debug", "--d-model", "64", "--d-ff", "256", "--max-seq-len", "64"]  # head: ~15% of a stage
PERIOD = 6.0
# periods watched after the last move: longer than a moved peer's cooldown (15 s) and the next decision, so a peer
# moving back would be seen
SETTLED_PERIODS = 4
SERVER_FLAGS = [
    "--slowdown",
    "30",
    "--samples-per-step",
    "32",
    "--lookahead-samples",
    "64",
    "--rebalance-period-s",
    str(PERIOD),
    "--rebalance-cooldown-s",
    "15",
]
MOVE_LOG = re.compile(r"moving from|moved from|did not end within|no peer sent its state")
MOVED = re.compile(r"(\S+ \S+) INFO swarm.server: moved from stage (\d+) to stage (\d+)")


def moves(log_dir: Path) -> dict[str, list[tuple[int, int]]]:
    """Server name -> the (from, to) stages of each move it made, in order."""
    out = {}
    for path in sorted(log_dir.glob("server-*.log")):
        out[path.stem] = [(int(a), int(b)) for _, a, b in MOVED.findall(path.read_text())]
    return out


def rate(series: list[tuple[float, int]], start: float, end: float) -> float:
    """Samples/s between two times of a (time, samples) series."""
    window = [(t, n) for t, n in series if start <= t <= end]
    assert len(window) >= 2, f"no samples between {start:.0f}s and {end:.0f}s: {series}"
    (t0, n0), (t1, n1) = window[0], window[-1]
    return (n1 - n0) / (t1 - t0)


def test_starved_stages_get_peers_and_throughput_rises(tmp_path, marker):
    """4/1/1 servers: the bottleneck is one server's capacity. Peers leave stage 0 for stages 1 and 2 until 2/2/2,
    twice the bottleneck capacity; nothing is lost, nobody moves back, and the allocation then holds."""
    with LocalSwarm(tmp_path, "rebalance", MODEL) as swarm:
        swarm.start_dht()
        for stage, count in enumerate((4, 1, 1)):
            for r in range(count):
                swarm.start_server(f"server-s{stage}-r{r}", stage, SERVER_FLAGS)
        swarm.start_trainer("trainer-0", ["--batch-size", "4", "--in-flight", "12", "--discovery-period", "1"])
        trainer = swarm.children["trainer-0"]
        started, series, peers = time.monotonic(), [], []
        wait_for(lambda: (s := swarm.trainer_stats()) and s[0]["samples"] > 0, 180, "the first trained microbatch")
        first_sample = time.monotonic() - started
        # the moves take ~3 periods (a move waits up to --migration-drain-s for its stage's epoch to end); once the
        # trainer sees 2/2/2, SETTLED_PERIODS more are observed after the last change it saw, within a hard limit
        limit = time.monotonic() + 240
        while time.monotonic() < limit:
            assert trainer.alive(), swarm.tail(trainer)
            stats = swarm.trainer_stats()[0]
            now = time.monotonic() - started
            series.append((now, stats["samples"]))
            peers.append((now, stats["peers_per_stage"]))
            changed = max((t for (t, p), (_, q) in zip(peers[1:], peers, strict=False) if p != q), default=first_sample)
            if peers[-1][1] == [2, 2, 2] and now - changed > SETTLED_PERIODS * PERIOD:
                break
            time.sleep(1.0)
        final = swarm.trainer_stats()[0]
        made = moves(tmp_path)
        swarm.stop_all()

    log = "\n".join(f"{name}: {m}" for name, m in made.items())
    all_moves = [m for m in made.values() for m in m]
    print(f"\nmoves per server:\n{log}\npeers per stage over time: {peers[::5]}")
    for path in sorted(tmp_path.glob("server-*.log")):  # how long each move took, and why
        lines = path.read_text().splitlines()
        for line in lines:
            if MOVE_LOG.search(line):
                print(f"{path.stem}: {line[24:]}")
        stuck = next((i for i, line in enumerate(lines) if "--- stacks: the move" in line), None)
        if stuck is not None:  # a move outlasted its bound: what it waited on (swarm/stacks.py), for CI's log
            print("\n".join(lines[stuck : stuck + 300]))
    assert sorted(all_moves) == [(0, 1), (0, 2)], f"expected one move 0->1 and one 0->2:\n{log}"
    assert final["lost_microbatches"] == 0
    assert peers[-1][1] == [2, 2, 2], peers[-10:]

    # when the moves ended: the trainer sees 2/2/2 from then on
    settled = next(t for t, p in peers if p == [2, 2, 2] and all(q == [2, 2, 2] for u, q in peers if u >= t))
    before = rate(series, first_sample + 2, first_sample + 10)  # cooldown: nobody moves in a peer's first 15 s
    after = rate(series, settled + 5, series[-1][0])
    print(
        f"samples/s before {before:.2f}, after {after:.2f} ({after / before:.2f}x); settled at {settled:.0f}s, "
        f"first sample at {first_sample:.0f}s, retries {final['retries']}"
    )
    # 2/2/2 doubles the bottleneck's capacity; each stage then pays an all-reduce per epoch: 1.5-2.0x measured, and
    # the 8 s 'before' window varies by a fifth between runs on 2 shared cores
    assert after > 1.2 * before, (before, after)
    assert series[-1][0] - settled >= (SETTLED_PERIODS - 1) * PERIOD, "too few periods observed after the moves"


def test_stage_auto_joins_the_under_served_stage(tmp_path, marker):
    """Two stages, servers 2/1 (pinned) and no trainer: a server started with `--stage auto` joins stage 1, going by
    the capacities the servers measured at start (StageWorker.calibrate)."""
    model = [*MODEL, "--n-stages", "2"]
    with LocalSwarm(tmp_path, "auto", model) as swarm:
        swarm.start_dht()
        for stage, count in enumerate((2, 1)):
            for r in range(count):
                swarm.start_server(f"server-s{stage}-r{r}", stage, [*SERVER_FLAGS, "--no-rebalance"])
        logs = [tmp_path / f"server-s{s}-r{r}.log" for s, n in enumerate((2, 1)) for r in range(n)]
        wait_for(lambda: all(p.exists() and "serving at" in p.read_text() for p in logs), 180, "3 servers serving")
        time.sleep(3)  # a record announced by each
        swarm.start_server("server-auto", "auto", SERVER_FLAGS)
        auto_log = tmp_path / "server-auto.log"
        found = wait_for(lambda: re.search(r"joining stage (\d+)", auto_log.read_text()), 120, "the auto choice")
        wait_for(lambda: "serving at" in auto_log.read_text(), 60, "the auto server serving")
        swarm.stop_all()
    print("\n" + re.search(r"--stage auto: .*", auto_log.read_text()).group(0))
    assert found.group(1) == "1"
