"""A failed all-reduce must not split a stage into two models. Two real peers of one stage (in-process StageServers:
real DHT, real hivemind averagers, real Progress RPCs) and a round that fails for real because one peer is too busy
to join it in time."""

import asyncio
import time

import pytest
import torch

from server.collab.epoch import Phase
from server.worker import StageWorker
from swarm.model import Stage
from tests.peers import (
    MODEL,
    TIMEOUT,
    hide_from_state_sharing,
    meet,
    server_config,
    stage_servers,
    start_server,
    wait_for_async,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]


ACP = dict(allreduce_codec="acp", allreduce_warmup_epochs=0)  # epoch 0 is a low-rank round


@pytest.mark.parametrize(
    "busy_peer,averaging",
    [("with_samples", {}), ("without_samples", {}), ("with_samples", ACP), ("without_samples", ACP)],
    ids=["with_samples", "without_samples", "with_samples-acp", "without_samples-acp"],
)
async def test_a_failed_round_leaves_one_model_stepped_by_the_peer_with_the_samples(busy_peer, averaging):
    """B processes the whole global batch, A none. Then one of them is busy for longer than the other's all-reduce
    waits, so the round fails on both.

    - B busy: A must not step on its empty gradients; it waits for B (the peer with the samples) to step alone and
      copies B's state.
    - A busy: B steps alone. When A gets to the round, B has finished the epoch: A must copy B at once rather than
      retry a round nobody is left for (a futile attempt lasts --averaging-timeout).

    Both end at epoch 1 with the parameters of a single-process step on B's samples; with ACP-SGD averaging, also
    with the same low-rank factors (the failed round committed none, the copy carries them)."""
    async with stage_servers() as (peers, servers):
        for _ in range(2):  # the first starts from the seed; the second downloads its state (identical anyway)
            servers.append(await start_server(peers, **averaging))
        # B, the peer with the samples, is the one with the larger peer id: a tie-break by id alone would pick A
        a, b = sorted(servers, key=lambda server: server.sdht.peer_id)
        await meet(a, b)
        await hide_from_state_sharing(b)

        gen = torch.Generator().manual_seed(1)
        tokens = torch.randint(0, MODEL.vocab_size, (8, MODEL.max_seq_len), generator=gen)
        grad_out = torch.randn(8, MODEL.max_seq_len, MODEL.d_model, generator=gen)
        await b.worker.submit(lambda: b.worker.backward(tokens, grad_outputs=grad_out))
        slow = b if busy_peer == "with_samples" else a
        busy = asyncio.ensure_future(slow.worker.submit(lambda: time.sleep(1.5 * TIMEOUT)))
        started = time.monotonic()
        await b.collab.after_backward()  # B tells A the batch is complete; the busy peer's round waits for the sleep
        await busy
        free = time.monotonic()
        await wait_for_async(
            lambda: a.collab.epoch == b.collab.epoch == 1 and not a.collab.busy, 30, "both peers to finish epoch 0"
        )
        synced = time.monotonic()
        print(
            f"\nround failed; the stage was one model again {synced - started:.1f}s after the batch ended, "
            f"{synced - free:.1f}s after the busy peer was free"
        )
        if busy_peer == "without_samples":
            assert synced - free < 0.8 * TIMEOUT, "the busy peer retried a round after its peer had finished it"

        cfg = server_config(peers)
        expected = StageWorker(Stage(MODEL, 0), cfg.optimizer, cfg.compute, torch.device("cpu"))
        expected.backward(tokens, grad_outputs=grad_out)
        expected.apply_gradients(expected.take_gradients()[0])
        for name, p in expected.stage.named_parameters():
            pa, pb = dict(a.worker.stage.named_parameters())[name], dict(b.worker.stage.named_parameters())[name]
            assert torch.equal(pa, pb), f"{name}: the peers hold different parameters"
            assert torch.allclose(pa, p, rtol=0, atol=1e-6), f"{name}: not the single-process step"
        assert a.worker.param_version == b.worker.param_version == 1
        if averaging:
            factors = [s.collab.averaging.gradients.lowrank.shared_tensors() for s in (a, b)]
            assert all(torch.equal(x, y) for x, y in zip(*factors, strict=True)), "the peers hold different factors"


async def test_a_joiner_copies_the_stage_when_the_dht_lists_nobody_sharing_state():
    """hivemind's `load_state_from_peers` finds no source when the DHT record of who shares state lacks the stage's
    peers; a joiner must still take the stage's state (by asking its peers by name), not start from the seed."""
    async with stage_servers() as (peers, servers):
        servers.append(await start_server(peers))
        a = servers[0]
        tokens = torch.randint(0, MODEL.vocab_size, (8, MODEL.max_seq_len), generator=torch.Generator().manual_seed(2))
        await a.worker.submit(
            lambda: a.worker.backward(tokens, grad_outputs=torch.ones(8, MODEL.max_seq_len, MODEL.d_model))
        )
        await a.collab.after_backward()  # alone in its stage: steps at once, in the background
        await wait_for_async(lambda: a.collab.epoch == 1 and not a.collab.busy, 10, "the lone peer's step")
        await hide_from_state_sharing(a)

        servers.append(await start_server(peers))
        b = servers[1]
        assert b.collab.epoch == 1, "the joiner started from the seed instead of the stage's state"
        for (name, pa), pb in zip(a.worker.stage.named_parameters(), b.worker.stage.parameters(), strict=True):
            assert torch.equal(pa, pb), f"{name}: the joiner holds different parameters"


@pytest.mark.parametrize("forged", ["parameters", "acp factors"])
async def test_a_joiner_takes_the_state_its_stages_peers_agree_on_not_the_first_peers_it_asks(forged):
    """A listed peer of the stage can hold (and send) any finite state with our optimizer settings: nothing in the state
    itself tells it from the stage's. A joiner asks its peers in the order of their ids, so before it took the state of
    whichever sorted first. Now the stage's other peers at the state's epoch tell the digest of theirs (Info), and a
    state two of them contradict is refused: the joiner takes the state two of its three peers hold. With ACP-SGD the
    state carries the stage's low-rank factors, and a liar's other factors are refused alike."""
    averaging = ACP if forged == "acp factors" else {}
    async with stage_servers() as (peers, servers):
        for _ in range(3):
            servers.append(await start_server(peers, stage=1, **averaging))
        await meet(*servers)
        liar = min(servers, key=lambda s: s.sdht.peer_id)  # the first a joiner asks
        honest = [s for s in servers if s is not liar]
        with liar.worker.changing_state():
            if forged == "parameters":
                next(liar.worker.stage.parameters()).data.add_(0.25)
            else:
                liar.collab.averaging.gradients.lowrank.p[0].add_(0.25)
        stage_state = honest[0].collab.shared_digest()
        assert liar.collab.shared_digest() != stage_state == honest[1].collab.shared_digest()

        servers.append(joiner := await start_server(peers, stage=1, **averaging))
        assert joiner.worker.digest() == stage_state, "the joiner took the state only its first peer holds"
        assert (joiner.collab.state_downloads, joiner.collab.recovery.unvouched) == (1, 1)
        if averaging:
            factors = [s.collab.averaging.gradients.lowrank.shared_tensors() for s in (joiner, honest[0])]
            assert all(torch.equal(x, y) for x, y in zip(*factors, strict=True)), "the joiner took the liar's factors"


async def silent(*args, **kwargs) -> None:
    """A peer's `_broadcast` that sends nothing."""


async def test_a_peer_that_missed_the_call_to_end_the_epoch_is_called_into_the_round():
    """B ends an epoch before the global batch is full (as when stage 0 has moved on) while A, busy copying a state,
    drops B's call to end it; A's own count never completes the batch. The heartbeat B sends while its round runs
    calls A in: the round succeeds within seconds instead of failing after --averaging-timeout."""
    async with stage_servers() as (peers, servers):
        for _ in range(2):
            servers.append(await start_server(peers))
        a, b = servers
        await meet(a, b)
        tokens = torch.randint(0, MODEL.vocab_size, (4, MODEL.max_seq_len))  # half the global batch
        await b.worker.submit(
            lambda: b.worker.backward(tokens, grad_outputs=torch.randn(4, MODEL.max_seq_len, MODEL.d_model))
        )
        await b.collab.after_backward()
        await wait_for_async(lambda: a.collab.peers.samples_in(0) == 4, 10, "A to hear B's count")
        before = [(s.collab.rounds_ok, s.collab.rounds_failed) for s in (a, b)]
        a.collab.phase = Phase.RECOVERING  # copying a state: a call to end the epoch is not acted on
        # and A says nothing meanwhile: a Progress of A's that said it was copying a state (one went out in this
        # window in 3 of 4 runs on one day) rightly made B give up the round and step alone
        broadcast, a.collab._broadcast = a.collab._broadcast, silent
        await b.collab._broadcast(end_epoch=True)
        b.collab._spawn(b.collab._end_epoch_once(0))
        await asyncio.sleep(0.2)
        a.collab.phase, a.collab._broadcast = Phase.ACCUMULATING, broadcast
        started = time.monotonic()
        await wait_for_async(
            lambda: a.collab.epoch == b.collab.epoch == 1 and not (a.collab.busy or b.collab.busy),
            30,
            "both peers to finish epoch 0",
        )
        took = time.monotonic() - started
        assert [(s.collab.rounds_ok, s.collab.rounds_failed) for s in (a, b)] == [(ok + 1, bad) for ok, bad in before]
        assert took < TIMEOUT, f"{took:.1f}s: the round waited out the all-reduce timeout"
        for (name, pa), pb in zip(a.worker.stage.named_parameters(), b.worker.stage.parameters(), strict=True):
            assert torch.equal(pa, pb), name
