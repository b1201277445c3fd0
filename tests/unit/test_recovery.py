"""After a failed round one peer of the stage steps alone and the others copy it (server/collab/recovery.py). The
reference that is waited for can freeze: the others must not wait for it for as long as it stays frozen."""

import dataclasses
import functools
import json
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch

from server.checkpoint import load_checkpoint, save_checkpoint
from server.collab.lowrank import AcpState, Layout
from server.collab.progress import StagePeers
from server.collab.recovery import JOIN_READS, Recovery, Unvouched, vouched
from server.collab.rules import REFUSED_EPOCHS, catch_up_source
from server.collab.stage_averager import StageAverager
from server.config import AveragingConfig, ComputeConfig, OptimizerConfig
from server.optim import (
    MAX_BOUNDED_STEPS,
    _close,
    build_optimizer,
    moment_ratio_bound,
    not_within_drift,
    not_within_steps,
    replay_step,
)
from server.state import INITIAL_LINEAGE, state_digest, valid_lineage
from server.worker import StageWorker
from swarm.config import tiny_test
from swarm.model import Stage
from swarm.protocol import wire_pb2 as pb

pytestmark = pytest.mark.timeout(30)


class Peers:
    """What Recovery reads of StagePeers: `frozen` reported more samples than us, then stopped answering."""

    def __init__(self, me: str, counts: dict[str, int], epoch: int):
        self.sdht = SimpleNamespace(peer_id=me, swarm_key=None)
        self.counts, self.epoch = counts, epoch
        self.peers = {p: f"127.0.0.1:{7000 + i}" for i, p in enumerate(counts)}
        self.p2p_ids = {p: "" for p in counts}
        self._refused: dict[str, int] = {}
        self.established: set[str] = set()

    refuse, distrusted = StagePeers.refuse, StagePeers.distrusted
    shown_limit = staticmethod(lambda trusted: None)

    @property
    def refused(self) -> set[str]:
        return self.distrusted(self.epoch)

    def counts_of(self, epoch: int) -> dict[str, int]:  # live peers only, as StagePeers
        return {p: n for p, n in self.counts.items() if p in self.peers}

    def ahead_of(self, epoch: int) -> list[str]:
        return []

    def epochs_of(self) -> dict[str, int]:
        return {p: self.epoch for p in self.peers}

    async def state_of(self, peer_id: str, timeout: float) -> tuple[int, str] | None:
        return None  # nobody vouches: the sender's word


class Worker:
    epoch, lineage = 5, INITIAL_LINEAGE

    def __init__(self):
        self.returned = None

    def return_gradients(self, grads, n):
        self.returned = n

    def branch(self):
        self.lineage = "0123456789abcdef"


def test_a_reference_that_stops_answering_is_passed_over():
    """We (b) have 4 samples, a had 8 and is the reference, then the stage drops it (its Progress timed out): we step
    alone at once instead of waiting out 2 x --averaging-timeout for a peer that is frozen."""
    peers = Peers("b", {"a": 8}, epoch=5)
    worker = Worker()
    averager = SimpleNamespace(allow_state_sharing=True, download_state=lambda *a, **k: None)
    recovery = Recovery(worker, averager, peers, AveragingConfig(averaging_timeout=10.0), 0, pool=None)
    grads = [torch.ones(3)]
    started = time.monotonic()  # before the timer: the wait is measured from no later than its start
    threading.Timer(0.3, lambda: peers.peers.pop("a")).start()
    assert recovery.after_failed_round(grads, 4) is grads
    assert 0.3 <= time.monotonic() - started < 2.0
    assert averager.allow_state_sharing and worker.returned is None


class SlowDHTPeers(Peers):
    """A stage whose DHT reads time out `timeouts` times before one answers with peer a."""

    def __init__(self, timeouts: int):
        super().__init__("b", {}, epoch=5)
        self.timeouts, self.reads = timeouts, 0

    async def refresh(self) -> None:
        self.reads += 1
        if self.reads <= self.timeouts:
            raise TimeoutError
        self.peers = {"a": "127.0.0.1:7000"}


@pytest.mark.parametrize("timeouts", [JOIN_READS - 1, JOIN_READS])
async def test_a_joiner_whose_dht_reads_time_out_reads_again_and_never_takes_silence_for_an_empty_stage(timeouts):
    """A read that times out says nothing about the stage: a joiner that took it for "no peers" would start from the
    seed beside peers epochs ahead (a read timed out once in CI). It reads again; after JOIN_READS it refuses."""
    peers = SlowDHTPeers(timeouts)
    recovery = Recovery(Worker(), SimpleNamespace(), peers, AveragingConfig(), 0, pool=None)
    downloads = []

    async def download(source, attempts):
        downloads.append(source)
        return True

    recovery.download = download
    if timeouts < JOIN_READS:
        assert await recovery.join() is True
        assert downloads == ["a"] and peers.reads == timeouts + 1
    else:
        with pytest.raises(RuntimeError, match="did not answer"):
            await recovery.join()
        assert downloads == [] and peers.reads == JOIN_READS


def test_with_nobody_left_holding_samples_the_epoch_stays_open():
    peers = Peers("b", {"a": 8}, epoch=5)
    worker = Worker()
    averager = SimpleNamespace(allow_state_sharing=True, download_state=lambda *a, **k: None)
    recovery = Recovery(worker, averager, peers, AveragingConfig(averaging_timeout=10.0), 0, pool=None)
    threading.Timer(0.3, lambda: peers.peers.pop("a")).start()
    assert recovery.after_failed_round([torch.ones(3)], 0) is None
    assert worker.returned == 0


def test_a_lone_step_starts_a_lineage_of_its_own_and_a_downloaded_state_brings_its_donors():
    """server/worker.py: peers that start from the shared seed share the lineage "init"; a step alone draws a new one;
    a state carries its lineage to whoever downloads it; a state without one, or with garbage, has a history of its
    own."""

    def worker() -> StageWorker:
        return StageWorker(Stage(tiny_test(), 0), OptimizerConfig(), ComputeConfig(), torch.device("cpu"))

    donor, joiner = worker(), worker()
    assert donor.lineage == joiner.lineage == INITIAL_LINEAGE
    donor.branch()
    assert donor.lineage != INITIAL_LINEAGE and valid_lineage(donor.lineage)
    joiner.load_state(*donor.state_tensors())
    assert joiner.lineage == donor.lineage
    for garbage in (None, "", "x" * 5000, 7, "INIT", "0123456789abcdeg"):
        meta, tensors = donor.state_tensors()
        meta["lineage"] = garbage
        joiner.load_state(meta, tensors)
        assert valid_lineage(joiner.lineage) and joiner.lineage not in (donor.lineage, INITIAL_LINEAGE), garbage


def test_peers_of_two_lineages_agree_on_one_reference():
    """server/collab/progress.py: the lineage most peers at the epoch hold, us included, is kept (ties: the smallest
    peer id's), and its smallest peer id is the reference; a peer copies it only if it holds another lineage; peers
    at other epochs, or that left, do not count."""

    def peer(me: str, lineages: dict[str, tuple[int, str]]) -> StagePeers:
        peers = StagePeers(SimpleNamespace(peer_id=me, p2p=None), stage=1, peer_timeout=1.0)  # type: ignore[arg-type]
        peers.peers = {p: "127.0.0.1:1" for p in lineages}
        for p, (epoch, lineage) in lineages.items():
            peers.record(pb.StageProgress(peer_id=p, epoch=epoch, lineage=lineage))
        return peers

    ours, theirs = "0" * 16, "f" * 16
    assert peer("b", {"a": (3, theirs)}).lineage_reference(3, ours) == "a", "one each: the smallest id's"
    assert peer("c", {"a": (3, theirs), "b": (3, theirs)}).lineage_reference(3, ours) == "a", "two against one"
    assert peer("b", {"a": (3, theirs), "c": (3, ours)}).lineage_reference(3, ours) is None, "a copies us"
    assert peer("c", {"a": (3, ours), "b": (3, theirs)}).lineage_reference(3, ours) is None, "b copies a: we hold a's"
    assert peer("a", {"b": (3, theirs)}).lineage_reference(3, ours) is None, "we are the reference"
    assert peer("b", {"a": (2, theirs)}).lineage_reference(3, ours) is None, "a is at another epoch"
    gone = peer("b", {"a": (3, theirs)})
    gone.peers.pop("a")
    assert gone.lineage_reference(3, ours) is None, "a left the stage"
    # delayed steps: a peer reports the next epoch as soon as it takes its gradients
    assert peer("b", {"a": (4, theirs)}).lineage_reference(3, ours, moved_on=True) == "a"
    assert peer("b", {"a": (5, theirs)}).lineage_reference(3, ours, moved_on=True) is None, "two epochs on"
    # one peer with a lineage of its own and the smallest id (a liar's ground key) against two that share one: the
    # two keep theirs (it used to be copied by both, unchecked), and it is the one to copy
    liar = "1" * 16
    assert peer("b", {"0": (3, liar), "c": (3, ours)}).lineage_reference(3, ours) is None
    assert peer("c", {"0": (3, liar), "b": (3, ours)}).lineage_reference(3, ours) is None
    assert peer("0", {"b": (3, ours), "c": (3, ours)}).lineage_reference(3, liar) == "b"
    # three lineages, one peer each (every peer stepped alone): the smallest peer id's, as before
    assert peer("c", {"a": (3, liar), "b": (3, theirs)}).lineage_reference(3, ours) == "a"


def test_with_delayed_steps_a_round_is_over_once_every_peer_says_it_averaged_that_epoch():
    """A delayed peer reports the next epoch while its round still runs, so that report does not tell a peer whose
    round failed that it ended for the others; the `averaged` field does (server/collab/epoch.py `_average_stage`),
    or a report two epochs on. Counts only grow, messages without it say nothing, and a peer that left does not
    count."""
    peers = StagePeers(SimpleNamespace(peer_id="c", p2p=None), stage=1, peer_timeout=1.0)  # type: ignore[arg-type]
    peers.peers = {"a": "127.0.0.1:1", "b": "127.0.0.1:2"}
    peers.record(pb.StageProgress(peer_id="a", epoch=5, averaged=4))
    peers.record(pb.StageProgress(peer_id="b", epoch=5))  # moved on, round still running
    assert peers.all_ahead_of(4) and not peers.round_over(4, delayed=True)
    peers.record(pb.StageProgress(peer_id="b", epoch=5, averaged=4))
    assert peers.round_over(4, delayed=True) and not peers.round_over(5, delayed=True)
    peers.record(pb.StageProgress(peer_id="a", epoch=5, averaged=3))  # late, out of order
    assert peers.round_over(4, delayed=True)
    peers.record(pb.StageProgress(peer_id="a", epoch=6, averaged=5))
    assert not peers.round_over(5, delayed=True)
    peers.peers.pop("b")
    assert peers.round_over(5, delayed=True), "b left the stage"
    # a peer that stepped alone while we were frozen sent no `averaged` of those epochs: two epochs on, it has ended
    # the next one, which waits for this round
    peers.peers["b"] = "127.0.0.1:2"
    assert not peers.round_over(6, delayed=True)
    peers.record(pb.StageProgress(peer_id="b", epoch=7))
    assert not peers.round_over(6, delayed=True), "b may still be in its round of 6"
    peers.record(pb.StageProgress(peer_id="b", epoch=8))
    assert not peers.round_over(6, delayed=True), "a has not said its round of 6 ended"
    peers.record(pb.StageProgress(peer_id="a", epoch=8))
    assert peers.round_over(6, delayed=True) and not peers.round_over(7, delayed=True)
    assert peers.round_over(6, delayed=False) and not peers.round_over(8, delayed=False)


def test_a_peer_two_epochs_behind_or_copying_a_state_is_left_out_of_the_round():
    """A peer that reported an epoch two or more before the round's catches up by copying a state; the round does not
    wait for it (a restarted peer that had loaded an older state held a delayed round until its timeout). A peer one
    epoch behind may still end that epoch and come: it stays in the group, as does a peer that said nothing yet but
    took a Progress of ours, unless it says it is copying a state. A listed peer that neither spoke nor took one is in
    no round: a record is only a claim."""
    peers = StagePeers(SimpleNamespace(peer_id="d", p2p=None), stage=1, peer_timeout=1.0)  # type: ignore[arg-type]
    peers.peers = {"a": "127.0.0.1:1", "b": "127.0.0.1:2", "c": "127.0.0.1:3", "e": "127.0.0.1:4"}
    peers.p2p_ids = {"a": "QmA", "b": "QmB", "c": "QmC", "e": "QmE"}
    peers.record(pb.StageProgress(peer_id="a", epoch=208))  # ahead: its round of 207 runs in the background
    peers.record(pb.StageProgress(peer_id="b", epoch=206))
    peers.record(pb.StageProgress(peer_id="c", epoch=205))  # restarted, loaded an older state
    assert peers.group_size(207) == 3 and "e" not in peers.group(207)
    peers.took("e")
    assert peers.group_size(207) == 4 and sorted(peers.group_p2p_ids(207) or []) == ["QmA", "QmB", "QmE"]
    peers.record(pb.StageProgress(peer_id="c", epoch=208))  # caught up
    assert peers.group_size(207) == 5
    # a peer copying a state joins no round, even one epoch behind: a restarted peer at 206 that found the stage at
    # 208 downloaded again and again while our round waited for it, and we share no state until it ends
    peers.record(pb.StageProgress(peer_id="b", epoch=206, recovering=True))
    assert peers.group_size(207) == 4 and "b" not in peers.group(207)
    peers.record(pb.StageProgress(peer_id="b", epoch=205, recovering=False))  # an older message, late: ignored
    assert "b" not in peers.group(207)
    peers.record(pb.StageProgress(peer_id="b", epoch=207))  # copied: it accumulates again
    assert peers.group_size(207) == 5


def test_a_peer_whose_delayed_round_failed_copies_a_peer_whose_round_ended_whatever_their_ids():
    """With delayed steps a peer whose round failed steps on its own gradients and copies a peer after (epoch.py
    `_catch_up`). It used to copy the smallest peer id at its epoch unless that was itself: a peer with the smallest id
    whose round failed, beside one whose round ended, kept its own model for good (seen in a swarm-local run: the
    round's last part was lost for one stage-0 peer). A peer whose round ended is the source now; only when nobody's
    did (every peer stepped alone) does the smallest id decide."""
    epochs = {"b": 8, "c": 8}
    assert catch_up_source(8, epochs, "a", True, averaged=["c"]) == ("c", True)
    assert catch_up_source(8, epochs, "a", True, averaged=["b", "c"]) == ("b", True)
    assert catch_up_source(8, epochs, "a", True) == (None, False), "nobody's round ended: a is the reference"
    assert catch_up_source(8, epochs, "c", True) == ("b", True)
    assert catch_up_source(8, {"b": 7}, "a", True, averaged=["b"]) == (None, True), "b is behind: wait for it"
    assert catch_up_source(8, {"b": 9}, "a", False) == ("b", False), "a peer ahead: copy it"
    assert catch_up_source(8, epochs, "a", False, averaged=["c"]) == (None, False), "not diverged: nothing to copy"


@pytest.mark.parametrize("reference_epoch", [6, 7])
def test_a_delayed_step_copies_the_reference_and_keeps_what_the_next_epoch_accumulated(reference_epoch):
    """Delayed steps (--delay-optimizer-step): after our step of epoch 5 we hold other parameters than the reference
    a (it stepped alone once), and epoch 6 is already accumulating. We copy a's state and keep the 3 samples of
    gradients of epoch 6: a state of epoch 6 is what we step on next. A reference already past it (epoch 7) has
    averaged epoch 6 without them: they are dropped, as with any download."""

    donor, ours, averager = donor_and_accumulating_peer(reference_epoch)
    try:
        donor.branch()
        recovery = Recovery(ours, averager, Peers("b", {"a": 8}, epoch=6), AveragingConfig(), 1, pool=None)
        recovery.adopt("a", 5, keep_gradients=True)
        assert ours.lineage == donor.lineage and averager.allow_state_sharing
        assert_copied(ours, donor, kept=reference_epoch == 6)
    finally:
        donor.shutdown(), ours.shutdown()


def donor_and_accumulating_peer(donor_epoch: int) -> tuple[StageWorker, StageWorker, SimpleNamespace]:
    """Real workers: a donor that stepped, at `donor_epoch`, and ours at epoch 6 with 3 samples of gradients (all
    ones) accumulated; an averager that downloads the donor's state."""
    donor, ours = (
        StageWorker(Stage(tiny_test(), 1), OptimizerConfig(), ComputeConfig(), torch.device("cpu")) for _ in range(2)
    )
    donor.apply_gradients([torch.randn_like(p) for p in donor.params])
    donor.epoch, ours.epoch = donor_epoch, 6
    for p in ours.params:
        p.grad = torch.ones_like(p)
    ours.samples_accumulated = 3
    averager = SimpleNamespace(
        allow_state_sharing=True,
        exact_states=True,
        lowrank=None,
        split_state=lambda meta, tensors: (tensors, []),
        download_state=lambda *a, **k: donor.state_tensors(),
    )
    return donor, ours, averager


def assert_copied(ours: StageWorker, donor: StageWorker, kept: bool) -> None:
    """Ours holds the donor's parameters and epoch, and kept its 3 samples of gradients or dropped them."""
    assert all(torch.equal(a, b) for a, b in zip(ours.params, donor.params, strict=True))
    assert ours.epoch == donor.epoch and ours.samples_accumulated == (3 if kept else 0)
    assert all((p.grad is not None and bool((p.grad == 1).all())) if kept else p.grad is None for p in ours.params)


@pytest.mark.parametrize("source_epoch", [6, 7])
async def test_a_diverged_peer_that_copies_a_peer_at_its_epoch_keeps_what_it_accumulated_towards_it(source_epoch):
    """A delayed step whose round failed diverges, steps alone (epoch 5 -> 6) and copies a peer whose round ended
    (epoch.py `_catch_up`). It had counted 3 samples of epoch 6 and told its peers: dropped with the download, the
    stage's count of epoch 6 never reached the global batch, and stage 0 waited --admission-timeout (30 s) to end it
    (a delayed swarm-local run: "24 of its 32 admitted samples came back"). A state of epoch 6 keeps them; a source
    already past epoch 6 averaged it without them, and they are dropped as before."""
    donor, ours, averager = donor_and_accumulating_peer(source_epoch)
    try:
        peers = Peers("b", {"a": 8}, epoch=6)
        peers.p2p_ids = {"a": "QmA"}
        with ThreadPoolExecutor(1) as pool:
            recovery = Recovery(ours, averager, peers, AveragingConfig(), 1, pool)
            assert await recovery.download("a", keep_gradients=True)
        assert_copied(ours, donor, kept=source_epoch == 6)
    finally:
        donor.shutdown(), ours.shutdown()


def test_a_downloaded_state_is_loaded_unless_two_peers_at_its_epoch_agree_on_another_held_by_fewer():
    assert vouched(5, "s", [])  # the sender is the stage's only other peer: its word is all there is
    assert vouched(5, "s", [(5, "s")])
    assert vouched(5, "s", [(4, "x"), (4, "x"), (6, "y"), (6, "y"), (-1, "")])  # other epochs say nothing of 5's
    assert vouched(5, "s", [(5, "x")])  # one word against another: peers that round differently each hold their own
    assert vouched(5, "s", [(5, "x"), (5, "y"), (5, "z")])
    assert not vouched(5, "s", [(5, "x"), (5, "x")])  # one state against two that agree on another
    assert vouched(5, "s", [(5, "x"), (5, "x"), (5, "s")])  # two and two
    assert not vouched(5, "s", [(5, "x"), (5, "x"), (5, "x"), (5, "s")])
    assert vouched(5, "s", [(5, "s"), (5, "s"), (5, "x"), (5, "y")])


def test_a_peer_hashes_its_state_once_and_every_change_of_it_gives_a_new_digest():
    """Anyone may ask a peer for the digest of its state (Info): the state is read once per change, not per call (a
    1B-parameter stage's takes 2.5 s under the state lock), and every change (a step, epochs without a step, a
    loaded state, parameters changed under `changing_state`) gives a new digest."""
    worker = StageWorker(Stage(tiny_test(), 1), OptimizerConfig(), ComputeConfig(), torch.device("cpu"))
    reads, read = [], worker._state_view
    worker._state_view = lambda: reads.append(1) or read()  # type: ignore[method-assign]
    seen = [worker.digest()]
    assert [worker.digest() for _ in range(5)] == seen * 5 and len(reads) == 1

    def changed() -> None:
        digest = worker.digest()
        assert digest not in seen and worker.digest() == digest
        seen.append(digest)

    worker.apply_gradients([torch.ones_like(p) for p in worker.params], end_epoch=True)
    changed()
    worker.skip_to(worker.epoch + 2)
    changed()
    worker.take_gradients(end_epoch=True)
    changed()
    meta, tensors = worker.state_tensors()
    worker.load_state(meta, [tensors[0] + 1, *tensors[1:]])
    changed()
    with worker.changing_state():
        worker.params[0].data.mul_(2)
    changed()
    assert len(reads) == 1 + 5 + 1  # one per state, and the state_tensors above

    # a state sent to a joiner is hashed once, from its copy, and Info's digest reads that hash
    worker.apply_gradients([torch.ones_like(p) for p in worker.params], end_epoch=True)
    meta, tensors, sent = worker.shared_state()
    assert sent == state_digest(tensors, meta) and sent not in [d for _, d in seen]
    assert worker.digest() == (worker.epoch, sent) and len(reads) == 1 + 5 + 1 + 1
    assert worker.shared_state()[2] == sent and len(reads) == 1 + 5 + 1 + 2  # a copy each time, no hash


def test_a_states_digest_covers_its_low_rank_factors_read_with_the_parameters_they_go_with(tmp_path):
    """With ACP-SGD a joiner copies the stage's factors with its state. A donor that hands other factors (they spoil
    the stage's next rounds) hands a state whose digest is not the one its peers tell, so they do not vouch for it.
    A round keeps its factors before the step they belong to: the state shared (and hashed) between the two still
    carries the factors that go with the parameters not yet stepped, as every peer's does at that point."""
    worker = StageWorker(Stage(tiny_test(), 1), OptimizerConfig(), ComputeConfig(), torch.device("cpu"))
    acp = AcpState(Layout.of([p.shape for p in worker.params], 2), seed=2)
    assert acp.layout.matrices, "the stage must have a low-rank tensor"
    worker.share_with_state(acp.shared_tensors)
    epoch, before = worker.digest()
    meta, tensors, digest = worker.shared_state()
    k = meta["lowrank"]
    assert digest == before == state_digest(tensors, meta) and k == len(acp.shared_tensors())
    assert all(torch.equal(x, y) for x, y in zip(tensors[-k:], acp.shared_tensors(), strict=True))
    other_factors = [*tensors[:-1], tensors[-1] + 1]
    assert state_digest(other_factors, meta) != digest

    grads = [torch.randn_like(p) for p in worker.params]
    rnd = acp.compress(grads, 0, 4.0)
    old_factors = acp.shared_tensors()
    acp.commit(rnd, rnd.factors, had_samples=True)  # the round's factors, kept before its step
    assert not all(torch.equal(x, y) for x, y in zip(old_factors, acp.shared_tensors(), strict=True))
    meta, state, factors = worker.state_and_shared()
    for copy in (
        [*state, *factors],
        worker.shared_state()[1],
    ):  # read afresh, not the cached digest: the factors that go with these parameters
        assert all(torch.equal(x, y) for x, y in zip(copy[-k:], old_factors, strict=True))
        assert state_digest(copy, {**meta, "lowrank": k}) == before
    save_checkpoint(worker, tmp_path, acp)  # saved between the round and its step: the same pairing
    resumed = StageWorker(Stage(tiny_test(), 1), OptimizerConfig(), ComputeConfig(), torch.device("cpu"))
    resumed_acp = AcpState(acp.layout, seed=3)
    resumed.share_with_state(resumed_acp.shared_tensors)
    load_checkpoint(resumed, tmp_path, resumed_acp)
    assert resumed.digest() == (epoch, before)
    resumed.shutdown()
    worker.apply_gradients(grads, end_epoch=True)
    meta, tensors, stepped = worker.shared_state()
    assert stepped != before and worker.digest() == (epoch + 1, stepped) == (epoch + 1, state_digest(tensors, meta))
    assert all(torch.equal(x, y) for x, y in zip(tensors[-k:], acp.shared_tensors(), strict=True))

    # a downloaded state's factors are loaded with its parameters, in one change
    donor = [t + 1 for t in acp.shared_tensors()]
    worker.load_state(meta, tensors[:-k], lambda: acp.load_shared(donor))
    meta, tensors, loaded = worker.shared_state()
    assert loaded not in (before, stepped) and loaded == state_digest(tensors, meta)
    assert all(torch.equal(x, y) for x, y in zip(tensors[-k:], donor, strict=True))
    with pytest.raises(ValueError):  # a refused state changes neither the parameters nor the factors
        worker.load_state({**meta, "n_params": 1}, tensors[:-k], lambda: acp.load_shared(old_factors))
    assert worker.digest()[1] == loaded and all(
        torch.equal(x, y) for x, y in zip(acp.shared_tensors(), donor, strict=True)
    )


async def test_a_state_whose_low_rank_factors_are_not_the_stages_is_not_vouched_for():
    """Two peers at the state's epoch tell the digest of the state they hold, factors included: a donor's state
    with the same parameters and other factors is refused; the one they hold is loaded, factors and all."""
    donor = StageWorker(Stage(tiny_test(), 1), OptimizerConfig(), ComputeConfig(), torch.device("cpu"))
    ours = StageWorker(Stage(tiny_test(), 1), OptimizerConfig(), ComputeConfig(), torch.device("cpu"))
    layout = Layout.of([p.shape for p in donor.params], 2)
    theirs, mine = AcpState(layout, seed=2), AcpState(layout, seed=2)
    donor.share_with_state(theirs.shared_tensors)
    ours.share_with_state(mine.shared_tensors)
    donor.apply_gradients([torch.randn_like(p) for p in donor.params], end_epoch=True)
    meta, tensors, honest = donor.shared_state()
    k = meta["lowrank"]
    forged = [*tensors[:-k], *(t.flip(0) for t in tensors[-k:])]

    class Vouching(Peers):
        async def state_of(self, peer_id: str, timeout: float) -> tuple[int, str] | None:
            return donor.digest()

    split_state = functools.partial(StageAverager.split_state, SimpleNamespace(lowrank=mine))  # the averager's own
    averager = SimpleNamespace(exact_states=True, lowrank=mine, split_state=split_state)
    peers = Vouching("me", {"donor": 8, "b": 8, "c": 8}, epoch=meta["epoch"])
    try:
        recovery = Recovery(ours, averager, peers, AveragingConfig(), 1, pool=None)
        with pytest.raises(Unvouched):
            await recovery.vouch("donor", meta, forged)
        assert await recovery.vouch("donor", meta, tensors) == (honest, 2)
        recovery.load(meta, tensors, digest=honest)
        assert ours.digest() == donor.digest()
        assert all(torch.equal(x, y) for x, y in zip(mine.shared_tensors(), theirs.shared_tensors(), strict=True))
    finally:
        donor.shutdown(), ours.shutdown()


def twin_workers(optimizer: str = "adamw", tied: bool = False) -> tuple[StageWorker, StageWorker]:
    """Two peers of stage 1 (stage 0 with its tied weight: `tied`) holding one state after three steps together
    (epoch 3, with optimizer moments)."""
    cfg, index = (dataclasses.replace(tiny_test(), tie_embeddings=True), 0) if tied else (tiny_test(), 1)
    ours, reference = (
        StageWorker(Stage(cfg, index), OptimizerConfig(optimizer=optimizer), ComputeConfig(), torch.device("cpu"))
        for _ in range(2)
    )
    torch.manual_seed(0)
    for _ in range(3):
        grads = [0.01 * torch.randn_like(p) for p in ours.params]
        for worker in (ours, reference):
            worker.apply_gradients(grads, end_epoch=True)
    reference.load_state(*ours.state_tensors())
    return ours, reference


def liar(reference: StageWorker, how: str) -> None:
    """What the reference does instead of one step on its own gradients."""
    grads = [0.01 * torch.randn_like(p) for p in reference.params]
    if how == "huge gradient":  # one honest step on a gradient no step can hold (norm 1000 x --clip-grad-norm)
        total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
        grads = [g * (1000 / total) for g in grads]
        with reference.changing_state():  # as a peer without clipping would
            for p, g in zip(reference.params, grads, strict=True):
                p.grad = g
            reference.optimizer.step()
            reference.param_version += 1
            reference.epoch += 1
        return
    reference.apply_gradients(grads, end_epoch=True)
    with reference.changing_state(), torch.no_grad():
        if how == "nudged parameters":  # the step, plus a small push of its own
            reference.params[0].add_(1e-4)
        elif how == "second moments":  # moments that no gradient gives with the first ones
            reference.optimizer.state[reference.params[0]]["exp_avg_sq"].mul_(2)
        elif how == "step count":  # a count the moments do not go with
            reference.optimizer.state[reference.params[0]]["step"] += 1
        elif how == "no first moment":  # stepped, but shows no first moment to replay (its next step would fail)
            del reference.optimizer.state[reference.params[0]]["exp_avg"]
        elif how == "malformed":  # a step count of two values: the replay raises (it escaped the recovery before)
            reference.optimizer.state[reference.params[0]]["step"] = torch.tensor([4.0, 4.0])


def sending(source: StageWorker) -> SimpleNamespace:
    """What Recovery reads of the stage averager: its downloads bring `source`'s state as it is then."""
    return SimpleNamespace(
        allow_state_sharing=True,
        lowrank=None,
        exact_states=True,
        split_state=lambda meta, tensors: (tensors, []),
        download_state=lambda *a, **k: source.state_tensors(),
    )


def copier(ours: StageWorker, reference: StageWorker) -> tuple[Recovery, Peers]:
    """We (b, 4 samples) copy a (8 samples) after our failed round; a already reports the next epoch."""
    peers = Peers("b", {"a": 8}, epoch=ours.epoch + 1)
    return Recovery(ours, sending(reference), peers, AveragingConfig(averaging_timeout=5.0), 1, pool=None), peers


@pytest.mark.parametrize("optimizer", ["adamw", "lamb"])
def test_after_a_failed_round_the_reference_is_copied_when_its_state_is_ours_one_step_on(optimizer):
    ours, reference = twin_workers(optimizer)
    try:
        reference.apply_gradients([0.01 * torch.randn_like(p) for p in reference.params], end_epoch=True)
        recovery, peers = copier(ours, reference)
        ours.take_gradients()
        assert recovery.after_failed_round([torch.zeros_like(p) for p in ours.params], 4) is None  # copied
        assert ours.digest() == reference.digest() and not peers.refused
    finally:
        ours.shutdown(), reference.shutdown()


@pytest.mark.parametrize(
    "how", ["nudged parameters", "second moments", "step count", "no first moment", "malformed", "huge gradient"]
)
def test_a_reference_whose_state_is_not_one_honest_step_from_ours_is_refused_and_we_step_alone(how):
    """A listed peer that claims the most samples becomes the reference after a failed round, and every other peer
    used to load whatever state it then sent (finite, our optimizer settings). Now the copy replays the step the
    state's first moments imply on our own state (we held the same one): parameters moved beyond that step, moments
    no gradient gives, a step count one step does not give, a step without a first moment, a malformed state, or a
    gradient above --clip-grad-norm are refused; it is
    no reference of ours any more, and we (the only peer left) step alone on our own gradients."""
    ours, reference = twin_workers()
    try:
        liar(reference, how)
        recovery, peers = copier(ours, reference)
        before = ours.digest()
        grads = [torch.zeros_like(p) for p in ours.params]
        assert recovery.after_failed_round(grads, 4) is grads
        assert peers.refused == {"a"} and ours.digest() == before
        # not for ever: honest peers whose hardware rounds differently may refuse each other; the stage becomes one
        # model again (through its lineages) once the refusal lapses
        assert "a" in peers.distrusted(ours.epoch + REFUSED_EPOCHS - 1)
        assert "a" not in peers.distrusted(ours.epoch + REFUSED_EPOCHS)
    finally:
        ours.shutdown(), reference.shutdown()


@pytest.mark.parametrize("optimizer", ["adamw", "lamb"])
@pytest.mark.parametrize("steps", [2, 3, 0])
def test_an_honest_reference_at_another_version_is_copied_and_not_refused(steps, optimizer):
    """An honest reference may be a step further by the time we ask (it ended the next epoch too: half the copies in
    a soak), or have ended the epoch without a step (its step skipped): its state cannot be replayed on ours, but it
    is within reach of ours in that many steps, and is loaded (leaving the epoch open instead kept the peer serving
    the next global batch at the old version: CI, a stage-1 microbatch of global batch 1 at version 0)."""
    ours, reference = twin_workers(optimizer)
    try:
        for _ in range(steps):
            reference.apply_gradients([0.01 * torch.randn_like(p) for p in reference.params], end_epoch=True)
        if not steps:
            with reference.changing_state():
                reference.epoch += 1
        recovery, peers = copier(ours, reference)
        ours.take_gradients()
        assert recovery.after_failed_round([torch.zeros_like(p) for p in ours.params], 4) is None
        assert not peers.refused and ours.digest() == reference.digest()
    finally:
        ours.shutdown(), reference.shutdown()


@pytest.mark.parametrize(
    "how", ["parameters of its own", "a huge first moment", "shrunk second moments", "steps it did not take",
            "a changed state with no step", "behind our version", "huge gradients", "more steps than epochs"]
)  # fmt: skip
def test_a_reference_claiming_another_version_is_held_to_what_that_many_steps_can_do(how):
    """A liar that claims to be two steps on (or none) is not replayed, and was loaded on its word: any parameters
    at all. Now its state must be within reach of ours in that many steps: each value moved by at most the
    optimizer's largest step, moments that gradients of norm --clip-grad-norm could leave, a step count that many
    steps give, nothing changed without a step, no version behind ours. Refused like a lying one-step reference."""
    ours, reference = twin_workers()
    try:
        versions = 0 if how == "a changed state with no step" else 2
        grads = [0.01 * torch.randn_like(p) for p in reference.params]
        if how == "huge gradients":  # two honest steps, each on a gradient 1000 x --clip-grad-norm (no clipping)
            total = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in grads]))
            grads = [g * (1000 / total) for g in grads]
        for _ in range(versions):
            with reference.changing_state():
                for p, g in zip(reference.params, grads, strict=True):
                    p.grad = g
                reference.optimizer.step()
                reference.param_version += 1
        with reference.changing_state(), torch.no_grad():
            reference.epoch += max(versions, 1)  # a step an epoch at most
            state = reference.optimizer.state[reference.params[0]]
            if how == "parameters of its own":  # two steps' worth of state, but weights of its choosing
                reference.params[0].mul_(-1)
            elif how == "a huge first moment":  # its next steps would be huge: m far above sqrt(v)
                state["exp_avg"].fill_(1.0)
            elif how == "shrunk second moments":  # its next steps would be huge: v gone
                state["exp_avg_sq"].mul_(1e-6)
            elif how == "steps it did not take":
                state["step"] += 5
            elif how == "a changed state with no step":
                reference.params[0].add_(1e-3)
            elif how == "behind our version":
                reference.param_version = ours.param_version - 1
            elif how == "more steps than epochs":  # two honest steps in two epochs, claimed as three
                state["step"] += 1
                reference.param_version += 1
                for other in reference.params[1:]:
                    if other in reference.optimizer.state:
                        reference.optimizer.state[other]["step"] += 1
        recovery, peers = copier(ours, reference)
        before = ours.digest()
        grads = [torch.zeros_like(p) for p in ours.params]
        assert recovery.after_failed_round(grads, 4) is grads
        assert peers.refused == {"a"} and ours.digest() == before
    finally:
        ours.shutdown(), reference.shutdown()


@pytest.mark.parametrize("optimizer", ["adamw", "lamb"])
def test_no_honest_history_leaves_the_bounds_of_that_many_steps_and_the_worst_one_reaches_them(optimizer):
    """`not_within_steps` against honest states k steps on, of gradient sequences built to reach its bounds: one
    gradient of norm G, then ones falling as (beta1 / beta2)^i (the sequence that makes |m| / sqrt(v) largest), signs
    flipping, zeros, a parameter left without a gradient. None is refused; the bound on |m| / sqrt(v) is met within
    rounding by the worst sequence, so it is no looser than it must be."""
    torch.manual_seed(3)
    beta1, beta2 = 0.9, 0.999
    t = 40
    worst = [(beta1 / beta2) ** (t - 1 - i) for i in range(t)]
    m = sum((1 - beta1) * beta1 ** (t - 1 - i) * g for i, g in enumerate(worst))
    v = sum((1 - beta2) * beta2 ** (t - 1 - i) * g * g for i, g in enumerate(worst))
    assert m / math.sqrt(v) == pytest.approx(moment_ratio_bound(beta1, beta2, t), rel=1e-9)
    for sequence in ("worst", "random", "flipping", "zeros", "underflowing"):
        params = [torch.randn(8, 4), torch.randn(4), torch.randn(3)]
        optimizer_ = build_optimizer(optimizer, params, lr=2e-3, weight_decay=0.01)
        history = []
        for step in range(12):
            g = {"worst": worst[-12 + step], "random": 1.0, "flipping": (-1) ** step, "zeros": float(step % 3 != 0)}
            grads = [g.get(sequence, 1.0) * torch.randn_like(p) for p in params[:2]]
            norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(x) for x in grads])))
            for p, x in zip(params, grads, strict=False):
                p.grad = x / max(norm, 1e-12)  # norm 1: --clip-grad-norm 1
            if sequence == "underflowing":  # a tensor whose gradients' squares underflow float32 (v denormal or 0)
                params[1].grad = torch.full_like(params[1], 1e-22)
            optimizer_.step()
            history.append(
                (
                    [p.clone() for p in params],
                    {i: {k: x.clone() for k, x in s.items()} for i, s in optimizer_.state_dict()["state"].items()},
                )
            )
        groups = optimizer_.state_dict()["param_groups"]
        for first in (2, 5):
            for k in (0, 1, 2, 3, 6):
                (before, before_state), (after, after_state) = history[first], history[first + k]
                why = not_within_steps(optimizer, before, before_state, groups, after, after_state, k, 1.0 + 1e-6)
                assert why is None, (sequence, first, k, why)
        # and one step too few for what happened is refused, as is a claim too far on to bound (nor worth the time)
        (before, before_state), (after, after_state) = history[2], history[5]
        assert not_within_steps(optimizer, before, before_state, groups, after, after_state, 2, 1.0) is not None
        far = not_within_steps(optimizer, before, before_state, groups, after, after_state, 10**9, 1.0)
        assert far is not None and "more than the" in far


@pytest.mark.parametrize("optimizer", ["adamw", "lamb"])
@pytest.mark.parametrize("how", ["honest", "honest, our copy a step behind", "weights of its choosing",
                                 "moments that steer", "honest, two steps on"])  # fmt: skip
def test_a_references_tied_weight_is_held_to_what_steps_and_drift_can_do(how, optimizer):
    """The tied weight is not replayed with the rest (its own round replaced its state before the step, and its
    copies drift apart after a tied round that failed for some peers, until the next average of their states), and
    a reference's was loaded as sent: any finite weight, and moments whose next steps are as large as it likes. Now
    it must be our copy moved by at most the steps since, plus two an epoch of drift since the last average, and
    hold moments some gradients leave; an honest reference, our copy a step apart, passes."""
    ours, reference = twin_workers(optimizer, tied=True)
    i = ours.tied_index
    try:
        assert i is not None
        grads = [0.01 * torch.randn_like(p) for p in reference.params]
        if how == "honest, our copy a step behind":  # our tied round of the last epoch failed; the reference's ended
            ours.apply_gradients([None if j == i else g for j, g in enumerate(grads)], end_epoch=True)
            reference.apply_gradients(grads, end_epoch=True)
            grads = [0.01 * torch.randn_like(p) for p in reference.params]
        for _ in range(2 if how == "honest, two steps on" else 1):
            reference.apply_gradients(grads, end_epoch=True)
        with reference.changing_state(), torch.no_grad():
            if how == "weights of its choosing":
                reference.tied.fill_(1.0)
            elif how == "moments that steer":  # |m| a thousand times sqrt(v): its next steps would be huge
                state = reference.optimizer.state[reference.tied]
                state["exp_avg"].copy_(1000 * state["exp_avg_sq"].sqrt() + 1e-3)
        recovery, peers = copier(ours, reference)
        ours.take_gradients()
        before = ours.digest()
        grads = [torch.zeros_like(p) for p in ours.params]
        if how.startswith("honest"):
            assert recovery.after_failed_round(grads, 4) is None  # copied
            assert ours.digest() == reference.digest() and not peers.refused
        else:
            assert recovery.after_failed_round(grads, 4) is grads  # refused: we step alone
            assert peers.refused == {"a"} and ours.digest() == before
    finally:
        ours.shutdown(), reference.shutdown()


def test_a_tied_copy_is_held_to_moments_gradients_leave_and_a_bounded_move():
    """`not_within_drift` alone: a parameter with moments some gradients leave, moved within the bound, passes;
    moments no gradients leave, negative second moments, a move beyond the steps, or a stepped parameter without
    moments do not; with no bound on the steps (no averages of the copies), only the moments are held."""
    torch.manual_seed(5)
    w = torch.randn(8, 4)
    optimizer = build_optimizer("adamw", [w.clone().requires_grad_()], lr=2e-3, weight_decay=0.01)
    groups = optimizer.state_dict()["param_groups"]
    honest = {"step": torch.tensor(3.0), "exp_avg": 0.01 * torch.randn(8, 4), "exp_avg_sq": torch.full((8, 4), 1e-3)}
    check = functools.partial(not_within_drift, "adamw", w, groups)
    assert check(w + 0.01, honest, 2) is None
    assert check(w + 1.0, honest, 2) is not None and check(w + 1.0, honest, None) is None
    assert check(w, {**honest, "exp_avg": torch.ones(8, 4)}, None) is not None
    assert check(w, {**honest, "exp_avg_sq": -torch.ones(8, 4)}, None) is not None
    assert check(w, {"step": torch.tensor(3.0)}, None) is not None
    assert check(w, {**honest, "step": torch.tensor(0.0)}, None) is not None  # moments its next step takes as one's
    assert check(w, {}, 0) is None and check(w + 1e-3, {}, 0) is not None


def catching_up(ours: StageWorker, source: StageWorker, holders: int = 0) -> tuple[Recovery, Peers]:
    """We (b) catch up from a, which reports a later epoch; `holders` other peers at a's epoch (c, d, ...) say they
    hold the state a sends (0: a is alone at the furthest epoch, nobody vouches for it or against it)."""
    others = [chr(ord("c") + i) for i in range(holders)]

    class Holding(Peers):
        async def state_of(self, peer_id: str, timeout: float) -> tuple[int, str] | None:
            return source.digest()

    peers = Holding("b", dict.fromkeys(["a", *others], 8), epoch=source.epoch)
    peers.p2p_ids = {p: f"Qm{p}" for p in peers.peers}
    return Recovery(ours, sending(source), peers, AveragingConfig(averaging_timeout=5.0), 1, pool=None), peers


@pytest.mark.parametrize("steps", [1, 3])
async def test_a_peer_catching_up_takes_an_honest_state_its_sender_alone_holds(steps):
    ours, source = twin_workers()
    try:
        for _ in range(steps):
            source.apply_gradients([0.01 * torch.randn_like(p) for p in source.params], end_epoch=True)
        recovery, peers = catching_up(ours, source)
        assert await recovery.download("a", keep_gradients=True, checked=True)
        assert ours.digest() == source.digest() and not peers.refused
    finally:
        ours.shutdown(), source.shutdown()


@pytest.mark.parametrize("how", ["nudged parameters", "second moments", "huge gradient", "parameters of its own"])
async def test_a_state_its_sender_alone_holds_is_held_to_ours_when_catching_up(how):
    """A peer catching up copies the peer furthest ahead; nobody else at that epoch to vouch for it or against it
    (the peer alone at the furthest epoch, which any listed peer can claim to be within what stage 0's admissions
    show), its state was loaded as sent. Now a peer that holds an ancestor of the stage's state (not diverged) takes
    it only within reach of ours, as a copy after a failed round (replayed one step on, bounded further on), and
    refuses its sender otherwise; a state another peer at its epoch holds too is taken on their word, and a peer
    that diverged (its state is no ancestor) takes what it is sent, as before."""
    ours, source = twin_workers()
    try:
        if how == "parameters of its own":  # two steps on, and weights of its choosing
            for _ in range(2):
                source.apply_gradients([0.01 * torch.randn_like(p) for p in source.params], end_epoch=True)
            with source.changing_state(), torch.no_grad():
                source.params[0].mul_(-1)
        else:
            liar(source, how)
        recovery, peers = catching_up(ours, source)
        before = ours.digest()
        assert not await recovery.download("a", keep_gradients=True, checked=True)
        assert peers.refused == {"a"} and ours.digest() == before and recovery.downloads == 0
        assert await recovery.download("a", keep_gradients=True, checked=False)  # diverged: no ancestor to check on
        assert ours.digest() == source.digest()
        ours.load_state(*twin_workers()[0].state_tensors())
        recovery, peers = catching_up(ours, source, holders=1)
        assert await recovery.download("a", keep_gradients=True, checked=True)  # another peer holds it: their word
        assert ours.digest() == source.digest() and not peers.refused
    finally:
        ours.shutdown(), source.shutdown()


@pytest.mark.parametrize("epochs", [MAX_BOUNDED_STEPS + 1, 2])
async def test_a_state_too_far_on_to_check_is_taken_on_its_peers_word_if_its_epochs_allow_its_steps(epochs):
    """A peer restarted from an old checkpoint may be thousands of versions behind: no bound says anything there
    (`not_within_steps` refuses any claim past MAX_BOUNDED_STEPS), so the state is taken unchecked, as before. Not
    one that claims more steps than epochs (a step an epoch at most), which would carry any state past the check."""
    ours, source = twin_workers()
    try:
        with source.changing_state(), torch.no_grad():
            source.param_version += MAX_BOUNDED_STEPS + 1
            source.epoch += epochs
            source.params[0].mul_(-1)
        recovery, peers = catching_up(ours, source)
        before = ours.digest()
        if epochs > MAX_BOUNDED_STEPS:
            assert await recovery.download("a", keep_gradients=True, checked=True)
            assert ours.digest() == source.digest()
        else:
            assert not await recovery.download("a", keep_gradients=True, checked=True)
            assert ours.digest() == before and peers.refused == {"a"}
    finally:
        ours.shutdown(), source.shutdown()


async def test_a_state_whose_version_is_no_number_refuses_its_sender():
    ours, source = twin_workers()
    try:
        recovery, peers = catching_up(ours, source)
        meta, tensors = source.state_tensors()
        recovery.averager.download_state = lambda *a, **k: ({**meta, "param_version": math.inf}, tensors)
        assert not await recovery.download("a", keep_gradients=True, checked=True)
        assert peers.refused == {"a"}
    finally:
        ours.shutdown(), source.shutdown()


@pytest.mark.parametrize(
    "how", ["schedule far back", "last rates above the peak", "parameters reordered", "a moment of another shape",
            "a step of two values", "a scalar that is not a number", "state for a parameter we lack"]
)  # fmt: skip
def test_a_state_that_would_break_or_steer_our_next_steps_is_refused_whole(how):
    """What a state carries besides parameters and moments was loaded as sent: a schedule position of -10^6 made our
    learning rate negative (gradient ascent at 1e5 x the peak), a parameter group listing its parameters in another
    order hung one parameter's moments on another (the next step raised, and every step after), moments of another
    shape likewise. Each is refused (ValueError) and nothing of ours changes, on every path that loads a state
    (joins, catch-ups, copies, checkpoints)."""
    ours, other = twin_workers()
    try:
        meta, tensors = other.state_tensors()
        meta = json.loads(json.dumps(meta))  # as it travels: lists for tuples
        n = meta["n_params"]
        if how == "schedule far back":
            meta["schedule"]["last_epoch"] = -(10**6)
        elif how == "last rates above the peak":
            meta["schedule"]["_last_lr"] = [1e6]
        elif how == "parameters reordered":
            meta["param_groups"][0]["params"] = [1, 0, *range(2, n)]
        elif how == "a moment of another shape":
            slot = next(i for i, (_, key) in enumerate(meta["slots"]) if key == "exp_avg")
            tensors[n + slot] = tensors[n + slot].flatten()[:1].clone()
        elif how == "a step of two values":
            slot = next(i for i, (_, key) in enumerate(meta["slots"]) if key == "step")
            tensors[n + slot] = torch.tensor([4.0, 4.0])
        elif how == "a scalar that is not a number":
            meta["scalars"]["0/step"] = float("nan")
        elif how == "state for a parameter we lack":
            meta["scalars"][f"{n + 5}/step"] = 3.0
        before = ours.digest()
        with pytest.raises(ValueError):
            ours.load_state(meta, tensors)
        assert ours.digest() == before
    finally:
        ours.shutdown(), other.shutdown()


def test_of_a_states_schedule_only_its_position_is_loaded():
    """Base rates of 1e6 and a key our schedule lacks were loaded as sent (our next rate 1e6; every step after raised).
    Now our schedule takes the state's position and last rates only: the next step runs at a rate within the peak."""
    ours, other = twin_workers()
    try:
        meta, tensors = other.state_tensors()
        meta["schedule"] = {**meta["schedule"], "base_lrs": [1e6], "optimizer": 1}
        ours.load_state(meta, tensors)
        assert ours.schedule.base_lrs == other.schedule.base_lrs
        assert ours.schedule.last_epoch == other.schedule.last_epoch
        ours.apply_gradients([0.01 * torch.randn_like(p) for p in ours.params], end_epoch=True)
        assert ours.optimizer.param_groups[0]["lr"] <= OptimizerConfig().lr
    finally:
        ours.shutdown(), other.shutdown()


def test_replaying_a_step_finds_the_gradient_it_took_and_leaves_its_inputs_alone():
    torch.manual_seed(1)
    params = [torch.randn(6, 4, requires_grad=True), torch.randn(4, requires_grad=True), torch.randn(2)]
    optimizer = build_optimizer("adamw", params, lr=1e-3, weight_decay=0.01)
    before = [p.detach().clone() for p in params]
    grads = [torch.randn_like(params[0]), torch.randn_like(params[1])]
    for p, g in zip(params, grads, strict=False):
        p.grad = g
    optimizer.step()  # a first step: no moments before it
    after = [p.detach().clone() for p in params]
    state = {i: {k: v.clone() for k, v in s.items()} for i, s in optimizer.state_dict()["state"].items()}
    groups = optimizer.state_dict()["param_groups"]
    why, implied = replay_step("adamw", before, {}, groups, after, state)
    assert why is None and implied[2] is None
    assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(implied[:2], grads, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(after, [p.detach() for p in params], strict=True))
    moved = [t.clone() for t in after]
    moved[2] += 1  # a parameter that did not step, changed
    assert replay_step("adamw", before, {}, groups, moved, state)[0] == (
        "parameter 2 or its optimizer state changed without a step"
    )


def test_a_replayed_step_allows_rounding_of_large_values_and_nothing_more():
    """A step far below a value's precision (a small step on a large weight) may round to the neighbouring float
    elsewhere (a GPU's fused kernels): a few units in the last place pass, a change of the step's own size does not."""
    replayed = torch.full((4,), 1000.0)
    ulp = float(torch.finfo(torch.float32).eps) * 1000.0
    step = 1e-5  # of which the float32 value 1000 holds nothing: the change rounds away
    assert _close(replayed, replayed + ulp, step) and _close(replayed, replayed - 2 * ulp, step)
    assert not _close(replayed, replayed + 64 * ulp, step)
    small = torch.full((4,), 1e-3)
    assert not _close(small, small + 1e-6, 1e-5)  # beyond REPLAY_RTOL of the change, far above an ulp of 1e-3
