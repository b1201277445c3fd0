"""hivemind's averager, with the codecs we use, really averages. Regression test for a known silent failure: with
numpy >= 2.4, hivemind's 8-bit codecs fail on decode inside the averager, which swallows the error: step() returns and
nothing is averaged. Two DHT nodes give the two averagers separate identities inside one test process."""

import asyncio
import contextlib
import logging
import os
import signal
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.matchmaking import MatchmakingException
from hivemind.compression import serialize_torch_tensor
from hivemind.p2p import P2P, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils import get_dht_time
from hivemind.utils.asyncio import as_aiter

from dht.forking import forking
from dht.node import start_dht
from server.collab.compat.averager import MAX_WAITING_PARTS, AveragerClosed, StrictAverager
from server.collab.compat.process import ClosesReplica
from server.collab.compat.runner import ExactAllReduceRunner
from server.collab.stage_averager import hivemind_compression
from swarm.compression import get_codec
from tests.conftest import wait_for
from tests.unit.test_averaging import CountsEnds, CutShort

pytestmark = pytest.mark.timeout(120)


def shut_down(averagers: list, dhts: list) -> None:
    for averager in averagers:
        averager.shutdown()
    for dht in dhts:
        dht.shutdown()


def run_round(
    averager_cls, codec: str, tensors: list[list[torch.Tensor]], robust_clip: float = 0.0, max_weight: float = 0.0
) -> list[list[torch.Tensor]]:
    """One all-reduce among len(tensors) peers (peer i has weight i + 1); returns each peer's tensors after it.
    StrictAverager only: `robust_clip`, and `max_weight` (if > 0), set on every peer.

    A round can end for some peers and fail for another (one CI run: a peer got 7% of the averaged parts back, the
    others finished, and its retry found nobody for 30 s): hivemind cannot make a round's last messages atomic, and
    the stage handles that case elsewhere (server/collab/recovery.py). Then the round is run once more, by fresh
    peers from the same tensors; a second such round fails the test."""
    for attempt in range(2):
        results = _one_round(averager_cls, codec, tensors, robust_clip, max_weight, attempt)
        if results is not None:
            return results
        logging.getLogger(__name__).warning("round %d ended for some peers and failed for others: again", attempt)
    pytest.fail("the all-reduce did not end for every peer, twice in a row")


def _one_round(
    averager_cls, codec: str, tensors: list[list[torch.Tensor]], robust_clip: float, max_weight: float, attempt: int
) -> list[list[torch.Tensor]] | None:
    boot = start_dht()
    dhts = [start_dht([str(m) for m in boot.get_visible_maddrs()]) for _ in tensors]
    averagers = [
        averager_cls(
            averaged_tensors=[t.clone() for t in ts],
            dht=dht,
            prefix=f"avgtest_{averager_cls.__name__}_{codec}_{int(robust_clip)}_{int(max_weight)}_{attempt}",
            start=False,
            min_matchmaking_time=1.0,
            request_timeout=0.5,
            compression=hivemind_compression(get_codec(codec)),
            target_group_size=len(tensors),
        )
        for ts, dht in zip(tensors, dhts, strict=True)
    ]
    with forking():  # the children must not finalize what earlier tests left in this process (dht/forking.py)
        for averager in averagers:
            if robust_clip:
                averager.robust_clip = robust_clip
            if max_weight:
                averager.max_weight = max_weight
            averager.run_in_background(await_ready=True)
    try:
        when = get_dht_time() + 1.0
        results: list = [None] * len(tensors)

        def step(i: int) -> None:
            results[i] = averagers[i].step(weight=1.0 + i, scheduled_time=when, timeout=30)

        threads = [threading.Thread(target=step, args=(i,)) for i in range(len(tensors))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        if any(r is None for r in results):
            return None
        out = []
        for averager in averagers:
            with averager.get_tensors() as got:
                out.append([t.clone() for t in got])
        return out
    finally:
        shut_down(averagers, [*dhts, boot])


@pytest.mark.parametrize("codec", ["none", "blockwise8"])
def test_two_peers_average_for_real(codec):
    """hivemind's own averager, with our codecs: it averages (with numpy >= 2.4 its 8-bit decode failed silently)."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(50_000, generator=gen), torch.randn(50_000, generator=gen)
    expected = (a + 2 * b) / 3  # weighted by 1 and 2
    results = run_round(ClosesReplica, codec, [[a], [b]])  # hivemind's averager, which leaves no socket behind
    for (got,) in results:
        err = ((got - expected).norm() / expected.norm()).item()
        moved = min((got - a).norm().item(), (got - b).norm().item()) / expected.norm().item()
        assert moved > 0.3, "values did not change: the averager did nothing"
        assert err < (1e-6 if codec == "none" else 3e-2), err
    if codec == "blockwise8":  # why stage peers use the exact runner: each peer keeps its own compression error
        assert not torch.equal(results[0][0], results[1][0])


@pytest.mark.parametrize("codec", ["none", "blockwise8"])
def test_stage_averager_hands_every_peer_the_same_average(codec):
    """Three peers, two tensors split in parts across them: after the round every peer holds bitwise the same values,
    within the codec's error of the weighted mean."""
    gen = torch.Generator().manual_seed(1)
    tensors = [[torch.randn(40_000, generator=gen), torch.randn(30, 100, generator=gen)] for _ in range(3)]
    results = run_round(StrictAverager, codec, tensors)
    for k in range(2):
        expected = sum((i + 1) * tensors[i][k] for i in range(3)) / 6
        for peer in results:
            assert torch.equal(peer[k], results[0][k]), "peers hold different averages"
            err = ((peer[k] - expected).norm() / expected.norm()).item()
            assert err < (1e-6 if codec == "none" else 3e-2), err


def test_robust_aggregation_bounds_a_peer_that_sends_garbage_and_peers_still_agree():
    """--robust-clip: three honest peers and one whose gradient is huge (finite, so no check refuses it), with a
    tenth of the weight. The weighted mean is ruined; the robust mean stays within the honest peers' spread of their
    mean, and every peer ends bitwise equal. Without an outlier it stays close to the weighted mean."""
    gen = torch.Generator().manual_seed(2)
    honest = [torch.randn(20_000, generator=gen) * 0.1 + 1.0 for _ in range(3)]
    garbage = torch.full((20_000,), 1e4)
    weights = [2.0, 3.0, 4.0]  # run_round weighs peer i by i + 1: the garbage comes first
    honest_mean = sum(w * t for w, t in zip(weights, honest, strict=True)) / sum(weights)
    spread = max((t - honest_mean).norm() for t in honest)

    results = run_round(StrictAverager, "none", [[t] for t in (garbage, *honest)], robust_clip=1.0)
    for (got,) in results:
        assert torch.equal(got, results[0][0]), "peers hold different averages"
    off = (results[0][0] - honest_mean).norm()
    plain = ((garbage + sum(w * t for w, t in zip(weights, honest, strict=True))) / 10 - honest_mean).norm()
    assert off < spread < plain / 1000, (off, spread, plain)

    (got,), *_ = run_round(StrictAverager, "none", [[t] for t in honest], robust_clip=1.0)
    expected = sum((i + 1) * t for i, t in enumerate(honest)) / 6
    assert ((got - expected).norm() / expected.norm()) < 0.01


def test_a_peer_weighs_no_more_than_one_epoch_can_hold_whatever_it_declares():
    """A peer's weight is its own word (its samples): each reducer caps every sender's weight, its own included, at
    what one epoch can hold (max_weight), so a peer declaring 1e9 samples counts as the cap, not as the whole stage,
    whichever peer reduces which part (CI once had b reduce everything, with its own weight uncapped)."""
    a, b = torch.zeros(30_000), torch.full((30_000,), 10.0)
    results = run_round(StrictAverager, "none", [[a], [b]], max_weight=1.5)  # b declares weight 2
    for (got,) in results:
        assert torch.allclose(got, (1.0 * a + 1.5 * b) / 2.5)


@contextlib.contextmanager
def fixed_group(prefix: str, values: list[torch.Tensor], **kwargs):
    """Peers in a fixed group (one per tensor of `values`), each a StrictAverager on its own DHT node; `kwargs` go to
    every averager (part sizes, timeouts). Yields the peers (not yet running: set what the process must inherit, then
    start them) and `round_of(weights)`: one round at those weights, returning each peer's result (the round's peers,
    or the exception its step raised) and its tensor after the round."""
    boot = start_dht()
    dhts = [start_dht([str(m) for m in boot.get_visible_maddrs()]) for _ in values]
    common = dict(prefix=prefix, start=False, min_matchmaking_time=1.0, request_timeout=0.5, allreduce_timeout=5.0)
    peers = [
        StrictAverager(averaged_tensors=[v.clone()], dht=dht, **{**common, **kwargs})
        for v, dht in zip(values, dhts, strict=True)
    ]

    def round_of(weights: list[float]) -> tuple[list, list[torch.Tensor]]:
        results: list = [None] * len(peers)

        def step(i: int) -> None:
            try:
                results[i] = peers[i].step(weight=weights[i], timeout=8, allow_retries=False)
            except Exception as e:
                results[i] = e

        threads = [threading.Thread(target=step, args=(i,)) for i in range(len(peers))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        outs = []
        for peer in peers:
            with peer.get_tensors() as (got,):
                outs.append(got.clone())
        return results, outs

    def start() -> None:
        with forking():  # see run_round
            for peer in peers:
                peer.run_in_background(await_ready=True)
        ids = [str(p.peer_id) for p in peers]
        for peer in peers:
            peer.fix_group([i for i in ids if i != str(peer.peer_id)], gather_timeout=3.0)

    try:
        yield peers, start, round_of
    finally:
        shut_down(peers, [*dhts, boot])


def test_a_round_asked_of_an_averager_that_is_shutting_down_is_refused_at_once():
    """`step` and `shutdown` send down one pipe, and a step sent after the shutdown waited forever for the process to
    take it: a server's compute thread that entered a round as the server stopped held the server's shutdown, which
    waits for that thread (CI). Now the step raises at once, and a second shutdown does nothing."""
    with fixed_group("avgtest_closing", [torch.zeros(100)]) as (peers, start, _round_of):
        start()
        (peer,) = peers
        peer.shutdown()
        outcome: list = []

        def step() -> None:
            try:
                outcome.append(peer.step(weight=1.0, timeout=5, wait=False))
            except AveragerClosed as e:
                outcome.append(e)

        thread = threading.Thread(target=step, daemon=True)
        thread.start()
        thread.join(10)
        assert len(outcome) == 1 and isinstance(outcome[0], AveragerClosed), outcome
        peer.shutdown()


def test_a_group_whose_weights_add_up_to_more_than_an_epoch_fails_for_every_peer():
    """Each peer's weight is capped (above), but a liar under the cap could still outweigh honest peers. The stage's
    peers share one epoch's samples, so the group's weights together have a bound too (max_total_weight): three peers
    in a fixed group declaring 1, 2 and 5 samples against a bound of 8 average as usual; when the third declares 10
    (its own cap), every peer's round fails and nobody's values change."""
    values = [torch.full((6000,), v) for v in (1.0, 4.0, 10.0)]
    with fixed_group("avgtest_total", values) as (peers, start, round_of):
        for peer in peers:
            peer.max_weight, peer.max_total_weight = 10.0, 8.0
        start()
        results, outs = round_of([1.0, 2.0, 5.0])
        assert all(isinstance(r, dict) and len(r) == 3 for r in results), results
        assert all(torch.equal(o, outs[0]) for o in outs), "peers hold different averages"
        assert torch.allclose(outs[0], (1 * values[0] + 2 * values[1] + 5 * values[2]) / 8)

        for peer, v in zip(peers, values, strict=True):
            with peer.get_tensors() as (got,):
                got.copy_(v)
        results, outs = round_of([1.0, 2.0, 10.0])
        assert not any(isinstance(r, dict) for r in results), results
        for got, v in zip(outs, values, strict=True):
            assert torch.equal(got, v), "a failed round changed a peer's values"


def test_a_peer_weighs_what_its_admissions_prove_in_the_parts_others_reduce():
    """The weight a peer declares is its word; each peer caps the others' at what their admissions proved to it
    (server/collab/served.py, through `cap_weights`). Three peers in a fixed group prove 1, 2 and 2 samples; the
    third declares 6. The parts a and b reduce count it at 2, not 6; the part it reduces itself counts what it
    declares (a reducer makes its own part: caps cannot bound that), and every peer ends with the same values. A
    listed peer that a cap does not name weighs nothing in the parts of the peer that set it."""
    values = [torch.full((30_000,), v) for v in (0.0, 3.0, 30.0)]
    with fixed_group("avgtest_proven", values, part_size_bytes=4096) as (peers, start, round_of):
        start()
        ids = [str(p.peer_id) for p in peers]
        for peer in peers[:2]:
            peer.cap_weights({ids[0]: 1.0, ids[1]: 2.0, ids[2]: 2.0})
        results, outs = round_of([1.0, 2.0, 6.0])
        assert all(isinstance(r, dict) and len(r) == 3 for r in results), results
        assert all(torch.equal(o, outs[0]) for o in outs), "peers hold different averages"
        capped, own = (1 * 0.0 + 2 * 3.0 + 2 * 30.0) / 5, (1 * 0.0 + 2 * 3.0 + 6 * 30.0) / 9
        got = outs[0]
        in_capped = torch.isclose(got, torch.tensor(capped)).float().mean().item()
        in_own = torch.isclose(got, torch.tensor(own)).float().mean().item()
        assert in_capped + in_own == 1.0, (got.unique(), capped, own)
        assert 0.5 < in_capped < 0.8, in_capped  # about 2 parts of 3: those a and b reduce

        for peer, v in zip(peers, values, strict=True):
            with peer.get_tensors() as (tensor,):
                tensor.copy_(v)
        for peer in peers[:2]:
            peer.cap_weights({ids[0]: 1.0, ids[1]: 2.0})  # nothing proven by the third
        results, outs = round_of([1.0, 2.0, 6.0])
        assert all(isinstance(r, dict) and len(r) == 3 for r in results), results
        got = outs[0]
        in_capped = torch.isclose(got, torch.tensor((1 * 0.0 + 2 * 3.0) / 3)).float().mean().item()
        assert 0.5 < in_capped < 0.8, (in_capped, got.unique())


class BreaksOffToOnePeer(ExactAllReduceRunner):
    """A sender that sends the first reducer after itself only the first of its parts, then ends the stream; every
    other reducer gets all of its parts."""

    async def _generate_input_for_peer(self, peer_index: int):
        others = [i for i, p in enumerate(self.ordered_peer_ids) if p != self.peer_id]
        sent = 0
        async for message in super()._generate_input_for_peer(peer_index):
            if peer_index == others[0] and sent == 1:
                return
            yield message
            sent += 1


def test_a_round_in_which_a_sender_breaks_off_to_one_reducer_fails_for_every_peer():
    """Three peers, each reducing several parts; the third breaks off after its first part to the first reducer after
    it and sends everything to the other. hivemind's reducer finishes that part without the sender and hands it on,
    so the other honest peer, whose own part was whole, ended the round with a partial average as a success (CI: a
    tied round where one peer stepped on two peers' average while the other failed). Now nobody's round succeeds and
    no peer's values change, round after round."""
    values = [torch.full((12_000,), v) for v in (1.0, 4.0, 10.0)]
    with fixed_group("avgtest_breaks_off", values, part_size_bytes=4096) as (peers, start, round_of):
        peers[2].runner_type = BreaksOffToOnePeer
        start()
        for _ in range(3):
            results, outs = round_of([1.0, 1.0, 1.0])
            assert not any(isinstance(r, dict) for r in results), results
            for got, v in zip(outs, values, strict=True):
                assert torch.equal(got, v), "a failed round changed a peer's values"


def test_a_sender_closes_its_stream_once_every_part_came_back_and_reducers_hold_theirs_until_then():
    """A reducer that closed its stream right after its last averaged part lost that part in flight now and then (the
    sender's round failed: "sent 2 parts, but we expected 3"); a reducer now holds the stream until the sender has read
    every part and closed it. Here reducers would hold it for 60 s: three peers of several parts each still end three
    rounds in a row, each within its 5 s all-reduce timeout, with the same weighted mean (hivemind's sender read on
    until the reducer closed, and failed every round here)."""
    values = [torch.full((12_000,), v) for v in (1.0, 4.0, 10.0)]
    with fixed_group("avgtest_sender_closes", values, part_size_bytes=4096) as (peers, start, round_of):
        for peer in peers:
            peer.reply_linger_s = 60.0  # before its process forks
        start()
        for _ in range(3):
            for peer, v in zip(peers, values, strict=True):
                with peer.get_tensors() as (got,):
                    got.copy_(v)
            results, outs = round_of([1.0, 2.0, 3.0])
            assert all(isinstance(r, dict) and len(r) == 3 for r in results), results
            assert all(torch.equal(o, outs[0]) for o in outs), "peers hold different averages"
            assert torch.allclose(outs[0], (1 * values[0] + 2 * values[1] + 3 * values[2]) / 6)


async def test_a_sender_closes_its_stream_to_a_reducer_as_soon_as_its_last_part_came_back():
    """The sender's side of a stream to a remote reducer, over two real libp2p daemons: the reducer answers each of 3
    parts and then holds the stream (60 s here, as `reply_linger_s` would). The sender registers the 3 averaged parts
    and closes the stream at once, which ends the reducer's handler; hivemind's sender read on until the reducer
    closed, so both would have waited out the hold."""
    server, client = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"]), None
    ended = asyncio.Event()

    async def reducer(requests, _context):
        try:
            async for request in requests:
                yield averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=request.tensor_part)
            await asyncio.sleep(60.0)
        finally:
            ended.set()

    try:
        client = await P2P.create(initial_peers=await server.get_visible_maddrs())
        name = "avgtest_closes::rpc_aggregate_part"
        await server.add_protobuf_handler(
            name, reducer, averaging_pb2.AveragingData, stream_input=True, stream_output=True
        )
        parts = [torch.full((100,), float(i)) for i in range(3)]
        got: list[torch.Tensor] = []

        async def inputs():
            for part in parts:
                yield averaging_pb2.AveragingData(tensor_part=serialize_torch_tensor(part))

        runner = ExactAllReduceRunner.__new__(ExactAllReduceRunner)  # the sender's side only
        runner.tensor_part_container = SimpleNamespace(
            num_parts_by_peer=[len(parts)], prefetch=1, register_processed_part=lambda _p, _i, t: got.append(t)
        )
        runner.peer_id, runner.reducer_timeout, runner.should_delay_results = client.peer_id, 10.0, lambda _peer: False
        runner._generate_input_for_peer = lambda _index: inputs()
        runner._get_peer_stub = lambda _peer: SimpleNamespace(
            rpc_aggregate_part=lambda requests: client.iterate_protobuf_handler(
                server.peer_id, name, requests, averaging_pb2.AveragingData
            )
        )
        async with asyncio.timeout(10):
            await runner._exchange_with(server.peer_id, 0)
            assert all(torch.equal(x, y) for x, y in zip(got, parts, strict=True))
            await ended.wait()  # the reducer's handler ended: our close reached it
    finally:
        for p2p in (client, server):
            if p2p is not None:
                await p2p.shutdown()


@pytest.mark.parametrize(
    "theirs",
    [
        [7, "full", "blockwise8"],  # another epoch's round
        [6, "q", "acp-rank4-reuse1"],  # another phase of it
        [6, "p", "acp-rank8-reuse1"],  # factors of another rank: they would not add up
        None,  # no round data at all
        "garbage",  # gathered bytes that are not msgpack
        "short",  # a peer entry without its gathered data
    ],
)
async def test_a_group_that_gathered_other_rounds_is_refused_before_anything_is_sent(theirs):
    """The averager's process reads what every groupmate gathered and refuses the group unless all gathered exactly
    ours: it never reaches the tensors (this averager has none) or the network (it has no p2p)."""
    averager = StrictAverager.__new__(StrictAverager)  # nothing started: a refusal must not need it
    averager._parent_pid = -1  # hivemind's __del__ then leaves the never-started process alone
    dumps = DecentralizedAverager.serializer.dumps
    ours = [6, "p", "acp-rank4-reuse1"]
    entries = {
        "garbage": b"\xc1\xc1 not msgpack",
        "short": dumps([1.0, 0]),
    }
    theirs_entry = entries.get(theirs) if isinstance(theirs, str) else dumps([1.0, 0, dumps(theirs)])
    group = GroupInfo(
        group_id=b"g",
        peer_ids=(PeerID(b"a" * 34), PeerID(b"b" * 34)),
        gathered=(dumps([1.0, 0, dumps(ours)]), theirs_entry),
    )
    with pytest.raises(MatchmakingException, match="rounds|malformed"):
        await averager._aggregate_with_group(group, min_vector_size=0)


def test_a_stranger_under_the_prefix_never_joins_the_stage_round():
    """Two peers told each other's libp2p ids (the stage's signed records) and a third averager under the same prefix
    with the same tensors, stepping at the same time: the two average with each other alone, and the stranger's
    values (large, finite) reach neither. Without the members, all three form one group."""
    a, b, stranger_values = torch.full((1000,), 1.0), torch.full((1000,), 4.0), torch.full((1000,), 1e4)
    boot = start_dht()
    dhts = [start_dht([str(m) for m in boot.get_visible_maddrs()]) for _ in range(3)]
    common = dict(prefix="avgtest_members", start=True, min_matchmaking_time=1.0, request_timeout=0.5)
    with forking():  # see run_round
        peers = [
            StrictAverager(averaged_tensors=[t.clone()], dht=dht, **common)
            for t, dht in zip((a, b), dhts[:2], strict=True)
        ]
        # hivemind names handlers by class: a stranger that wants in runs the same class, without being told members
        stranger = StrictAverager(averaged_tensors=[stranger_values.clone()], dht=dhts[2], **common)
    try:
        for peer, other in zip(peers, reversed(peers), strict=True):
            peer.expect_group(None, [str(other.peer_id), "not a peer id"])
        when = get_dht_time() + 2.0
        results: list = [None] * 3

        def step(i: int, averager: DecentralizedAverager) -> None:
            try:
                results[i] = averager.step(weight=1.0 + i, scheduled_time=when, timeout=5)
            except Exception as e:  # the stranger's round may fail: it found nobody who would have it
                results[i] = e

        threads = [threading.Thread(target=step, args=(i, x)) for i, x in enumerate((*peers, stranger))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        for peer, result in zip(peers, results, strict=False):
            assert isinstance(result, dict) and set(result) == {p.peer_id for p in peers}, result
            with peer.get_tensors() as (got,):
                assert torch.allclose(got, (a + 2 * b) / 3), got[:3]
    finally:
        shut_down([*peers, stranger], [*dhts, boot])


def averagers_of(kind: type[StrictAverager], values: list[torch.Tensor], prefix: str) -> tuple:
    """(a bootstrap DHT node, one DHT node per value, one started averager of `kind` per value on it)."""
    boot = start_dht()
    dhts = [start_dht([str(m) for m in boot.get_visible_maddrs()]) for _ in values]
    common = dict(prefix=prefix, start=True, min_matchmaking_time=1.0, request_timeout=0.5, allreduce_timeout=5.0)
    with forking():  # see run_round
        peers = [kind(averaged_tensors=[v.clone()], dht=dht, **common) for v, dht in zip(values, dhts, strict=True)]
    return boot, dhts, peers


def test_fixed_groups_average_without_matchmaking_and_a_peer_that_sees_another_group_fails_alone():
    """Fixed groups (--fixed-groups): three peers told the round's members step 0.6 s apart, with no matchmaking; the
    first two wait for the last, and all three end with the same weighted mean. Then a and b fix a group of the two
    of them while c still names all three: a and b average together at once (c's values reach neither), and c's
    round fails instead of waiting for a group that never forms. Last, c does not come at all: with a gather timeout
    of 1 s, a's and b's round fails within seconds, not at the all-reduce timeout."""
    values = [torch.full((5000,), v) for v in (1.0, 4.0, 10.0)]
    boot, dhts, peers = averagers_of(StrictAverager, values, "avgtest_fixed")
    ids = [str(p.peer_id) for p in peers]
    results: list = [None] * 3

    def step(i: int, delay: float) -> None:
        time.sleep(delay)
        try:
            results[i] = peers[i].step(weight=1.0 + i, timeout=8, allow_retries=False)
        except Exception as e:
            results[i] = e

    def run(delays: list[float]) -> float:
        started = time.monotonic()
        threads = [threading.Thread(target=step, args=(i, d)) for i, d in enumerate(delays)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        return time.monotonic() - started

    try:
        for peer in peers:
            peer.fix_group([i for i in ids if i != str(peer.peer_id)])
        run([0.0, 0.6, 1.2])
        assert all(isinstance(r, dict) and len(r) == 3 for r in results), results
        outs = []
        for peer in peers:
            with peer.get_tensors() as (got,):
                outs.append(got.clone())
        assert all(torch.equal(o, outs[0]) for o in outs), "peers hold different averages"
        assert torch.allclose(outs[0], (1 * values[0] + 2 * values[1] + 3 * values[2]) / 6)

        for peer, v in zip(peers, values, strict=True):
            with peer.get_tensors() as (got,):
                got.copy_(v)
        peers[0].fix_group([ids[1]])
        peers[1].fix_group([ids[0]])  # c still names a, b and itself
        took = run([0.0, 0.0, 0.0])
        assert all(isinstance(r, dict) and len(r) == 2 for r in results[:2]), results
        assert not isinstance(results[2], dict), "c averaged with a group that is not its own"
        for peer in peers[:2]:
            with peer.get_tensors() as (got,):
                assert torch.allclose(got, (1 * values[0] + 2 * values[1]) / 3), got[:3]
        assert took < 8, f"c's failed round took {took:.1f}s"

        # a member that never comes (frozen, say): with a gather timeout the others' round fails soon after it
        for peer in peers[:2]:
            peer.fix_group([i for i in ids if i != str(peer.peer_id)], gather_timeout=1.0)
        results[2] = "c did not step"
        started = time.monotonic()
        threads = [threading.Thread(target=step, args=(i, 0.0)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        took = time.monotonic() - started
        assert not any(isinstance(r, dict) for r in results[:2]), results
        assert took < 4, f"a round waiting for a member that never came took {took:.1f}s"
    finally:
        shut_down(peers, [*dhts, boot])


class FixedGroupAverager(StrictAverager):
    fixed_groups = True  # as build_averaging and build_tied set it before the process forks


def test_a_peer_that_begins_its_first_fixed_round_late_is_waited_for():
    """Servers fix each round's group just before they step it. A part sent to a member that has not begun its first
    fixed round was refused at once (hivemind's "no such group"): the sender's attempt failed, and its partners'
    with it, until every member had begun (epoch 0 of a tied swarm). It waits for that member now, as it does for a
    member of the group the peer was last told of."""
    values = [torch.full((5000,), v) for v in (1.0, 4.0)]
    boot, dhts, peers = averagers_of(FixedGroupAverager, values, "avgtest_first_fixed")
    ids = [str(p.peer_id) for p in peers]
    results: list = [None, None]

    def first_round(i: int, delay: float) -> None:
        time.sleep(delay)
        peers[i].fix_group([ids[1 - i]], gather_timeout=5.0)  # as the server does: right before its step
        try:
            results[i] = peers[i].step(weight=1.0, timeout=8, allow_retries=False)
        except Exception as e:
            results[i] = e

    try:
        threads = [threading.Thread(target=first_round, args=(i, 1.0 * i)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert all(isinstance(r, dict) and len(r) == 2 for r in results), results
        for peer in peers:
            with peer.get_tensors() as (got,):
                assert torch.equal(got, torch.full((5000,), 2.5)), got[:3]
    finally:
        shut_down(peers, [*dhts, boot])


async def test_parts_that_wait_for_a_first_fixed_round_are_bounded_and_strangers_never_wait():
    """The averager process's handler alone (no round begins): a flood of parts for a made-up group, from a peer id
    nobody lists, before our first fixed round. In a public swarm at most MAX_WAITING_PARTS of them wait (each until
    the all-reduce timeout), the rest get hivemind's "no such group" at once; in a private swarm, where the stage's
    records do not list that peer, none waits."""
    averager = object.__new__(FixedGroupAverager)  # its handler's state only: no process, no DHT
    averager._parent_pid = -1  # hivemind's __del__ shuts down only the process that made it
    averager._running_groups, averager._allreduce_timeout, averager._giving_way = {}, 1.0, set()
    averager._pending_groups_registered = asyncio.Event()
    averager._pending_groups_registered.set()
    forger = SimpleNamespace(remote_id=PeerID(b"\x00" * 34))

    async def ask() -> tuple[float, list]:
        started = time.monotonic()
        request = averaging_pb2.AveragingData(code=averaging_pb2.PART_FOR_AVERAGING, group_id=os.urandom(20))
        replies = [m async for m in averager.rpc_aggregate_part(as_aiter(request), forger)]
        return time.monotonic() - started, [m.code for m in replies]

    flood = await asyncio.gather(*(ask() for _ in range(MAX_WAITING_PARTS + 8)))
    assert all(codes == [averaging_pb2.BAD_GROUP_ID] for _, codes in flood)
    waited = sorted(took for took, _ in flood)
    assert all(took < 0.5 for took in waited[:8]) and all(took >= 0.9 for took in waited[8:]), waited
    assert averager._waiting_parts == 0

    averager.listed_under, averager._members = "stage-key", frozenset({PeerID(b"\x01" * 34)})  # private: not listed
    took, codes = await ask()
    assert codes == [averaging_pb2.BAD_GROUP_ID] and took < 0.5


def test_a_state_download_from_a_frozen_peer_ends_when_the_stage_drops_it():
    """After a failed round a peer copies the reference's state (server/collab/recovery.py). A reference that froze
    (SIGSTOP: its connections stay open, nothing comes) holds the download only until the stage drops it, not for
    the download's timeout; once it answers again, the download works."""
    boot = start_dht()
    dhts = [start_dht([str(m) for m in boot.get_visible_maddrs()]) for _ in range(2)]
    with forking():  # see run_round
        a, b = (
            StrictAverager(
                averaged_tensors=[torch.full((1000,), float(i))], dht=dht, prefix="avgtest_download", start=True
            )
            for i, dht in enumerate(dhts)
        )
    b_id = str(dhts[1].peer_id)
    try:
        os.kill(b.pid, signal.SIGSTOP)
        started = time.monotonic()
        dropped = started + 1.0  # when the stage would have dropped b (its --peer-timeout)
        got = a.download_state(b_id, timeout=10, alive=lambda: time.monotonic() < dropped)
        took = time.monotonic() - started
        assert got is None and took < 2.5, f"the download from a frozen peer held us {took:.1f}s"
        os.kill(b.pid, signal.SIGCONT)
        got = a.download_state(b_id, timeout=10)
        assert got is not None, "b sent no state once it answered again"
        assert torch.equal(got[1][0], torch.full((1000,), 1.0))
    finally:
        os.kill(b.pid, signal.SIGCONT)
        shut_down([a, b], [*dhts, boot])


CutShort.__name__ = StrictAverager.__name__  # hivemind names a servicer's handlers after its class


CountsEnds.__name__ = StrictAverager.__name__


def test_a_state_download_is_taken_only_whole():
    """A state ends with an end marker (compat/download.py STATE_END), which the peer downloading waits for: a state cut
    short (its last message lost in flight, as a stream closed right after it could lose it) is no download at all,
    where before the tensors that came were taken; a whole one is taken, and the sender holds the stream until the
    downloader has read it and closed it (`reply_linger_s`, 60 s here: the second download does not wait for it, and
    the sender's handler ends as soon as the downloader closed)."""
    boot = start_dht()
    dhts = [start_dht([str(m) for m in boot.get_visible_maddrs()]) for _ in range(3)]
    state = [torch.full((1000,), 1.0), torch.arange(3000, dtype=torch.float32)]
    a, whole, cut = (
        cls(averaged_tensors=[t.clone() for t in state], dht=dht, prefix="avgtest_whole", start=False)
        for cls, dht in zip((StrictAverager, CountsEnds, CutShort), dhts, strict=True)
    )
    with forking():  # see run_round
        for averager in (a, whole, cut):
            averager.reply_linger_s = 60.0
            averager.run_in_background(await_ready=True)
    try:
        assert a.download_state(str(dhts[2].peer_id), timeout=10) is None, "a state cut short was taken"
        for n in range(1, 3):
            got = a.download_state(str(dhts[1].peer_id), timeout=10)
            assert got is not None and all(torch.equal(x, y) for x, y in zip(got[1], state, strict=True))
            wait_for(lambda n=n: whole.ended.item() == n, 10, "the sender's handler to end once the download closed")
    finally:
        shut_down([a, whole, cut], [*dhts, boot])
