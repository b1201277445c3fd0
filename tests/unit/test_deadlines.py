"""The trainer's per-call deadlines (trainer/deadlines.py): pure policy, no network."""

import pytest

from trainer.deadlines import CallDeadlines


def test_the_cap_until_calls_are_measured_then_a_multiple_of_the_slowest_recent_one():
    d = CallDeadlines(cap=60, floor=2, factor=4, window=4, warmup=3)
    for seconds in (0.5, 1.0):
        assert d.deadline(1, "Forward") == 60
        d.succeeded(1, "Forward", seconds)
    d.succeeded(1, "Forward", 0.7)
    assert d.deadline(1, "Forward") == 4.0  # 4 x 1.0
    assert d.deadline(1, "Backward") == 60 and d.deadline(2, "Forward") == 60  # each kind on its own
    for _ in range(4):
        d.succeeded(1, "Forward", 0.1)
    assert d.deadline(1, "Forward") == 2.0  # the slow call left the window; 4 x 0.1 is below the floor


def test_timeouts_double_the_deadline_up_to_the_cap_and_successes_bring_it_back():
    d = CallDeadlines(cap=60, floor=2, factor=4, window=8, warmup=1)
    d.succeeded(0, "Forward", 1.0)
    assert d.deadline(0, "Forward") == 4
    d.timed_out(0, "Forward")
    d.timed_out(0, "Forward")
    assert d.deadline(0, "Forward") == 16
    for _ in range(10):
        d.timed_out(0, "Forward")
    assert d.deadline(0, "Forward") == 60
    for _ in range(10):
        d.succeeded(0, "Forward", 1.0)
    assert d.deadline(0, "Forward") == 4


def test_bad_settings_are_refused():
    with pytest.raises(ValueError):
        CallDeadlines(cap=1, floor=2)
    with pytest.raises(ValueError):
        CallDeadlines(cap=10, floor=1, factor=0.5)
