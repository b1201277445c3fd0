"""After a failed round one peer of the stage steps alone and the others copy it (server/collab/recovery.py). The
reference that is waited for can freeze: the others must not wait for it for as long as it stays frozen."""

import asyncio
import time
from types import SimpleNamespace

import grpc
import pytest
import torch

from server.collab.progress import StagePeers
from server.collab.recovery import PROBE_S, Recovery, vouched
from server.config import AveragingConfig
from swarm.protocol import wire_pb2 as pb
from swarm.protocol.rpc import stage_handler, start_stage_server
from tests.stages import hanging_stage_server
from tests.unit.test_recovery import Peers, Worker, twin_workers

pytestmark = pytest.mark.timeout(30)


async def test_a_reference_that_freezes_while_we_wait_for_it_is_found_out_within_seconds():
    """Real StagePeers and a real gRPC peer that stops answering (a frozen process: its calls hang). We (b) wait to
    copy the reference a (8 samples to our 4) after a failed round; nothing else calls a meanwhile. We ask it every
    PROBE_S whether it answers: it does not within the peer timeout, the stage drops it and we step alone within
    about 2 s. Before, we waited until some Progress went its way; in the freeze soak that took 14-23 s (the
    stalls after faults on the last stage)."""
    async with hanging_stage_server() as (address, frozen):
        peers = StagePeers(SimpleNamespace(peer_id="b", p2p=None), stage=1, peer_timeout=0.5)  # type: ignore[arg-type]
        peers.peers = {"a": address}
        peers.record(pb.StageProgress(peer_id="a", epoch=5, samples=8))
        averager = SimpleNamespace(allow_state_sharing=True, download_state=lambda *a, **k: None)
        worker = Worker()
        recovery = Recovery(worker, averager, peers, AveragingConfig(averaging_timeout=10.0), 1, pool=None)
        recovery.loop = asyncio.get_running_loop()
        grads = [torch.ones(3)]
        try:
            started = time.monotonic()
            stepped = await asyncio.get_running_loop().run_in_executor(None, recovery.after_failed_round, grads, 4)
            took = time.monotonic() - started
            assert stepped is grads and frozen.is_set() and "a" not in peers.peers
            assert took < PROBE_S + 0.5 + 1.5, took
        finally:
            await peers.close()


async def test_a_peer_vouches_only_as_itself_for_its_own_stage_with_a_digest():
    """What a stage peer's Info says of its state (`StagePeers.state_of`, which `Recovery.vouch` counts) is taken only
    from the peer the DHT lists at that address, on our stage, with a digest; a forged sender, another stage, no
    digest, an error or silence say nothing, and extreme values count as what they are: another state."""
    honest = pb.InfoReply(peer_id="v", stage=1, epoch=7, state_digest="d")
    huge = pb.InfoReply(peer_id="v", stage=1, epoch=7, state_digest="z" * 100_000)
    replies = [
        honest,
        pb.InfoReply(peer_id="x", stage=1, epoch=7, state_digest="d"),  # another peer answers at v's address
        pb.InfoReply(peer_id="v", stage=2, epoch=7, state_digest="d"),  # v moved to stage 2
        pb.InfoReply(peer_id="v", stage=1, epoch=7),  # shares no state now
        pb.InfoReply(peer_id="v", stage=1, epoch=-(2**63), state_digest="d"),
        huge,
        "error",
        "hang",
    ]

    async def info(request, context):
        assert request.with_digest
        reply = replies.pop(0)
        if reply == "error":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no")
        if reply == "hang":
            await asyncio.sleep(5)
        return reply

    async def unused(request, context):
        raise NotImplementedError

    server, _, port = await start_stage_server(stage_handler(unused, unused, info, unused), "127.0.0.1", 0)
    peers = StagePeers(SimpleNamespace(peer_id="me", p2p=None), stage=1, peer_timeout=1.0)  # type: ignore[arg-type]
    peers.peers = {"v": f"127.0.0.1:{port}"}
    try:
        told = [await peers.state_of("v", timeout=1.0) for _ in range(8)]
        assert await peers.state_of("not listed", timeout=1.0) is None
    finally:
        await peers.close()
        await server.stop(None)
    assert told == [(7, "d"), None, None, None, (-(2**63), "d"), (7, "z" * 100_000), None, None]
    answers = [t for t in told if t is not None]
    assert vouched(7, "e", answers)  # a state against two others, one peer each: not refused
    assert not vouched(7, "e", [*answers, (7, "z" * 100_000)])  # against two that agree on another: refused


async def test_a_peer_holds_no_ancestor_of_the_stages_state_after_a_join_without_one_or_a_step_alone():
    class Silent(Peers):
        async def refresh(self) -> None:
            pass

    ours, source = twin_workers()
    try:
        peers = Silent("b", {"a": 8}, epoch=ours.epoch + 1)
        peers.p2p_ids = {"a": "Qma"}
        sent = []
        averager = SimpleNamespace(
            allow_state_sharing=True,
            lowrank=None,
            exact_states=True,
            split_state=lambda meta, tensors: (tensors, []),
            download_state=lambda *a, **k: sent.pop() if sent else None,
        )
        recovery = Recovery(ours, averager, peers, AveragingConfig(averaging_timeout=5.0), 1, pool=None)
        assert recovery.holds_ancestor()
        assert not await recovery.join()  # a sent nothing: we start from our own start beside it
        assert not recovery.holds_ancestor()
        sent.append(source.state_tensors())
        assert await recovery.download("a", attempts=1)
        assert recovery.holds_ancestor()
        ours.branch()  # we stepped alone: a history of our own, no ancestor of the stage's
        assert not recovery.holds_ancestor()
        sent.append(source.state_tensors())
        assert await recovery.download("a", attempts=1) and recovery.holds_ancestor()
        # the reference after a failed round steps alone: the stage goes on from its step only if its peers copy it
        peers.epoch, peers.counts = ours.epoch, {"a": 1}
        grads, lineage = [torch.zeros_like(p) for p in ours.params], ours.lineage
        assert recovery.after_failed_round(grads, 4) is grads and not recovery.holds_ancestor()
        assert ours.lineage != lineage  # its own, unless the stage copies it (then with its lineage)

    finally:
        ours.shutdown(), source.shutdown()
