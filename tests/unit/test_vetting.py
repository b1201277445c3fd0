"""Which listed servers count (swarm/vetting.py): vetting on a fake clock, and the probe against made-up answers."""

import types

from swarm.protocol import wire_pb2 as pb
from swarm.vetting import FIRST_WAIT_S, MAX_WAIT_S, Vetting, answers_as


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


async def test_a_probe_counts_only_an_answer_naming_the_peer_and_its_stage():
    """What comes back from a record's address is whatever its server sends: another peer's id, another stage, an
    empty reply, garbage that fails to parse or a call that never ends all count as not answering as itself."""
    answers: dict[str, object] = {
        "right": pb.InfoReply(peer_id="a", stage=1),
        "other peer": pb.InfoReply(peer_id="b", stage=1),
        "other stage": pb.InfoReply(peer_id="a", stage=2),
        "empty": pb.InfoReply(),
        "garbage": ValueError("Error parsing message"),
        "timeout": TimeoutError(),
    }

    class Stub:
        def __init__(self, address: str):
            self.address = address

        async def info(self, request, timeout):
            answer = answers[self.address]
            if isinstance(answer, Exception):
                raise answer
            return answer

    channels = types.SimpleNamespace(stub=Stub)
    got = {address: await answers_as(channels, address, "a", 1, 1.0) for address in answers}  # type: ignore[arg-type]
    assert got == {a: a == "right" for a in answers}
    assert await answers_as(channels, "other stage", "a", None, 1.0), "any stage: a peer still joining"  # type: ignore[arg-type]
