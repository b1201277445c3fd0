"""After a failed round one peer of the stage steps alone and the others copy it (server/collab/recovery.py). The
reference that is waited for can freeze: the others must not wait for it for as long as it stays frozen."""

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from server.collab.recovery import Recovery
from server.config import AveragingConfig

pytestmark = pytest.mark.timeout(30)


class Peers:
    """What Recovery reads of StagePeers: `frozen` reported more samples than us, then stopped answering."""

    def __init__(self, me: str, counts: dict[str, int], epoch: int):
        self.sdht = SimpleNamespace(peer_id=me, swarm_key=None)
        self.counts, self.epoch = counts, epoch
        self.peers = {p: f"127.0.0.1:{7000 + i}" for i, p in enumerate(counts)}
        self.p2p_ids = {p: "" for p in counts}

    def counts_of(self, epoch: int) -> dict[str, int]:  # live peers only, as StagePeers
        return {p: n for p, n in self.counts.items() if p in self.peers}

    def ahead_of(self, epoch: int) -> list[str]:
        return []

    def epochs_of(self) -> dict[str, int]:
        return {p: self.epoch for p in self.peers}


class Worker:
    epoch = 5

    def __init__(self):
        self.returned = None

    def return_gradients(self, grads, n):
        self.returned = n


def test_a_reference_that_stops_answering_is_passed_over():
    """We (b) have 4 samples, a had 8 and is the reference, then the stage drops it (its Progress timed out): we step
    alone at once instead of waiting out 2 x --averaging-timeout for a peer that is frozen."""
    peers = Peers("b", {"a": 8}, epoch=5)
    worker = Worker()
    averager = SimpleNamespace(allow_state_sharing=True, download_state=lambda *a, **k: None)
    recovery = Recovery(worker, averager, peers, AveragingConfig(averaging_timeout=10.0), 0, pool=None)
    threading.Timer(0.3, lambda: peers.peers.pop("a")).start()
    grads = [torch.ones(3)]
    started = time.monotonic()
    assert recovery.after_failed_round(grads, 4) is grads
    assert 0.3 <= time.monotonic() - started < 2.0
    assert averager.allow_state_sharing and worker.returned is None


def test_with_nobody_left_holding_samples_the_epoch_stays_open():
    peers = Peers("b", {"a": 8}, epoch=5)
    worker = Worker()
    averager = SimpleNamespace(allow_state_sharing=True, download_state=lambda *a, **k: None)
    recovery = Recovery(worker, averager, peers, AveragingConfig(averaging_timeout=10.0), 0, pool=None)
    threading.Timer(0.3, lambda: peers.peers.pop("a")).start()
    assert recovery.after_failed_round([torch.ones(3)], 0) is None
    assert worker.returned == 0
