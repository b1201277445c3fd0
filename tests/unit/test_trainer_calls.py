"""How a trainer's stage call treats a peer that is catching up with its stage (server/collab/epoch.py `Behind`):
not a failure of the peer. The stage's peers are tried again until --request-timeout, without a ban or a spent
attempt; before, a stage whose only live peer was catching up lost the microbatch after 8 quick tries (seen in the
kill/freeze soak). Unit level: the trainer's own retry loop, with a client that answers as such a server does."""

import asyncio
import itertools
import time
import types

import pytest
import torch

from tests.peers import MODEL
from trainer.config import TrainerConfig
from trainer.trainer import Trainer

pytestmark = pytest.mark.timeout(60)


async def test_a_stopping_trainer_gives_up_microbatches_that_wait_for_a_live_peer():
    """SIGTERM on a trainer whose stages have no live peer (the swarm is gone, or not there yet): its microbatches wait
    for one to announce itself, and the trainer waited with them until it was killed (the rebalancing test's stop took
    the whole 15 s grace). They are given up at once now, and not counted lost."""
    cfg = TrainerConfig(in_flight=3, discovery_period=30)
    batch = (torch.zeros(2, 8, dtype=torch.long), torch.zeros(2, 8, dtype=torch.long))
    trainer = Trainer(cfg, MODEL, types.SimpleNamespace(p2p=None, peer_id="trainer-a"), itertools.repeat(batch))
    trainer._discover_forever = asyncio.Event().wait  # type: ignore[method-assign]  # no DHT: no peer, ever
    stop = asyncio.Event()
    run = asyncio.create_task(trainer.run(stop))
    await asyncio.sleep(0.5)
    assert not run.done(), "the microbatches wait for a live peer"
    stop.set()
    started = time.monotonic()
    final = await asyncio.wait_for(run, 5)
    assert time.monotonic() - started < 1.0
    assert final["lost_microbatches"] == 0 and final["steps"] == 0
