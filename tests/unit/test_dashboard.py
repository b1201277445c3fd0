"""swarm-monitor: what it believes of other peers (unit), and swarm-local's Ctrl-C, which has to stop every process it
started. The page itself is tested in a real headless browser against the defaults run (test_integration.py)."""

import json
import math

from dht.records import PeerEntry, ServerRecord
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.rpc import PROTOCOL_VERSION
from tools.monitor import MAX_TEXT, PeerView, SwarmView, peer_view


def entry(peer: str, stage: int, ready: bool = True, host: str = "127.0.0.1") -> PeerEntry:
    return PeerEntry(peer, ServerRecord(host=host, port=4000, stage=stage, throughput=10.0, ready=ready), 0.0)


def info(stage: int, **fields) -> pb.InfoReply:
    base = dict(protocol_version=PROTOCOL_VERSION, stage=stage, epoch=3, samples_processed=100, recent_loss=2.5)
    return pb.InfoReply(**{**base, **fields})


def test_info_replies_are_checked_and_a_bad_one_shows_the_peer_as_not_answering():
    good = peer_view(entry("k1", 1), info(1, traffic=[pb.Traffic(role="activations", wire_bytes=10, fp32_bytes=40)]))
    assert (good.status, good.epoch, good.loss, good.samples) == ("serving", 3, 2.5, 100)
    assert good.traffic["activations"] == (10, 40)
    assert peer_view(entry("k1", 1), info(1, recent_loss=math.nan)).loss is None
    bad = [
        info(1, protocol_version=PROTOCOL_VERSION + 1),
        info(2),  # listed under stage 1, serves stage 2
        info(1, throughput=math.inf),
        info(1, throughput=-1.0),
        info(1, recent_loss=math.inf),
        info(1, recent_loss=-3.0),
        info(1, epoch=-1),
        info(1, samples_processed=2**63 - 1),
        info(1, rounds_failed=-5),
        info(1, traffic=[pb.Traffic(role=f"r{i}", wire_bytes=1, fp32_bytes=1) for i in range(17)]),
        info(1, traffic=[pb.Traffic(role="activations", wire_bytes=-1, fp32_bytes=1)]),
    ]
    for reply in bad:
        view = peer_view(entry("k1", 1), reply)
        assert (view.status, view.epoch, view.loss) == ("no answer", None, None), reply
    assert peer_view(entry("k1", 1), None).status == "no answer"
    assert peer_view(entry("k1", 1, ready=False), None).status == "joining"
    long = peer_view(entry("k1", 1), info(1, compression="x" * 10_000, transport="<b>" * 1000))
    assert len(long.compression) == len(long.transport) == MAX_TEXT
    odd_role = peer_view(entry("k1", 1), info(1, traffic=[pb.Traffic(role="<img src=x>", wire_bytes=1, fp32_bytes=1)]))
    assert set(odd_role.traffic) == {"allreduce_gradients"}, "roles that are not plain names are dropped"


def view(peer: str, stage: int, samples: int, loss: float | None = None, **kw) -> PeerView:
    fields = dict(address="a", status="serving", throughput=1.0, demand=0.0, queue=0, version=0)
    return PeerView(peer_id=peer, stage=stage, samples=samples, loss=loss, **{**fields, **kw})


def test_the_view_keeps_history_events_and_the_bytes_of_peers_that_left():
    v = SwarmView(history=100)
    v.update(0.0, 2, [view("a", 0, 0), view("b", 1, 0, traffic={"activations": (10, 40)})])
    assert v.state()["history"]["t"] == [], "a rate needs two polls"
    v.update(2.0, 2, [view("a", 0, 40), view("b", 1, 40, loss=3.0, traffic={"activations": (20, 80)})])
    v.update(4.0, 2, [view("a", 1, 80), view("c", 1, 10, loss=2.0, rounds_failed=0)])
    v.update(6.0, 2, [view("a", 1, 80, status="no answer"), view("c", 1, 30, loss=1.0, rounds_failed=2)])
    state = v.state()
    assert state["history"]["samples_per_s"] == [20.0, 0.0, 10.0]  # b left; a moved (no rate on its first poll)
    assert state["history"]["loss"] == [3.0, 2.0, 1.0]
    assert state["traffic"] == {"activations": {"wire": 20, "fp32": 80}}, "b's bytes stay after it left"
    kinds = [e["kind"] for e in reversed(state["events"])]
    assert kinds == ["joined", "joined", "moved", "joined", "left", "unreachable", "failed"]
    assert [p["peer_id"] for p in state["stages"][1]["peers"]] == ["a", "c"]
    json.dumps(state)  # what /api/state serves
