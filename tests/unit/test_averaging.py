"""hivemind's averager, with the codecs we use, really averages. Regression test for a known silent failure: with
numpy >= 2.4, hivemind's 8-bit codecs fail on decode inside the averager, which swallows the error: step() returns and
nothing is averaged. Two DHT nodes give the two averagers separate identities inside one test process."""

import asyncio
import contextlib
import gc
import logging
import math
import typing
from types import SimpleNamespace

import pytest
import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.load_balancing import load_balance_peers
from hivemind.averaging.partition import TensorPartReducer
from hivemind.compression import NoCompression, deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2

from server.collab.compat.averager import StrictAverager
from server.collab.compat.download import _declared
from server.collab.compat.runner import ClippedPartReducer, ExactAllReduceRunner, balance_parts
from server.collab.lowrank import PHASE_FULL, PHASE_P, PHASE_PSGD_P, PHASE_PSGD_Q, PHASE_Q
from server.collab.stage_averager import PHASE_DIGEST, PHASE_PARAMS, StageAverager, hivemind_compression
from swarm.compression import get_codec
from tests.peers import wait_for_async

pytestmark = pytest.mark.timeout(120)


async def test_the_robust_reducer_clips_one_part_and_keeps_a_banned_senders_earlier_parts():
    """ClippedPartReducer alone, two parts of 4 senders: the outlier's part is clipped and counted; a sender banned
    after its first part is in that part's robust mean and not in the second's; a sender without weight is in no
    median; with two senders left it is hivemind's weighted mean, to the bit."""
    shape = torch.Size([1000])
    gen = torch.Generator().manual_seed(3)
    x = [torch.randn(1000, generator=gen) + 5 for _ in range(3)]
    reducer = ClippedPartReducer([shape, shape], num_senders=4, clip=1.0)
    first = await asyncio.gather(
        *(reducer.accumulate_part(i, 0, t, weight=1.0) for i, t in enumerate(x)),
        reducer.accumulate_part(3, 0, torch.full((1000,), 1e6), weight=1.0),
    )
    assert all(torch.equal(r, first[0]) for r in first)
    assert (first[0] - sum(x) / 3).norm() < max((t - sum(x) / 3).norm() for t in x)
    assert reducer.clipped == [0, 0, 0, 1]
    reducer.on_sender_failed(3)  # banned after its first part: left out of the second
    zero = reducer.accumulate_part(2, 1, torch.zeros(1000), weight=0.0)
    second = await asyncio.gather(
        reducer.accumulate_part(0, 1, x[0], 1.0), reducer.accumulate_part(1, 1, x[1], 3.0), zero
    )
    hivemind_mean = torch.zeros(1000).add_(x[0], alpha=1.0).add_(x[1], alpha=3.0).add_(torch.zeros(1000), alpha=0.0)
    hivemind_mean.div_(4.0)
    assert all(torch.equal(r, hivemind_mean) for r in second)
    assert reducer.finished.is_set() and not reducer.received


def _reducer_side(shapes: list[torch.Size]) -> ExactAllReduceRunner:
    """An exact runner's reducer side for one sender: no group, no network."""
    runner = ExactAllReduceRunner.__new__(ExactAllReduceRunner)
    runner.tensor_part_reducer = TensorPartReducer(shapes, num_senders=1)
    runner.tensor_part_container = SimpleNamespace(prefetch=1)
    runner.sender_peer_ids, runner.banned_senders, runner.banlock = [PeerID(b"h" * 34)], set(), asyncio.Lock()
    runner.max_weight = runner.max_total_weight = math.inf
    runner.weight_caps = None
    runner.weights, runner.reducer_failed = {}, asyncio.Event()
    runner.complete_senders, runner.reply_linger_s = set(), 60.0
    return runner


@pytest.mark.parametrize("sent", [2, 1])
async def test_a_sender_whose_parts_were_all_reduced_is_not_banned_when_its_stream_ends_first(sent):
    """A sender closes its stream once every averaged part came back. When that close reaches the reducer before the
    end of the sender's requests (a busy sender), hivemind's handler is cancelled mid-stream and bans the sender
    it served, whatever the reason: the reducer's round failed while the sender's ended. A sender all of whose parts
    were reduced is in every part and is spared; one that stopped a part short is banned, and the round fails."""
    shape = torch.Size([100])
    runner = _reducer_side([shape, shape])
    replies = []

    async def stream():
        for i in range(sent):
            yield averaging_pb2.AveragingData(tensor_part=serialize_torch_tensor(torch.full(shape, i + 1.0)), weight=1)
        await asyncio.Event().wait()  # the end of its requests never comes: its close does

    async def handler():
        async for message in runner._accumulate_parts_streaming(stream(), 0):
            replies.append(message)

    serving = asyncio.create_task(handler())
    await wait_for_async(lambda: len(replies) == sent, 10, "the replies")
    serving.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await serving
    await runner._ban_sender(runner.sender_peer_ids[0])  # what hivemind's handler does on any BaseException
    assert (runner.sender_peer_ids[0] in runner.banned_senders) is (sent < 2)
    assert runner.reducer_failed.is_set() is (sent < 2)


@pytest.mark.parametrize("weights", [[-1.0], [math.nan], [math.inf], [1.0, 2.0]])
async def test_a_sender_whose_weight_is_negative_not_finite_or_changing_is_refused_and_banned(weights):
    """The reducer's side of the weight rules. hivemind's sender asserts weight >= 0 only on its own side, so a
    hostile peer's parts are written here by hand, as its AveragingData messages: a part whose weight is negative
    (it would flip the sign of its values), NaN or infinite, or differs from the weight of the sender's earlier
    parts, is not accumulated and its sender is banned (the round then fails: parts not averaged). Parts before it
    were reduced as usual."""
    shape = torch.Size([100])
    parts = [torch.full(shape, float(i + 1)) for i in range(len(weights))]
    runner = _reducer_side([shape] * len(parts))

    async def stream():
        for part, weight in zip(parts, weights, strict=True):
            yield averaging_pb2.AveragingData(tensor_part=serialize_torch_tensor(part), weight=weight)

    replies = [msg async for msg in runner._accumulate_parts_streaming(stream(), 0)]
    assert runner.banned_senders == {runner.sender_peer_ids[0]}
    assert len(replies) == len(weights) - 1  # every part before the bad one was averaged; the bad one was not
    for reply, part in zip(replies, parts, strict=False):
        assert torch.equal(deserialize_torch_tensor(reply.tensor_part), part)


def test_only_parameter_rounds_and_their_probes_run_with_settings_of_their_own_and_only_probes_give_way():
    """Gradient rounds (whole, ACP's and PowerSGD's phases) keep the averager's own settings (codec, admission caps,
    robust clipping, epoch bounds) and never give way to a member's other round; a parameter round is a plain mean
    with --param-average-codec, and its probe, the only round that gives way, travels uncompressed."""
    averager = object.__new__(StageAverager)  # its rules only: no process, no DHT
    averager._parent_pid = -1  # hivemind's __del__ shuts down only the process that made it
    averager.param_compression = hivemind_compression(get_codec("blockwise8"))
    for phase in (PHASE_FULL, PHASE_P, PHASE_Q, PHASE_PSGD_P, PHASE_PSGD_Q, "made-up"):
        assert averager.round_settings([3, phase, "blockwise8"]) == {}, phase
        assert not averager.gives_way([3, phase, "blockwise8"]), phase
    assert not averager.gives_way("not a round") and averager.round_settings(None) == {}
    plain = dict(robust_clip=0.0, max_weight=1.0, max_total_weight=math.inf, weight_caps=None)
    assert averager.round_settings([3, PHASE_PARAMS, "blockwise8"]) == {
        **plain,
        "compression": averager.param_compression,
    }
    probe = averager.round_settings([3, PHASE_DIGEST, "0f" * 16])
    assert isinstance(probe.pop("compression"), NoCompression) and probe == plain
    assert averager.gives_way([3, PHASE_DIGEST, "0f" * 16]) and not averager.gives_way([3, PHASE_PARAMS, "none"])


class CutShort(StrictAverager):
    """Sends its state as hivemind does, without its last message: what a download whose last message was lost in
    flight receives."""

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.DownloadData]:  # typing's: hivemind reads the hint's `_name`
        messages = [m async for m in DecentralizedAverager.rpc_download_state(self, request, context)]
        for message in messages[:-1]:
            yield message


CutShort.__name__ = StrictAverager.__name__  # hivemind names a servicer's handlers after its class


class CountsEnds(StrictAverager):
    """Counts the state downloads it served whose handler has ended (in memory shared with its process)."""

    def __init__(self, *args, **kwargs):
        self.ended = torch.zeros(1).share_memory_()  # before the process forks
        super().__init__(*args, **kwargs)

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> typing.AsyncIterator[averaging_pb2.DownloadData]:  # typing's: hivemind reads the hint's `_name`
        try:
            async for message in super().rpc_download_state(request, context):
                yield message
        finally:
            self.ended += 1


CountsEnds.__name__ = StrictAverager.__name__


async def test_a_state_declaration_that_fails_is_read_and_logged_not_left_to_asyncio(caplog):
    """hivemind's averager declared its state in the DHT from tasks nobody read: a store that timed out (a frozen
    peer's DHT node) printed asyncio's "Task exception was never retrieved" with a traceback, in every server's log."""

    async def store_that_times_out():
        raise TimeoutError

    with caplog.at_level(logging.DEBUG, logger="server.collab.compat.download"):
        store = asyncio.create_task(store_that_times_out())
        store.add_done_callback(_declared)
        await asyncio.wait({store})
        del store
        gc.collect()
    assert "declaring our state for download in the DHT failed: TimeoutError()" in caplog.text
    assert "never retrieved" not in caplog.text


def test_equal_bandwidths_split_a_round_as_hivemind_linear_program_does_without_running_it():
    """Every peer computes the split itself: ours must be hivemind's, or peers would disagree on who reduces what."""
    for n in range(1, 9):
        for size in (1, 2, 7, 1001, 210_000, 3_410_000):
            for min_size in (0, 16, 100_000):
                assert balance_parts(size, [1.0] * n, min_size) == load_balance_peers(size, [1.0] * n, min_size)
    # anything else is hivemind's own answer: different bandwidths, client-only peers (0), undeclared (None)
    for bandwidths in ([1.0, 2.0], [1.0, 0.0, 1.0], [3.0, 3.0, 1e-3], [None, None], [None, 1.0], [1.0, None]):
        assert balance_parts(10_000, bandwidths, 0) == load_balance_peers(10_000, bandwidths, 0)
    with pytest.raises(AssertionError):  # hivemind's refusal of a group with no bandwidth at all
        balance_parts(10, [0.0, 0.0], 0)
    # what peers declare crosses the network: extremes split as hivemind splits them, garbage fails the round alike
    for extreme in (math.inf, 1e300, 1e-300):
        assert balance_parts(1000, [extreme] * 2, 0) == load_balance_peers(1000, [extreme] * 2, 0) == (500, 500)
    for garbage in ([math.nan, math.nan], [-1.0, -1.0]):
        with pytest.raises(ValueError):
            balance_parts(1000, garbage, 0)
