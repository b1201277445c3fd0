"""StageRouter: IWRR shares match peer capacity, bans hold until re-announce, joining peers are probed but not flooded."""

import heapq
import math
import random
import time

import pytest

from trainer.routing import StageRouter

pytestmark = pytest.mark.timeout(30)


class FakeClock:
    def __init__(self, now: float = 0.0):
        self.now = now

    def __call__(self) -> float:
        return self.now


def simulate(
    seconds_per_sample: dict[str, float], *, include_queue_wait: bool, microbatches: int = 3000, in_flight: int = 8
) -> dict[str, float]:
    """Discrete-event run of one stage: ``in_flight`` microbatches circulate; each peer serves its FIFO queue one task
    at a time; on completion the trainer reports the latency it saw and submits the next microbatch. Returns each
    peer's share of all samples served."""
    rng = random.Random(0)
    clock = FakeClock()
    router = StageRouter(clock=clock)
    router.update_peers(dict.fromkeys(seconds_per_sample, math.inf))
    free_at = dict.fromkeys(seconds_per_sample, 0.0)
    served = dict.fromkeys(seconds_per_sample, 0)
    events: list[tuple[float, int, str, int, float]] = []  # (finish time, seq, peer, task size, latency reported)

    def submit(seq: int) -> None:
        size = rng.randint(1, 8)
        peer = router.choose(size)
        assert peer is not None
        service = size * seconds_per_sample[peer] * rng.uniform(0.9, 1.1)
        free_at[peer] = max(clock.now, free_at[peer]) + service
        latency = free_at[peer] - clock.now if include_queue_wait else service
        heapq.heappush(events, (free_at[peer], seq, peer, size, latency))

    for seq in range(in_flight):
        submit(seq)
    submitted = in_flight
    while events:
        clock.now, _, peer, size, latency = heapq.heappop(events)
        router.report_success(peer, size, latency)
        served[peer] += size
        if submitted < microbatches:
            submit(submitted)
            submitted += 1
    total = sum(served.values())
    return {peer: count / total for peer, count in served.items()}


@pytest.mark.parametrize("include_queue_wait", [True, False], ids=["latency", "service_time"])
def test_shares_match_capacity(include_queue_wait: bool):
    # service times 1:2:4 -> capacities 4:2:1 -> shares 4/7, 2/7, 1/7
    shares = simulate({"fast": 1.0, "mid": 2.0, "slow": 4.0}, include_queue_wait=include_queue_wait)
    expected = {"fast": 4 / 7, "mid": 2 / 7, "slow": 1 / 7}
    for peer, share in shares.items():
        # absolute tolerance in share (0.05 = 5 percentage points), not relative to the expected share
        assert share == pytest.approx(expected[peer], abs=0.05), shares


def test_ban_holds_until_reannounce():
    clock = FakeClock()
    router = StageRouter(clock=clock)
    router.update_peers({"a": 100.0, "b": 100.0})
    for peer in ("a", "b"):
        router.report_success(peer, task_size=1, seconds=1.0)
    router.report_failure("a")
    assert router.available == ["b"]
    assert all(router.choose(1) == "b" for _ in range(10))

    router.update_peers({"a": 100.0, "b": 100.0})  # same record: not a re-announce
    assert router.available == ["b"]
    router.update_peers({"b": 100.0})  # vanishing does not forget the ban while the banned record is alive
    router.update_peers({"a": 100.0, "b": 100.0})
    assert router.available == ["b"]

    clock.now = 1.0  # a first failure holds its ban for at least a second
    router.update_peers({"a": 160.0, "b": 160.0})  # re-announced
    assert sorted(router.available) == ["a", "b"]
    assert not router.snapshot()["a"]["banned"]
    # its key was left behind while banned; it restarts at b's key, so it is not flooded with b's share of the work
    picks = [router.choose(1) for _ in range(10)]
    assert picks.count("a") == 5


def test_a_peer_that_timed_out_but_proved_alive_is_forgiven_twice_in_a_row_not_more():
    router = StageRouter(clock=FakeClock())
    router.update_peers({"a": 100.0, "b": 100.0})
    for peer in ("a", "b"):
        router.report_success(peer, task_size=1, seconds=1.0)
    assert not router.forgive("a"), "nothing to forgive"
    for _ in range(10):
        router.choose(1, exclude=["a"])  # b works on while a's ban stands
    for strike in (1, 2):
        router.report_failure("a", timed_out=True)
        assert router.available == ["b"]
        assert router.forgive("a"), strike
        assert sorted(router.available) == ["a", "b"]
        picks = [router.choose(1) for _ in range(10)]
        assert 1 <= picks.count("a") <= 5, "back at b's key (its EMA penalized): chosen soon, not flooded"
    router.report_failure("a", timed_out=True)
    assert not router.forgive("a"), "a third timeout in a row: answering probes is not serving"
    assert router.available == ["b"]


def test_a_record_restored_every_two_seconds_for_a_dead_server_draws_a_few_calls_a_minute():
    """Every re-store of its record would lift a plain ban: a forged record re-stored every 2 s drew 30 trainer calls in
    60 s. Bans double with each failure in a row (1, 2, 4, ... s), so it draws 6; a success starts over."""
    clock = FakeClock()
    router = StageRouter(clock=clock)
    calls = 0
    for tick in range(300):  # 60 s in steps of 0.2 s; the record is re-stored every 2 s
        clock.now = tick * 0.2
        router.update_peers({"real": 1000.0, "fake": 100.0 + 2 * (tick // 10)})
        if router.choose(1, exclude={"real"}) == "fake":
            calls += 1
            router.report_failure("fake")
    assert calls == 6, calls

    router.update_peers({"real": 1000.0, "fake": 1000.0})
    clock.now += 60.0
    router.update_peers({"real": 1000.0, "fake": 1001.0})
    assert router.choose(1, exclude={"real"}) == "fake"
    router.report_success("fake", 1, 1.0)  # it answered: its next failure is a first one again
    router.report_failure("fake")
    clock.now += 1.0
    router.update_peers({"real": 1000.0, "fake": 1002.0})
    assert "fake" in router.available


def test_calls_in_flight_that_fail_with_their_peer_make_one_strike():
    """Three microbatches in flight on one peer fail together: one outage, one strike (a 1 s ban, not 4 s)."""
    clock = FakeClock()
    router = StageRouter(clock=clock)
    router.update_peers({"a": 100.0, "b": 100.0})
    for _ in range(3):
        router.report_failure("a")
    assert router.available == ["b"]
    clock.now += 1.1
    router.update_peers({"a": 101.0, "b": 100.0})  # a re-announced
    assert sorted(router.available) == ["a", "b"]
    router.report_failure("a")  # failing again once back: a second strike
    clock.now += 1.1
    router.update_peers({"a": 102.0, "b": 100.0})
    assert router.available == ["b"], "the second ban lasts 2 s"


def test_new_peer_starts_at_minimum_key():
    router = StageRouter(clock=FakeClock())
    router.update_peers({"a": 100.0, "b": 100.0})
    for peer in ("a", "b"):
        router.report_success(peer, task_size=1, seconds=1.0)
    for _ in range(100):
        router.choose(1)
    keys = {peer: state["key"] for peer, state in router.snapshot().items()}

    router.update_peers({"a": 100.0, "b": 100.0, "c": 100.0})
    state = router.snapshot()["c"]
    assert state["key"] == min(keys.values())
    assert state["ema"] == 1.0  # median of the measured peers
    picks = [router.choose(1) for _ in range(30)]
    assert picks[0] == "c"
    assert picks.count("c") == 10  # equal speeds: a fair third, not all 30 to catch up with a's and b's keys


def test_unlisted_expired_and_excluded_peers_are_not_chosen():
    clock = FakeClock()
    router = StageRouter(clock=clock)
    assert router.choose(1) is None
    router.update_peers({"a": 100.0, "b": 100.0, "c": 50.0})
    router.update_peers({"a": 100.0, "c": 50.0})  # b left
    assert "b" not in {router.choose(1) for _ in range(20)}
    router.report_success("b", 1, 1.0)  # a late report about a departed peer is ignored
    router.report_failure("b")
    assert "b" not in router.snapshot()

    router.report_success("a", 1, 1.0)
    clock.now = 60.0  # c's record expired before the next DHT refresh
    assert router.available == ["a"]
    assert {router.choose(1) for _ in range(5)} == {"a"}
    assert router.choose(1, exclude={"a"}) is None

    router.update_peers({"a": 100.0, "c": 120.0})  # c re-announced: it re-enters at a's key, not its stale one
    assert router.snapshot()["c"]["key"] == router.snapshot()["a"]["key"] > 0
    assert {router.choose(1, exclude=["a"]) for _ in range(5)} == {"c"}
    router.update_peers({})
    assert router.available == [] and router.choose(1) is None


def test_timeout_penalty_raises_ema():
    router = StageRouter(timeout_penalty=2.0, clock=FakeClock())
    router.update_peers({"a": 100.0, "b": 100.0})
    router.report_success("a", task_size=4, seconds=2.0)
    router.report_success("b", task_size=4, seconds=2.0)
    router.report_failure("a", timed_out=True)
    router.report_failure("b", timed_out=False)
    assert router.snapshot()["a"]["ema"] == pytest.approx(1.0)
    assert router.snapshot()["b"]["ema"] == pytest.approx(0.5)  # a plain failure bans but says nothing about speed


def test_ema_update():
    router = StageRouter(alpha=0.1, clock=FakeClock())
    router.update_peers({"a": 100.0})
    router.report_success("a", task_size=2, seconds=2.0)  # first measurement replaces the prior
    router.report_success("a", task_size=2, seconds=4.0)
    assert router.snapshot()["a"]["ema"] == pytest.approx(0.9 * 1.0 + 0.1 * 2.0)


def test_a_preferred_peer_is_chosen_while_it_is_available_and_not_excluded():
    router = StageRouter()
    router.update_peers({"a": time.time() + 3600, "b": time.time() + 3600})
    assert [router.choose(1, prefer="b") for _ in range(3)] == ["b"] * 3  # whatever its key
    assert router.choose(1, exclude={"b"}, prefer="b") == "a"
    assert router.choose(1, prefer="gone") in ("a", "b")
    router.report_failure("b")
    assert router.choose(1, prefer="b") == "a"
