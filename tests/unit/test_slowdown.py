"""`--slowdown`: a server emulates a device N times slower than its own uncontended speed, whatever the CPU load.

The semantics are checked on a fake clock (exact numbers); the real-clock test checks that a tiny stage's
`throughput`, which trainers route by, drops to about 1/N.
"""

import time

import pytest
import torch

import server.compute
from server.config import ComputeConfig, OptimizerConfig
from server.worker import StageWorker
from swarm.config import tiny_test
from swarm.model import Stage

pytestmark = pytest.mark.timeout(60)
CPU = torch.device("cpu")


class FakeClock:
    """Stands in for the `time` module inside server.compute: work and sleeps move it forward, nothing waits."""

    def __init__(self) -> None:
        self.now = 0.0
        self.sleeps: list[float] = []

    def perf_counter(self) -> float:
        return self.now

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        assert seconds >= 0
        self.sleeps.append(seconds)
        self.now += seconds


@pytest.fixture
def clock(monkeypatch) -> FakeClock:
    fake = FakeClock()
    monkeypatch.setattr(server.compute, "time", fake)
    return fake


def worker(slowdown: float, stage: int = 0) -> StageWorker:
    """Stage 0 by default: its throughput counts forwards and backwards (the last stage's, backwards only)."""
    cfg = tiny_test()
    return StageWorker(Stage(cfg, stage), OptimizerConfig(), ComputeConfig(slowdown=slowdown), CPU)


def work(w: StageWorker, clock: FakeClock, seconds: float, kind: str = "backward", n: int = 4) -> float:
    """One timed piece of work that takes `seconds` of (fake) compute; -> seconds it held the compute thread."""
    start = clock.now
    with w.timing.timed(kind, n):
        clock.now += seconds
    return clock.now - start


def test_slowdown_stretches_to_n_times_the_fastest_time_seen(clock):
    w = worker(3.0)
    try:
        assert work(w, clock, 0.010) == pytest.approx(0.030)  # first of its kind: 3x itself
        assert work(w, clock, 0.020) == pytest.approx(0.030)  # contended: sleeps only the rest
        assert work(w, clock, 0.045) == pytest.approx(0.045)  # contended past 3x: never a negative sleep
        assert work(w, clock, 0.008) == pytest.approx(0.024)  # faster than ever: the new reference
        assert work(w, clock, 0.010) == pytest.approx(0.024)
        assert work(w, clock, 0.016, n=8) == pytest.approx(0.048)  # another batch size has its own reference
        assert work(w, clock, 0.002, kind="forward") == pytest.approx(0.006)  # and so has another kind of work
        assert clock.sleeps == pytest.approx([0.020, 0.010, 0.016, 0.014, 0.032, 0.004])
    finally:
        w.shutdown()


def test_throughput_reports_the_emulated_speed_whatever_the_contention(clock):
    slow, plain = worker(3.0), worker(1.0)
    try:
        for seconds in (0.010, 0.020, 0.015, 0.010, 0.025):  # the same work, more or less contended
            for w in (slow, plain):
                work(w, clock, seconds / 4, kind="forward")
                work(w, clock, seconds, kind="backward")
        # 4 samples per (forward 3 x 2.5 ms + backward 3 x 10 ms), every time: contention is absorbed by the sleep
        assert slow.throughput == pytest.approx(4 / (3 * 0.0025 + 3 * 0.010))
        assert plain.throughput < 4 / (0.0025 + 0.010)  # slowdown 1 reports what it actually took
    finally:
        slow.shutdown()
        plain.shutdown()


def test_no_sleep_without_slowdown(clock):
    w = worker(1.0)
    try:
        for seconds in (0.010, 0.030, 0.005):
            assert work(w, clock, seconds) == pytest.approx(seconds)
        assert clock.sleeps == []
    finally:
        w.shutdown()


@pytest.fixture
def one_thread():
    """Intra-op threads of a tiny model stall for whole scheduler slices on a loaded machine (one thread waits at a
    barrier for another that lost its core), which makes single calls 100x slower: time with one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def test_slowdown_3_gives_a_third_of_the_throughput_on_a_real_stage(one_thread):
    """A tiny last stage at slowdown 3 against the same stage at slowdown 1, interleaved so that both see the same
    load, each at its best: the slowed worker's highest reported throughput (its EMA over calls that were not slowed
    further by contention) against the unslowed one's fastest forward + backward, timed here. The ratio is 1/3; +-30%
    still fails on no slowdown (1), slowdown - 1 (1/2) or slowdown applied twice (1/9). Needs a machine on which the
    stage's work stays under 3x its fastest time for a few calls in a row: a second pair of fresh workers measures
    again if the first lands outside (seen once in CI at 0.232, noise in the slowed worker's own fastest time); every
    wrong slowdown above misses the range in both."""
    torch.manual_seed(0)
    cfg = tiny_test()
    inputs, labels = torch.randn(8, cfg.max_seq_len, cfg.d_model), torch.randint(0, cfg.vocab_size, (8, 16))
    ratios = []
    for _ in range(2):
        ratios.append(slowdown_ratio(cfg, inputs, labels))
        if 0.7 / 3 < ratios[-1] < 1.3 / 3:
            return
    raise AssertionError(f"slowdown 3: {ratios} of the throughput at slowdown 1, expected 1/3 +- 30%")


def slowdown_ratio(cfg, inputs: torch.Tensor, labels: torch.Tensor) -> float:
    """The slowed worker's best throughput against the plain one's fastest backward (see the test)."""
    slow, plain = worker(3.0, cfg.n_stages - 1), worker(1.0, cfg.n_stages - 1)
    fastest = {"forward": float("inf"), "backward": float("inf")}
    best_slow = 0.0
    try:
        for i in range(60):
            slow.forward(inputs)
            slow.backward(inputs, labels=labels)
            if i >= 30:  # the EMA has forgotten the first calls (allocation, lazy initialisation)
                best_slow = max(best_slow, slow.throughput)
            start = time.perf_counter()
            plain.forward(inputs)
            middle = time.perf_counter()
            plain.backward(inputs, labels=labels)
            end = time.perf_counter()
            fastest["forward"] = min(fastest["forward"], middle - start)
            fastest["backward"] = min(fastest["backward"], end - middle)
        return best_slow * fastest["backward"] / len(inputs)  # the last stage's work: its backward (with the loss)
    finally:
        slow.shutdown()
        plain.shutdown()


def test_slowdown_below_one_is_rejected():
    with pytest.raises(ValueError, match="--slowdown"):
        ComputeConfig(slowdown=0.5)
