"""Which listed servers a trainer routes to (swarm/vetting.py), on a fake clock."""

from swarm.vetting import FIRST_WAIT_S, MAX_WAIT_S, Vetting


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_listed_peer_is_routed_to_once_it_answered_as_itself():
    clock = Clock()
    v = Vetting(clock)
    assert v.listed({"a": "10.0.0.1:7000"}) == ["a"]
    assert not v.vetted("a") and v.listed({"a": "10.0.0.1:7000"}) == [], "one probe at a time"
    v.answered("a", "10.0.0.1:7000", ok=True)
    assert v.vetted("a") and v.listed({"a": "10.0.0.1:7000"}) == []
    assert v.listed({"a": "10.0.0.2:7000"}) == ["a"] and not v.vetted("a"), "another address: vetted afresh"
    v.listed({})
    assert not v.vetted("a"), "unlisted: forgotten"


def test_a_record_whose_address_never_answers_draws_ever_fewer_probes_and_no_work():
    clock = Clock()
    v = Vetting(clock)
    probes = []
    while clock.now < 300:
        for peer in v.listed({"sybil": "203.0.113.9:1"}):
            probes.append(clock.now)
            v.answered(peer, "203.0.113.9:1", ok=False)
        clock.now += 0.5
    assert not v.vetted("sybil")
    waits = [b - a for a, b in zip(probes, probes[1:], strict=False)]
    assert waits[0] >= FIRST_WAIT_S and all(b >= a for a, b in zip(waits, waits[1:], strict=False))
    assert max(waits) <= MAX_WAIT_S + 0.5 and len(probes) < 12, probes


def test_an_answer_about_an_old_address_vets_nothing():
    v = Vetting(Clock())
    v.listed({"a": "10.0.0.1:7000"})
    v.listed({"a": "10.0.0.2:7000"})  # it moved while the probe was out
    v.answered("a", "10.0.0.1:7000", ok=True)
    assert not v.vetted("a")
