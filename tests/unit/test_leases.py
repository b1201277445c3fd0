"""Stage 0's admission leases and callers' shares (server/collab/leases.py), on a made-up clock."""

import pytest

from server.collab.leases import FORGIVEN_AFTER, LEASE_FACTOR, MIN_LEASE_S, PENALTY_S, Leases

TIMEOUT = 30.0


def key(i: int) -> tuple:
    return ("stage0", f"mb-{i}", 0, 0)


def test_a_lease_is_a_multiple_of_its_callers_round_trips_within_bounds():
    leases = Leases(TIMEOUT)
    assert leases.lease_for("new") == TIMEOUT, "nobody measured yet: the admission timeout"
    for i in range(10):
        leases.grant(key(i), "trainer", 0, 4, now=float(i))
        leases.returned(key(i), now=i + 1.5)  # 1.5 s from admission to its Backward at stage 0
    assert leases.lease_for("trainer") == pytest.approx(LEASE_FACTOR * 1.5)
    assert leases.lease_for("new") == pytest.approx(LEASE_FACTOR * 1.5), "a new caller: what the others show"
    for i in range(10, 20):
        leases.grant(key(i), "fast", 0, 4, now=float(i))
        leases.returned(key(i), now=i + 0.01)
    assert leases.lease_for("fast") == MIN_LEASE_S


def test_a_dead_callers_admissions_run_out_and_are_admitted_again():
    leases = Leases(TIMEOUT)
    for i in range(8):  # a trainer that has shown 1 s round trips
        leases.grant(key(i), "trainer", 0, 4, now=float(i))
        leases.returned(key(i), now=i + 1.0)
    for i in range(8, 11):  # three in flight when it is killed
        leases.grant(key(i), "trainer", 1, 4, now=100.0)
    assert leases.run_out(now=100.0 + LEASE_FACTOR * 1.0 - 0.1) == []
    assert leases.run_out(now=100.0 + LEASE_FACTOR * 1.0) == [(1, 4)] * 3
    assert leases.holds("trainer") == 0 and leases.next_end() is None


def test_a_caller_that_walks_away_holds_its_share_while_others_wait_and_ever_less_after():
    leases = Leases(TIMEOUT)
    quota = 32
    leases.asked("hostile", now=0.0)
    assert leases.share("hostile", quota, now=0.0) == quota, "nobody waits: the whole batch"
    leases.asked("honest", now=0.0)
    leases.waited("honest", now=0.0)
    assert leases.share("hostile", quota, now=1.0) == 16, "another caller waits: half"
    assert leases.share("honest", quota, now=1.0) == quota, "the waiting one is not held back"
    for i in range(4):
        leases.grant(key(i), "hostile", 0, 4, now=1.0)
    assert leases.holds("hostile") == 16
    leases.run_out(now=1.0 + TIMEOUT)  # never came back
    for caller in ("hostile", "honest"):
        leases.asked(caller, now=31.0)
    leases.waited("honest", now=31.0)
    assert leases.share("hostile", quota, now=31.0) == 1, "each of its 4 leases that ran out halved 16"
    assert leases.share("honest", quota, now=31.0) == quota
    later = 31.0 + PENALTY_S
    for caller in ("hostile", "honest"):
        leases.asked(caller, now=later)
    leases.waited("honest", now=later)
    assert leases.share("hostile", quota, now=later + 0.5) == 16, "the penalty lapses PENALTY_S after it was earned"
    assert leases.share("hostile", quota, now=later + 20) == quota, "nobody waits: a caller is never held back"


def test_callers_whose_leases_all_ran_out_alike_share_the_batch_evenly():
    """A frozen peer held every trainer's microbatches: their leases ran out alike, and nobody is held back more than
    the others (penalties are relative: absolute ones would refuse every caller at once)."""
    leases = Leases(TIMEOUT)
    quota = 32
    for n, caller in enumerate(("one", "two")):
        leases.asked(caller, now=0.0)
        for i in range(4):
            leases.grant(key(10 * n + i), caller, 0, 4, now=0.0)
    leases.run_out(now=TIMEOUT)
    for caller in ("one", "two"):
        leases.asked(caller, now=TIMEOUT + 1)
        leases.waited(caller, now=TIMEOUT + 1)
    assert leases.share("one", quota, now=TIMEOUT + 1) == leases.share("two", quota, now=TIMEOUT + 1) == 16


def test_completing_some_admissions_does_not_wipe_out_the_ones_a_caller_walked_away_from():
    leases = Leases(TIMEOUT)
    quota, now = 32, 0.0
    for i in range(8):  # it completes two microbatches for each it drops, one such trio a second
        now = float(i)
        for caller in ("hostile", "honest"):
            leases.asked(caller, now)
        leases.waited("honest", now)
        for j in range(3):
            leases.grant(key(3 * i + j), "hostile", i, 4, now)
        leases.returned(key(3 * i), now + 0.2)
        leases.returned(key(3 * i + 1), now + 0.2)
        leases.run_out(now + 1.0 + MIN_LEASE_S)
    assert (
        leases.share("hostile", quota, now + 2.0 + MIN_LEASE_S) == 0
    ), "6 ran out in 10 s (2 more had no round trips to go by yet): 16 halved 6 times"
    assert leases.share("honest", quota, now + 2.0 + MIN_LEASE_S) == quota


def test_a_released_or_forgotten_lease_never_runs_out():
    leases = Leases(TIMEOUT)
    leases.grant(key(1), "t", 3, 4, now=0.0)
    leases.grant(key(2), "t", 4, 4, now=0.0)
    leases.released(key(1))  # its Forward failed: nothing was admitted
    leases.forget_before(5)  # batch 4 stepped
    assert leases.run_out(now=1e6) == []


def test_a_caller_earns_its_share_back_by_completing_admissions():
    """An honest trainer whose microbatches ran out behind a frozen peer: each FORGIVEN_AFTER of its admissions that
    come back afterwards forgive one run-out, and those that came back before pay for nothing."""
    leases = Leases(TIMEOUT)
    quota = 32
    for i in range(FORGIVEN_AFTER):  # completed before: no credit towards what runs out later
        leases.grant(key(i), "victim", 0, 4, now=0.0)
        leases.returned(key(i), now=0.5)
    for i in range(100, 102):
        leases.grant(key(i), "victim", 1, 4, now=1.0)
    leases.run_out(now=1.0 + TIMEOUT)

    def share(now: float) -> int:
        for caller in ("victim", "other"):
            leases.asked(caller, now)
        leases.waited("other", now)
        return leases.share("victim", quota, now)

    assert share(40.0) == 16 >> 2
    for i in range(200, 200 + FORGIVEN_AFTER):
        leases.grant(key(i), "victim", 2, 4, now=40.0)
        leases.returned(key(i), now=40.5)
    assert share(41.0) == 16 >> 1
    for i in range(300, 300 + FORGIVEN_AFTER):
        leases.grant(key(i), "victim", 3, 4, now=41.0)
        leases.returned(key(i), now=41.5)
    assert share(42.0) == 16
